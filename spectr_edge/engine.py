"""The decoding loops: target-only, and SpecTr speculative steps (SPECTR.md section 2).

Cache invariant between steps (both loops): `ids` is every committed token (prompt + output);
the target cache holds ids[:-1], the last committed token is fed at the start of the next
target call. The draft cache holds ids[:draft_seen]; the draft catches up on the rest
(one or two tokens) at the start of its next step.

Each loop is a generator that yields the list of tokens committed by each step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from . import selection
from .lookup import GUESS, PromptLookup
from .policy import AdaptiveLength, CostCurve
from .onnx_model import OnnxLM
from .sampling import SamplingParams, greedy_token, logits_to_probs, sample
from .stats import GenerationStats


@dataclass(frozen=True)
class DecodeRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    num_candidates: int          # 0 = target only
    draft_len: int
    eos_ids: frozenset[int]
    draft_stop: float = 0.0      # stop drafting early when the draft's confidence falls below this (0 = off)
    drafter: str = "model"       # model | lookup | model+lookup (lookup first, the model when it finds nothing)
    lookup_len: int = 8          # the most tokens a prompt-lookup step verifies
    lookup_ngram: tuple[int, int] = (1, 3)   # (min, max) n-gram size matched by prompt lookup
    adaptive: bool = False       # k = 1: choose each step's draft length (0 = plain step) by policy.AdaptiveLength
    tree_budget: int = 0         # greedy: draft a dynamic tree of this many nodes (OPT-Tree style), depth <= draft_len
    draft_window: int = 0        # the draft reads at most this many prompt tokens (the latest; 0 = all of them)


class Engine:
    """Target-only and speculative decoding over one target and an optional draft."""

    def __init__(self, target: OnnxLM, draft: OnnxLM | None, vocab_size: int, cost: CostCurve | None = None,
                 draft_cost: float = 0.15, draft_rows: CostCurve | None = None):
        self.target, self.draft, self.vocab_size = target, draft, vocab_size
        self.cost = (cost or CostCurve.for_quant(target.spec.quant)).floored(target.spec.min_call_tokens,
                                                                             target.spec.call_multiple)
        self.draft_cost = draft_cost      # one drafted token, in target single-token decodes
        # a draft call over k rows, relative to one row (MatMulNBits cost grows with rows like with tokens)
        self.draft_rows = draft_rows or CostCurve.for_quant(draft.spec.quant if draft is not None else "none")
        self.lookup_table = None          # ngram_table.NgramTable: prompt lookup's guess when nothing matches
        self.context_length = target.spec.context_length
        if draft is not None:
            self.context_length = min(self.context_length, draft.spec.context_length)

    # -- one token from one row of logits, exactly as plain sampling does it ---------------------
    def _charge(self, stats: GenerationStats, scored: int) -> None:
        """Count one decode-phase target call scoring `scored` tokens, and its predicted cost."""
        stats.target_calls += 1
        stats.cost_units += self.cost(scored)

    def _choose(self, logits: np.ndarray, sampling: SamplingParams, rng: np.random.Generator) -> int:
        if sampling.greedy:
            return int(greedy_token(logits, self.vocab_size))
        return int(sample(logits_to_probs(logits, sampling, self.vocab_size), rng))

    def run(self, req: DecodeRequest, rng: np.random.Generator, stats: GenerationStats) -> Iterator[list[int]]:
        """Yield committed tokens step by step until max_new_tokens, eos or the end of the context."""
        loop = self._speculative if req.num_candidates > 0 else self._target_only
        emitted = 0
        for tokens in loop(req, rng, stats):
            tokens = tokens[:req.max_new_tokens - emitted]
            for i, tok in enumerate(tokens):
                if tok in req.eos_ids:       # tokens after eos are never shown
                    tokens, stats.stop_reason = tokens[:i + 1], "eos"
                    break
            emitted += len(tokens)
            yield tokens
            if stats.stop_reason == "eos":
                return
            if emitted >= req.max_new_tokens:
                stats.stop_reason = "max_new_tokens"
                return
        stats.stop_reason = stats.stop_reason or "context"

    def _prefill(self, req, rng, stats) -> tuple[list[int], object]:
        """Run the prompt through the target; return ids with the first new token, and the cache."""
        cache = self.target.new_cache()
        logits = self.target.forward(np.asarray([req.prompt_ids], dtype=np.int64), cache, last=1)  # [1, <=P, W]
        stats.target_calls += 1
        t0 = time.perf_counter()
        first = self._choose(logits[0, -1], req.sampling, rng)
        stats.seconds_select += time.perf_counter() - t0
        return list(req.prompt_ids) + [first], cache

    def _target_only(self, req, rng, stats) -> Iterator[list[int]]:
        ids, cache = self._prefill(req, rng, stats)
        yield [ids[-1]]
        while len(ids) < self.context_length:
            logits = self.target.forward(np.asarray([[ids[-1]]], dtype=np.int64), cache)  # [1, 1, W]
            self._charge(stats, 1)
            t0 = time.perf_counter()
            ids.append(self._choose(logits[0, -1], req.sampling, rng))
            stats.seconds_select += time.perf_counter() - t0
            yield [ids[-1]]

    # -- speculative decoding ---------------------------------------------------------------
    def _speculative(self, req, rng, stats) -> Iterator[list[int]]:
        use_model = req.drafter != "lookup"
        # a greedy draft is deterministic: k candidates would all be the same row. With a tree
        # target, k > 1 at temperature 0 means k branches per depth: the chain + k - 1 leaves.
        greedy_tree = use_model and req.sampling.greedy and req.num_candidates > 1 and self.target.takes_tree
        dynamic_tree = (use_model and req.tree_budget > 0 and self.target.takes_tree and self.draft.takes_tree)
        shape = None if req.sampling.greedy or not dynamic_tree else sequoia_shape(req.tree_budget, req.draft_len)
        num_candidates = 1 if req.sampling.greedy and not greedy_tree else req.num_candidates
        lookup = None
        # the table's and the guess head's one-token guesses: with lookup alone, or weighed against the model
        guess_role = req.drafter == "lookup" or req.adaptive
        if req.drafter != "model":
            # the table has a guess almost always: before the model it would leave the model nothing
            # to draft, unless the adaptive rule weighs each guess against the model
            table = self.lookup_table if guess_role else None
            lookup = PromptLookup(self.cost, req.lookup_len, max_ngram=req.lookup_ngram[1],
                                  min_ngram=req.lookup_ngram[0], table=table)
        # --draft lookup -k N (a tree target): up to N copied candidates verified as one token trie
        lookup_count = req.num_candidates if not use_model and self.target.takes_tree else 1
        stats.num_candidates = num_candidates if use_model else lookup_count
        stats.draft_len = req.draft_len if use_model else req.lookup_len
        stats.reached, stats.accepted_at = [0] * stats.draft_len, [0] * stats.draft_len
        policy = None
        if req.adaptive and use_model and num_candidates == 1:
            policy = AdaptiveLength(self.cost, self.draft_cost, req.draft_len)
        ids, t_cache = self._prefill(req, rng, stats)
        # the target's guess head (export/guess_head.py): its guess for the token after ids[-1], when
        # the latest target call was a prefill, a plain step or a prompt-lookup step; only prompt
        # lookup with its table's role (a guess in the second slot) uses it
        use_guess = lookup is not None and guess_role and self.target.spec.guess is not None
        guess = self._guess_after(-1) if use_guess else None
        yield [ids[-1]]
        d_cache, draft_seen = (self.draft.new_cache() if use_model else None), 0
        if use_model and req.draft_window > 0:
            # the draft prefills only the prompt's latest tokens: its prefill is the largest draft
            # cost on long prompts, and what it drafts never changes the output law
            draft_seen = d_cache.offset = max(0, len(ids) - 1 - req.draft_window)
        emitted = 1
        while len(ids) < self.context_length:
            # a step emits up to L + 1 tokens; never draft past the budget or the context
            budget = min(req.max_new_tokens - emitted - 1, self.context_length - len(ids) - 1)
            draft_len = min(req.draft_len, budget)
            proposal, trie_rows = [], None
            if lookup is not None and budget >= 1 and lookup_count > 1:
                # several copied candidates in one token trie: a chain is verified as one draft
                t0 = time.perf_counter()
                trie_rows, verified = lookup.propose_trie(ids, budget, lookup_count)
                proposal = trie_rows[0] if len(trie_rows) == 1 else []
                stats.seconds_select += time.perf_counter() - t0
            elif lookup is not None and budget >= 1:
                t0 = time.perf_counter()
                proposal, ngram = lookup.propose(ids, budget, guess)
                if proposal and policy is not None and draft_len >= 1 and \
                        policy.best(draft_len)[1] > lookup.rate(ngram, len(proposal)):
                    proposal = []      # the draft model is expected to yield more per unit of time this step
                stats.seconds_select += time.perf_counter() - t0
            if policy is not None and draft_len >= 1 and not proposal:
                draft_len = policy.choose(draft_len)
                stats.undrafted += draft_len == 0          # the length rule chose a plain step
            chose_last = False         # whether row len(tokens) - 1 of this step's call chose its last token
            if trie_rows is not None and len(trie_rows) > 1:
                tokens = self._lookup_trie_step(ids, t_cache, trie_rows, req, rng, stats)
                lookup.update_trie(verified, tokens)
            elif proposal:
                tokens = self._lookup_step(ids, t_cache, proposal, req, rng, stats)
                chose_last = True
                if trie_rows is not None:
                    lookup.update_trie(verified, tokens)
                else:
                    lookup.update(ngram, len(proposal), len(tokens) - 1)
                    if ngram == GUESS:
                        stats.guess_steps += 1
                        stats.guess_accepted += len(tokens) - 1
            elif draft_len < 1 or not use_model:
                tokens = self._plain_step(ids, t_cache, req, rng, stats)
                chose_last = True
            elif dynamic_tree and shape is not None:
                tokens, draft_seen = self._sequoia_step(ids, t_cache, d_cache, draft_seen, shape, draft_len, req,
                                                        rng, stats)
            elif dynamic_tree:
                tokens, draft_seen = self._dynamic_tree_step(ids, t_cache, d_cache, draft_seen, req.tree_budget,
                                                             draft_len, stats)
            elif greedy_tree:
                tokens, draft_seen = self._greedy_tree_step(ids, t_cache, d_cache, draft_seen, num_candidates,
                                                            draft_len, req, rng, stats)
            else:
                drafted = stats.drafted
                tokens, draft_seen = self._spec_step(ids, t_cache, d_cache, draft_seen, num_candidates,
                                                     draft_len, req, rng, stats)
                if policy is not None:
                    policy.update(stats.drafted - drafted, len(tokens) - 1)
            if use_guess:
                guess = self._guess_after(len(tokens) - 1) if chose_last else None
            ids.extend(tokens)
            emitted += len(tokens)
            yield tokens

    def _guess_after(self, row: int, batch_row: int = 0) -> int | None:
        """The guess head's token for after the token that `row` of the latest target call chose."""
        guess = self.target.guess
        if guess is None or not -guess.shape[1] <= row < guess.shape[1]:
            return None
        return int(guess[batch_row, row])

    def _lookup_step(self, ids, t_cache, draft, req, rng, stats) -> list[int]:
        """Verify a deterministic (prompt-lookup) draft in one batch-1 call: exact greedy at
        temperature 0, else the one-hot rule per position (accept x w.p. q(x), otherwise draw
        from q without x), and a bonus token from q when every position was accepted."""
        x = np.asarray([[ids[-1]] + list(draft)], dtype=np.int64)              # [1, L+1]
        logits = self.target.forward(x, t_cache)[0]                             # [L+1, W]
        self._charge(stats, x.shape[1])
        stats.steps += 1
        stats.lookup_steps += 1
        stats.scored += x.shape[1]
        t0 = time.perf_counter()
        out: list[int] = []
        for j, tok in enumerate(draft):
            if req.sampling.greedy:
                token = int(greedy_token(logits[j], self.vocab_size))
                ok = token == tok
            else:
                token, ok = selection.deterministic_select(
                    tok, logits_to_probs(logits[j], req.sampling, self.vocab_size), rng)
            out.append(int(token))
            if not ok:
                break
        else:
            out.append(self._choose(logits[len(draft)], req.sampling, rng))
        stats.seconds_select += time.perf_counter() - t0
        accepted = len(out) - 1
        stats.lookup_drafted += len(draft)
        stats.lookup_accepted += accepted
        _record_step(stats, len(draft), accepted)
        t_cache.crop(len(ids) + accepted)                                        # ids[:-1] + ids[-1] + accepted
        return out

    def _lookup_trie_step(self, ids, t_cache, rows, req, rng, stats) -> list[int]:
        """Verify several deterministic drafts as one token trie in one batch-1 call. From the root,
        each position's token is chosen from the target's own logits at that node, exactly as plain
        decoding chooses it (argmax, or a draw from q); the walk follows the child holding it and
        stops at the first token no child holds, which is still emitted. A deterministic draft then
        only decides which rows were precomputed: the output law is the target's."""
        trie = TokenTrie(ids[-1], rows)
        node_logits = self.target.forward(trie.tokens[None], t_cache, trie.ancestors, trie.depth)[0]  # [N, W]
        self._charge(stats, len(trie.tokens))
        stats.steps += 1
        stats.lookup_steps += 1
        stats.lookup_tries += 1
        stats.scored += len(trie.tokens)
        t0 = time.perf_counter()
        out, path = trie.walk(node_logits, lambda logits: self._choose(logits, req.sampling, rng))
        stats.seconds_select += time.perf_counter() - t0
        accepted = len(out) - 1
        stats.lookup_drafted += len(trie.tokens) - 1
        stats.lookup_accepted += accepted
        _record_step(stats, int(trie.depth.max()), accepted)
        past = len(ids) - 1
        t_cache.gather(past, past + np.asarray(path))
        return out

    def _plain_step(self, ids, t_cache, req, rng, stats) -> list[int]:
        logits = self.target.forward(np.asarray([[ids[-1]]], dtype=np.int64), t_cache)
        self._charge(stats, 1)
        t0 = time.perf_counter()
        tok = self._choose(logits[0, -1], req.sampling, rng)
        stats.seconds_select += time.perf_counter() - t0
        return [tok]

    def _draft(self, ids, d_cache, draft_seen, num_candidates, draft_len, sampling, rng, stats, draft_stop=0.0,
               alternatives=0):
        """1. Draft: num_candidates i.i.d. continuations of draft_len tokens, one batch of rows.

        Returns tokens # [k, L] and, when sampling, the processed draft probs they were drawn
        from # [k, L, W] (None when greedy). With alternatives > 0 (greedy, k = 1) it also returns
        the draft's next-best tokens at every position, best first # [L, alternatives].
        """
        alts = []
        catch_up = np.asarray([ids[draft_seen:]], dtype=np.int64)            # [1, unseen]
        logits = self.draft.forward(catch_up, d_cache, last=1)[:, -1]         # [1, W]
        tokens = np.empty((num_candidates, draft_len), dtype=np.int64)        # [k, L]
        probs = None
        for j in range(draft_len):
            if j > 0:
                logits = self.draft.forward(tokens[:, j - 1:j], d_cache)[:, 0]  # [k, W]
            t0 = time.perf_counter()
            if sampling.greedy:
                tokens[:, j] = greedy_token(logits, self.vocab_size)
                if alternatives:
                    alts.append(_next_best(logits[0, :self.vocab_size], int(tokens[0, j]), alternatives))
            else:
                p = logits_to_probs(logits, sampling, self.vocab_size)         # [1 or k, W]
                if probs is None:
                    probs = np.empty((num_candidates, draft_len, p.shape[-1]), dtype=p.dtype)
                probs[:, j] = p
                tokens[:, j] = sample(np.broadcast_to(p, (num_candidates, p.shape[-1])), rng)
            stop = (draft_stop > 0 and num_candidates == 1 and j < draft_len - 1 and
                    _confidence(logits[0, :self.vocab_size], p[0] if probs is not None else None, tokens[0, j])
                    < draft_stop)
            stats.seconds_select += time.perf_counter() - t0
            if j == 0:
                d_cache.repeat_rows(num_candidates)
            if stop:   # adaptive length: only draft-side information decides, so the output law is unchanged
                tokens = tokens[:, :j + 1]
                probs = probs[:, :j + 1] if probs is not None else None
                break
        stats.draft_calls += tokens.shape[1]
        stats.cost_units += self.draft_cost * (1 + (tokens.shape[1] - 1) * self.draft_rows(num_candidates))
        if alternatives:
            return tokens, probs, alts[:tokens.shape[1]]
        return tokens, probs

    def _greedy_tree_step(self, ids, t_cache, d_cache, draft_seen, branches, draft_len, req, rng, stats):
        """Greedy with a tree target: the draft's greedy chain plus, at every depth, its next
        `branches - 1` best tokens as leaves, all verified in one batch-1 call by the exact greedy
        walk. A leaf costs one more scored token and no draft call; when the chain's token is wrong
        but a leaf's is right, the step gains that token and the target's next one."""
        chain, _, alternatives = self._draft(ids, d_cache, draft_seen, 1, draft_len, req.sampling, rng, stats,
                                             req.draft_stop, alternatives=branches - 1)
        chain = chain[0]
        draft_len = len(chain)
        rows = [chain] + [list(chain[:j]) + [int(a)] for j in range(draft_len) for a in alternatives[j]]
        trie = TokenTrie(ids[-1], rows)
        past = len(ids) - 1
        node_logits = self.target.forward(trie.tokens[None], t_cache, trie.ancestors, trie.depth)[0]  # [N, W]
        self._charge(stats, len(trie.tokens))
        stats.steps += 1
        stats.scored += len(trie.tokens)
        t0 = time.perf_counter()
        tokens, path = trie.greedy_walk(node_logits, self.vocab_size)
        stats.seconds_select += time.perf_counter() - t0
        accepted = len(tokens) - 1
        on_chain = 0                                    # accepted tokens that are the chain's (the draft saw them)
        while on_chain < min(accepted, draft_len) and tokens[on_chain] == chain[on_chain]:
            on_chain += 1
        _record_step(stats, draft_len, accepted)
        t_cache.gather(past, past + np.asarray(path))
        draft_seen = len(ids) + min(on_chain, draft_len - 1)
        d_cache.crop(draft_seen - d_cache.offset)
        return tokens, draft_seen

    def _draft_nodes(self, tree: "DraftTree", new: list[int], d_cache, base: int, stats) -> np.ndarray:
        """One draft call over a tree's newest nodes; returns their logits # [len(new), W].

        Each new node sees the committed ids (the first `base` cache positions) and its own
        ancestors already in the cache, not the other branches; position = base - 1 + depth.
        """
        past = d_cache.length
        past_mask = np.zeros((len(new), past), dtype=bool)                  # [new, past]
        past_mask[:, :base] = True
        for i, node in enumerate(new):
            for a in tree.ancestors_of(node):
                if tree.fed[a] is not None:
                    past_mask[i, tree.fed[a]] = True
        positions = np.asarray([base - 1 + tree.depth[n] for n in new], dtype=np.int64)
        logits = self.draft.forward(np.asarray([[tree.tokens[n] for n in new]], dtype=np.int64), d_cache,
                                    np.eye(len(new), dtype=bool), positions - past, past_mask)[0]
        for i, node in enumerate(new):
            tree.fed[node] = past + i
        # a call over n nodes costs like a step over n rows (MatMulNBits grows with rows like with tokens)
        stats.draft_calls += 1
        stats.cost_units += self.draft_cost * self.draft_rows(len(new))
        return logits

    def _sequoia_step(self, ids, t_cache, d_cache, draft_seen, shape, max_depth, req, rng, stats):
        """Sampling with a Sequoia tree (SPECTR.md 6): the fixed shape's children of a node are drawn
        without replacement from the draft there, one draft call per depth; one target call scores
        the tree; from the root, child x (in drawing order) is accepted if u p~(x) < q(x), p~ the
        draft renormalised without the rejected siblings, else q <- norm(max(q - p~, 0)); when no
        child is accepted (or at a leaf) the next token is drawn from q. Lossless."""
        sampling, vocab = req.sampling, self.vocab_size
        tree = DraftTree(ids[-1], 0)
        logits = self.draft.forward(np.asarray([ids[draft_seen:]], dtype=np.int64), d_cache, last=1)[0, -1:]
        stats.cost_units += self.draft_cost
        stats.draft_calls += 1
        base = d_cache.length
        draft_probs = {}                                   # node -> processed draft probs there # [W]
        frontier, shape_of = [0], {0: 0}                   # tree node -> shape node
        for depth in range(1, max_depth + 1):
            t0 = time.perf_counter()
            new = []
            probs = logits_to_probs(logits, sampling, vocab)                      # [f, W]
            for fi, node in enumerate(frontier):
                width = shape.children[shape_of[node]]
                if not width:
                    continue
                p = probs[fi].astype(np.float64)
                draft_probs[node] = p.copy()
                for rank in range(width):                  # without replacement, in drawing order
                    total = p.sum()
                    if total <= 0:
                        break
                    tok = int(sample(p / total, rng))
                    child = tree.add_child(node, tok)
                    shape_of[child] = shape.child(shape_of[node], rank)
                    new.append(child)
                    p[tok] = 0.0
            stats.seconds_select += time.perf_counter() - t0
            expand = [n for n in new if shape.children[shape_of[n]]]
            if not expand or depth == max_depth:
                break
            logits = self._draft_nodes(tree, expand, d_cache, base, stats)
            frontier = expand
        trie, node_logits = self._score_tree(ids, t_cache, tree, stats)
        t0 = time.perf_counter()
        node, trie_node, out, path = 0, 0, [], [0]
        while True:
            q = logits_to_probs(node_logits[trie_node], sampling, vocab).astype(np.float64)
            chosen = None
            if node in draft_probs:
                p = draft_probs[node].copy()
                for child in tree.kids[node]:
                    x = tree.tokens[child]
                    if rng.random() * p[x] < q[x]:
                        chosen = child
                        break
                    q = _residual(q, p)
                    p[x] = 0.0
                    if p.sum() <= 0:
                        break
                    p /= p.sum()
            if chosen is None:
                out.append(int(sample(q, rng)))
                break
            out.append(tree.tokens[chosen])
            node, trie_node = chosen, trie.children[(trie_node, tree.tokens[chosen])]
            path.append(trie_node)
        stats.seconds_select += time.perf_counter() - t0
        return out, self._commit_tree(ids, t_cache, d_cache, tree, trie, out, path, base, stats)

    def _dynamic_tree_step(self, ids, t_cache, d_cache, draft_seen, budget, max_depth, stats):
        """Greedy with a tree target and a tree draft: grow a draft tree of `budget` nodes, one
        draft call per depth over the newest nodes (OPT-Tree: the tree keeps the `budget` nodes
        with the highest draft path probability), verify all of it in one target call by the
        exact greedy walk, and keep the accepted path in both caches."""
        tree = DraftTree(ids[-1], budget)
        logits = self.draft.forward(np.asarray([ids[draft_seen:]], dtype=np.int64), d_cache, last=1)[0, -1:]  # [1, W]
        stats.cost_units += self.draft_cost
        stats.draft_calls += 1
        base = d_cache.length                       # the draft cache now holds every id
        frontier = [0]
        for depth in range(1, max_depth + 1):
            t0 = time.perf_counter()
            new = tree.grow(frontier, logits[:, :self.vocab_size])
            stats.seconds_select += time.perf_counter() - t0
            if not new or depth == max_depth:
                break
            logits = self._draft_nodes(tree, new, d_cache, base, stats)
            frontier = new
        trie, node_logits = self._score_tree(ids, t_cache, tree, stats)
        t0 = time.perf_counter()
        tokens, path = trie.greedy_walk(node_logits, self.vocab_size)
        stats.seconds_select += time.perf_counter() - t0
        return tokens, self._commit_tree(ids, t_cache, d_cache, tree, trie, tokens, path, base, stats)

    def _score_tree(self, ids, t_cache, tree: "DraftTree", stats) -> tuple["TokenTrie", np.ndarray]:
        """One batch-1 target call over a drafted tree; returns its trie and node logits # [N, W]."""
        trie = TokenTrie(ids[-1], tree.rows())
        node_logits = self.target.forward(trie.tokens[None], t_cache, trie.ancestors, trie.depth)[0]  # [N, W]
        self._charge(stats, len(trie.tokens))
        stats.steps += 1
        stats.scored += len(trie.tokens)
        return trie, node_logits

    def _commit_tree(self, ids, t_cache, d_cache, tree, trie, tokens, path, base: int, stats) -> int:
        """Keep the accepted path in both caches; returns how many ids the draft cache now holds."""
        accepted = len(tokens) - 1
        _record_step(stats, int(trie.depth.max()), accepted)
        past = len(ids) - 1
        t_cache.gather(past, past + np.asarray(path))
        kept = tree.fed_path(tokens[:accepted])      # draft-cache positions of the accepted nodes it has seen
        d_cache.gather(base, np.asarray(kept, dtype=np.int64))
        return d_cache.offset + base + len(kept)

    def _spec_step(self, ids, t_cache, d_cache, draft_seen, num_candidates, draft_len, req, rng, stats):
        sampling = req.sampling
        # 1. draft
        drafts, draft_probs = self._draft(ids, d_cache, draft_seen, num_candidates, draft_len,
                                          sampling, rng, stats, req.draft_stop)
        draft_len = drafts.shape[1]                     # may be shorter: adaptive length
        # 2. score every distinct candidate row in one target call: as one token trie in a batch-1
        #    call when the target takes a tree mask, else by replicating the cache to every row
        rows, row_of = np.unique(drafts, axis=0, return_inverse=True)         # [u, L], [k]
        row_of = row_of.reshape(-1)
        past = len(ids) - 1                                                     # the cache holds ids[:-1]
        trie = None
        if len(rows) > 1 and self.target.takes_tree:
            trie = TokenTrie(ids[-1], rows)
            node_logits = self.target.forward(trie.tokens[None], t_cache, trie.ancestors, trie.depth)  # [1, N, W]
            target_logits = trie.row_view(node_logits[0])                      # [u, L+1] -> [W]
            stats.scored += len(trie.tokens)
        else:
            t_cache.repeat_rows(len(rows))
            last = np.full((len(rows), 1), ids[-1], dtype=np.int64)
            target_logits = self.target.forward(np.concatenate([last, rows], axis=1), t_cache)  # [u, L+1, W]
            stats.scored += rows.size + len(rows)
        self._charge(stats, len(trie.tokens) if trie is not None else rows.size + len(rows))
        stats.steps += 1
        # 3. select
        t0 = time.perf_counter()
        tokens, survivor = select_sequence(drafts, draft_probs, target_logits, row_of, sampling,
                                           self.vocab_size, rng)
        stats.seconds_select += time.perf_counter() - t0
        accepted = len(tokens) - 1
        _record_step(stats, draft_len, accepted)
        # 4. commit: keep the surviving row, crop both caches to what they saw of the accepted path
        if trie is not None:                              # the path's nodes, moved to contiguous positions
            t_cache.gather(past, past + trie.node_of[row_of[survivor], :accepted + 1])
        else:
            t_cache.keep_row(int(row_of[survivor]))
            t_cache.crop(len(ids) + accepted)             # ids[:-1] + ids[-1] + accepted tokens
        draft_seen = len(ids) + min(accepted, draft_len - 1)
        d_cache.keep_row(survivor)
        d_cache.crop(draft_seen - d_cache.offset)
        return tokens, draft_seen


# Probability that the rank-r child drawn at a node is the accepted one, at temperature 1 with the
# default bundle (Qwen2.5-Coder 0.5B int4 draft, 1.5B target: sum min(p, q) = 0.705 for the first
# draw, MODELS.md; later draws, without replacement, from the Sequoia paper's decay); they only
# shape the tree, never the output law.
SEQUOIA_RANK_ACCEPTANCE = (0.70, 0.12, 0.05, 0.03, 0.02, 0.01)


class SequoiaShape:
    """The tree of `budget` nodes with the highest expected acceptance, depth <= max_depth: each
    node's value is the product of its path's rank acceptances, and the best tree of n nodes is
    the n highest-valued nodes of the infinite tree (values fall along every path and sibling
    rank, so that set is a tree: the dynamic program of Sequoia, solved greedily).
    children[s] = how many children shape node s has; child(s, r) = its rank-r child; value[s] = the
    chance s is accepted under `accept` (the root's 1.0 included, sum(value) = expected tokens per step)."""

    def __init__(self, budget: int, max_depth: int, accept=SEQUOIA_RANK_ACCEPTANCE):
        import heapq

        self.children, self.depth, self.value, self._child = [0], [0], [1.0], {}
        heap = [(-accept[0], 0, 0)]                    # (-value, parent, rank)
        while heap and len(self.depth) - 1 < budget:
            neg, parent, rank = heapq.heappop(heap)
            node = len(self.depth)
            self.depth.append(self.depth[parent] + 1)
            self.value.append(-neg)
            self.children.append(0)
            self.children[parent] += 1
            self._child[(parent, rank)] = node
            if rank + 1 < len(accept):
                heapq.heappush(heap, (neg / accept[rank] * accept[rank + 1], parent, rank + 1))
            if self.depth[node] < max_depth:
                heapq.heappush(heap, (neg * accept[0], node, 0))

    def child(self, node: int, rank: int) -> int:
        return self._child[(node, rank)]


def sequoia_shape(budget: int, max_depth: int) -> SequoiaShape:
    return SequoiaShape(budget, max_depth)


class DraftTree:
    """A greedy draft tree grown by path probability (OPT-Tree, SPECTR.md section 6).

    Node 0 is the last committed token. `grow` adds, below the frontier nodes, their draft's
    top children, then keeps the `budget` nodes (root excluded) with the highest path
    log-probability; a child's path probability never exceeds its parent's, so the kept set is
    a tree (ties are closed over explicitly). fed[node] = the node's draft-cache position once
    the draft has scored it.
    """

    WIDTH = 4            # children considered per frontier node

    def __init__(self, root_token: int, budget: int):
        self.budget = budget
        self.tokens, self.parent, self.depth, self.logp = [int(root_token)], [-1], [0], [0.0]
        self.fed: list[int | None] = [None]
        self.kept: set[int] = set()
        self.children: dict[tuple[int, int], int] = {}
        self.kids: dict[int, list[int]] = {}         # node -> its children in the order they were added

    def add_child(self, parent: int, token: int) -> int:
        """Append a kept child (sampled trees, which keep every node they draw)."""
        node = len(self.tokens)
        self.tokens.append(int(token))
        self.parent.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.logp.append(0.0)
        self.fed.append(None)
        self.children[(parent, int(token))] = node
        self.kids.setdefault(parent, []).append(node)
        self.kept.add(node)
        return node

    def grow(self, frontier: list[int], logits: np.ndarray) -> list[int]:
        """logits # [len(frontier), V] from the draft at the frontier; returns the new kept nodes."""
        width = min(self.WIDTH, self.budget, logits.shape[-1])
        top = top_ids(logits, width)                                                          # [f, width]
        z = logits.max(-1, keepdims=True)
        lse = (z + np.log(np.exp(logits - z).sum(-1, keepdims=True)))[:, 0]                  # [f]
        pool = [(self.logp[n], n, None) for n in self.kept]
        for fi, node in enumerate(frontier):
            for t in top[fi]:
                pool.append((self.logp[node] + float(logits[fi, t] - lse[fi]), node, int(t)))
        pool.sort(key=lambda e: -e[0])
        keep = pool[:self.budget]
        new = []
        self.kept = {n for _, n, t in keep if t is None}
        for lp, parent, tok in keep:
            if tok is None:
                continue
            node = len(self.tokens)
            self.tokens.append(tok)
            self.parent.append(parent)
            self.depth.append(self.depth[parent] + 1)
            self.logp.append(lp)
            self.fed.append(None)
            self.children[(parent, tok)] = node
            self.kept.add(node)
            new.append(node)
        # close over ties: a node whose parent fell out goes too
        for node in sorted(self.kept):
            if self.parent[node] != 0 and self.parent[node] not in self.kept:
                self.kept.discard(node)
        return [n for n in new if n in self.kept]

    def ancestors_of(self, node: int) -> list[int]:
        out = []
        node = self.parent[node]
        while node > 0:
            out.append(node)
            node = self.parent[node]
        return out

    def rows(self) -> list[list[int]]:
        """Root-to-leaf token paths of the kept tree (the root itself excluded)."""
        inner = {self.parent[n] for n in self.kept}
        rows = []
        for leaf in sorted(n for n in self.kept if n not in inner):
            path, node = [], leaf
            while node > 0:
                path.append(self.tokens[node])
                node = self.parent[node]
            rows.append(path[::-1])
        return rows or [[]]

    def fed_path(self, tokens) -> list[int]:
        """Draft-cache positions along the path of `tokens` from the root, up to the first node not fed."""
        node, out = 0, []
        for tok in tokens:
            node = self.children.get((node, int(tok)))
            if node is None or self.fed[node] is None:
                break
            out.append(self.fed[node])
        return out


class TokenTrie:
    """Drafted continuations merged into a token trie, for one batch-1 target call (SPECTR.md section 5).

    Node 0 is the last committed token (position past); every other node is a drafted token,
    identical prefixes shared. tokens # [N], depth # [N] (position = past + depth),
    ancestors # [N, N] bool (node i attends to node j: j is i or an ancestor of i),
    children {(node, token): child}, node_of # [u, L+1] for equal-length rows: the node of
    row r at depth j (node_of[r, 0] = 0). Rows may differ in length (greedy side leaves);
    node_of is then None. A child's index is always larger than its parent's, so a path's
    nodes are ascending.
    """

    def __init__(self, root_token: int, rows):
        lengths = {len(r) for r in rows}
        tokens, parent, depth = [int(root_token)], [-1], [0]
        self.children: dict[tuple[int, int], int] = {}
        node_of = []
        for row in rows:
            node, path = 0, [0]
            for j, tok in enumerate(row):
                key = (node, int(tok))
                child = self.children.get(key)
                if child is None:
                    child = self.children[key] = len(tokens)
                    tokens.append(key[1])
                    parent.append(node)
                    depth.append(j + 1)
                node = child
                path.append(node)
            node_of.append(path)
        self.node_of = np.asarray(node_of, dtype=np.int64) if len(lengths) == 1 else None
        n = len(tokens)
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.depth = np.asarray(depth, dtype=np.int64)
        self.ancestors = np.eye(n, dtype=bool)
        for i in range(1, n):                 # parent[i] < i: its row is already complete
            self.ancestors[i] |= self.ancestors[parent[i]]

    def greedy_walk(self, node_logits: np.ndarray, vocab_size: int) -> tuple[list[int], list[int]]:
        """Exact greedy verification of the whole tree (walk with the target's argmax)."""
        return self.walk(node_logits, lambda logits: int(greedy_token(logits, vocab_size)))

    def walk(self, node_logits: np.ndarray, choose) -> tuple[list[int], list[int]]:
        """From the root, emit choose(node's logits) and follow the child holding it; stop at the
        first token no child holds (it is still emitted). With choose = the target's own argmax or
        draw, this is plain decoding with some rows precomputed.

        Returns (emitted tokens, the nodes of the accepted path, root included).
        """
        node, out, path = 0, [], [0]
        while True:
            tok = choose(node_logits[node])
            out.append(tok)
            child = self.children.get((node, tok))
            if child is None:
                return out, path
            node = child
            path.append(node)

    def row_view(self, node_logits: np.ndarray) -> "_RowLogits":
        return _RowLogits(node_logits, self.node_of)


class _RowLogits:
    """target_logits[row, j] of the replicated layout, read from per-node logits # [N, W]."""

    def __init__(self, node_logits: np.ndarray, node_of: np.ndarray):
        self.node_logits, self.node_of = node_logits, node_of

    def __getitem__(self, index) -> np.ndarray:
        row, j = index
        return self.node_logits[self.node_of[row, j]]


def _residual(q: np.ndarray, p: np.ndarray) -> np.ndarray:
    """norm(max(q - p, 0)): what the target still owes after a draft token drawn from p was rejected."""
    r = np.maximum(q - p, 0.0)
    total = r.sum()
    return r / total if total > 0 else q


def _record_step(stats: GenerationStats, draft_len: int, accepted: int) -> None:
    """Count one verified step: draft_len positions offered, the first `accepted` of them kept."""
    if len(stats.reached) < draft_len:            # a prompt-lookup step may be longer than the model's L
        stats.reached += [0] * (draft_len - len(stats.reached))
        stats.accepted_at += [0] * (draft_len - len(stats.accepted_at))
    stats.drafted += draft_len
    stats.accepted += accepted
    for j in range(min(accepted + 1, draft_len)):
        stats.reached[j] += 1
    for j in range(accepted):
        stats.accepted_at[j] += 1


def top_ids(logits: np.ndarray, count: int) -> np.ndarray:
    """The `count` highest-logit ids of each row of logits # [..., V], highest first, ties to the
    lower id: # [..., count].

    `count` passes of argmax, each hiding the ids found so far (set to -inf, put back after): for
    the few ids a draft tree branches on, ~10x faster than argpartition over a 151,936-wide
    vocabulary (5 ms per draft call of the float32 bundle's trees, 6% of their time). A read-only
    array is copied first."""
    work = logits if logits.flags.writeable else logits.copy()
    rows = work.reshape(-1, work.shape[-1])
    index = np.arange(rows.shape[0])
    count = min(count, rows.shape[1])
    out = np.empty((rows.shape[0], count), dtype=np.int64)
    saved = np.empty((rows.shape[0], count), dtype=rows.dtype)
    for j in range(count):
        out[:, j] = rows.argmax(-1)
        saved[:, j] = rows[index, out[:, j]]
        rows[index, out[:, j]] = -np.inf
    for j in reversed(range(count)):     # reversed: where an all -inf row repeats an id, its first value wins
        rows[index, out[:, j]] = saved[:, j]
    return out.reshape(logits.shape[:-1] + (count,))


def _next_best(logits: np.ndarray, best: int, count: int) -> list[int]:
    """The `count` highest-logit ids other than `best`, highest first."""
    return [int(t) for t in top_ids(logits, count + 1) if t != best][:count]


def _confidence(logits: np.ndarray, probs: np.ndarray | None, token: int) -> float:
    """Draft-side confidence in a drafted token: its draft probability (softmax of raw logits if greedy)."""
    if probs is not None:
        return float(probs[token])
    top = logits.max()
    return float(1.0 / np.exp(logits - top).sum()) if logits[token] == top else 0.0


def select_sequence(drafts, draft_probs, target_logits, row_of, sampling, vocab_size, rng):
    """3. Sequence-level SpecTr selection over k candidate rows (SPECTR.md section 2).

    drafts        # [k, L] candidate tokens (i.i.d. rows)
    draft_probs   # [k, L, W] processed draft probs each token was drawn from (None if greedy)
    target_logits # [u, L+1, W] target logits for the distinct rows; row_of # [k] maps candidate -> row
    Returns (emitted tokens: accepted prefix + one residual/bonus token, index of a surviving candidate).
    Survivors share the accepted prefix, so p and q at position j are the same for all of them.
    """
    num_candidates, draft_len = drafts.shape
    survivors = np.arange(num_candidates)
    out: list[int] = []
    for j in range(draft_len):
        row = row_of[survivors[0]]
        if sampling.greedy:
            best = int(greedy_token(target_logits[row, j], vocab_size))
            out.append(best)
            if drafts[survivors[0], j] != best:
                return out, int(survivors[0])
            continue
        target_probs = logits_to_probs(target_logits[row, j], sampling, vocab_size)   # [W]
        token, picked = selection.kseq_select(drafts[survivors, j], draft_probs[survivors[0], j],
                                              target_probs, rng)
        out.append(int(token))
        if picked is None:                               # residual sample: the step ends here
            return out, int(survivors[0])
        survivors = survivors[drafts[survivors, j] == token]
    # 4. bonus token: every position accepted, sample from q after the last draft token
    row = row_of[survivors[0]]
    if sampling.greedy:
        out.append(int(greedy_token(target_logits[row, draft_len], vocab_size)))
    else:
        out.append(int(sample(logits_to_probs(target_logits[row, draft_len], sampling, vocab_size), rng)))
    return out, int(survivors[0])
