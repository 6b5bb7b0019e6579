"""The decoding loop: every step is the same five moves, whatever drafts.

    1. propose   a drafter proposes the tokens to verify (drafters.py): a chain, k rows, a copied
                 trie or a draft tree, and the selection rule that reads them
    2. score     the target scores the whole proposal in one call: one chain, one token trie
                 (a 4D mask), or k replicated rows on targets without a tree mask
    3. select    the rule (selection.py) decides the emitted tokens: the accepted drafted tokens
                 and one token of the target's own
    4. commit    the target cache keeps the accepted path (crop, gather, or the surviving row)
    5. update    the drafter commits its own cache and learns from the outcome

Cache invariant between steps: `ids` is every committed token (prompt + output); the target cache
holds ids[:-1], and the last committed token is fed at the start of the next target call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from . import selection
from .drafters import (GREEDY, KSEQ, ONE_HOT, SEQUOIA, WALK, DraftCosts, DraftModel, Lookup, LookupFirst,
                       LookupTrie, ModelRows, NoDraft, OptTree, Outcome, Proposal, SequoiaTree, SideLeaves, Step)
from .lookup import PromptLookup
from .onnx_model import OnnxLM
from .options import DecodeOptions
from .policy import AdaptiveLength, CostCurve, default_draft_cost
from .prefix_cache import CachedPrefix, PrefixCache
from .recording import Recorder, Recording
from .sampling import SamplingParams, TokenHistory, greedy_token, logits_to_probs, sample
from .stats import GenerationStats
from .trees import SequoiaShape, TokenTrie


@dataclass
class Scored:
    """The target's logits for a proposal, from one call."""
    trie: TokenTrie               # the distinct rows as a trie (a chain: its nodes are positions)
    node_logits: np.ndarray | None    # [N, W] per trie node (None when rows were replicated)
    row_logits: object            # [row, j] -> [W]: the replicated rows' logits, or a view of node_logits
    row_of: np.ndarray | None     # KSEQ: candidate -> distinct row
    replicated: bool              # scored as k rows of a replicated cache
    tokens: int                   # tokens the call scored (before any padding)


def _kept_logits(s: Scored, o: Outcome) -> np.ndarray:
    """The target's logits that predicted each emitted token # [len(o.tokens), W]."""
    if s.replicated:
        return s.row_logits[int(s.row_of[o.survivor])][:len(o.tokens)]
    return s.node_logits[np.asarray(o.path[:len(o.tokens)], dtype=np.int64)]


def _greedy(p: Proposal, s: Scored, sampling, vocab, rng) -> Outcome:
    return Outcome(*selection.greedy_walk(s.trie, s.node_logits, vocab))


def _kseq(p: Proposal, s: Scored, sampling, vocab, rng) -> Outcome:
    tokens, survivor = selection.select_sequence(np.asarray(p.rows), p.draft_probs, s.row_logits, s.row_of,
                                                 sampling, vocab, rng)
    path = [] if s.replicated else s.trie.node_of[s.row_of[survivor], :len(tokens)].tolist()
    return Outcome(tokens, path, survivor)


def _one_hot(p: Proposal, s: Scored, sampling, vocab, rng) -> Outcome:
    tokens = selection.one_hot_chain(p.rows[0], s.node_logits, sampling, vocab, rng)
    return Outcome(tokens, list(range(len(tokens))))


def _walk(p: Proposal, s: Scored, sampling, vocab, rng) -> Outcome:
    choose = lambda logits: int(sample(logits_to_probs(logits, sampling, vocab), rng))  # noqa: E731
    return Outcome(*selection.target_walk(s.trie, s.node_logits, choose))


def _sequoia(p: Proposal, s: Scored, sampling, vocab, rng) -> Outcome:
    return Outcome(*selection.sequoia_walk(p.tree, s.trie, s.node_logits, sampling, vocab, rng))


def _penalized(s: Scored, rows: list[list[int]], history: TokenHistory, sampling: SamplingParams) -> Scored:
    """The scored logits with penalties applied at every position from the tokens before it: a trie
    node's path from the root, a replicated row's tokens before the position."""
    if s.replicated:
        logits = np.stack([[history.penalize(s.row_logits[r, j], sampling, rows[r][:j])
                            for j in range(s.row_logits.shape[1])] for r in range(len(rows))])   # [u, L+1, W]
        return Scored(s.trie, None, logits, s.row_of, True, s.tokens)
    trie = s.trie
    paths = [[]]
    for node in range(1, trie.tokens.size):        # a parent's index is smaller: its path is ready
        paths.append(paths[trie.parent[node]] + [int(trie.tokens[node])])
    node_logits = np.stack([history.penalize(s.node_logits[n], sampling, paths[n]) for n in range(len(paths))])
    view = trie.row_view(node_logits) if trie.node_of is not None else None
    chain_view = node_logits[None] if len(rows) <= 1 else view
    return Scored(trie, node_logits, chain_view, s.row_of, False, s.tokens)


# the rule each proposal names -> how its outcome is read (selection.py holds the rules themselves);
# at temperature 0 every proposal is verified by the exact greedy walk
RULES = {GREEDY: _greedy, KSEQ: _kseq, ONE_HOT: _one_hot, WALK: _walk, SEQUOIA: _sequoia}


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
        self.prefixes: PrefixCache | None = PrefixCache()   # recent generations' caches, for prefix reuse
        self.eos_ids: frozenset[int] = frozenset()         # generation stops after any of these
        self.recorder: Recorder | None = None              # opt-in: the target's top-k at kept positions
        self.context_length = target.spec.context_length
        # one guess of the guess head's chain graph, in target decode steps, from file bytes as the draft's:
        # 0.015 for the 1.5B int4 target, where a call measured 0.5 of ~70 ms (it reads one row of its table)
        self.chain_cost = (default_draft_cost(target.spec.size_bytes, target.chain.bytes)
                           if target.chain is not None else 0.0)
        self.chain_prior: list[float] = []   # its acceptance at chain positions 2, 3, ... as the export measured
        if draft is not None:
            self.context_length = min(self.context_length, draft.spec.context_length)

    # -- a policy: options -> drafter -------------------------------------------------------------
    def drafter(self, opts: DecodeOptions, stats: GenerationStats):
        """The drafter that implements `opts` (and the speculation fields of the stats)."""
        greedy = opts.sampling.greedy
        if opts.drafter == "none":
            return NoDraft()
        draft = model = None
        if opts.drafter != "lookup":
            draft = DraftModel(self.draft, self.vocab_size, DraftCosts(self.draft_cost, self.draft_rows))
            adaptive = None
            if opts.adaptive and opts.num_candidates == 1:
                adaptive = AdaptiveLength(self.cost, self.draft_cost, opts.draft_len)
            if opts.tree_budget and greedy:
                model = OptTree(draft, opts.tree_budget, opts.draft_len)
            elif opts.tree_budget:
                model = SequoiaTree(draft, SequoiaShape(opts.tree_budget, opts.draft_len), opts.draft_len)
            elif opts.branches > 1:
                model = SideLeaves(draft, opts.branches, opts.draft_len, opts.draft_stop)
            else:
                model = ModelRows(draft, opts.num_candidates, opts.draft_len, opts.draft_stop, adaptive)
        # what --stats reports as k and L
        stats.num_candidates = (opts.lookup_candidates if draft is None else opts.branches if opts.branches > 1
                                else 1 if greedy else opts.num_candidates)
        stats.draft_len = opts.draft_len if draft is not None else opts.lookup_len
        stats.reached, stats.accepted_at = [0] * stats.draft_len, [0] * stats.draft_len
        if opts.drafter == "model":
            return model
        # the table's and the guess head's one-token guesses: with lookup alone, or weighed against the
        # model by the adaptive rule (before the model otherwise they would leave it nothing to draft)
        guess_role = opts.drafter == "lookup" or opts.adaptive
        lookup = PromptLookup(self.cost, opts.lookup_len, max_ngram=opts.lookup_ngram[1],
                              min_ngram=opts.lookup_ngram[0], table=self.lookup_table if guess_role else None,
                              chain_cost=self.chain_cost, chain_prior=self.chain_prior)
        if opts.drafter == "lookup":
            return LookupTrie(lookup, opts.lookup_candidates) if opts.lookup_candidates > 1 else Lookup(lookup, True)
        return LookupFirst(Lookup(lookup, guess_role), model, getattr(model, "adaptive", None))

    # -- the loop -----------------------------------------------------------------------------------
    def run(self, prompt_ids, opts: DecodeOptions, rng: np.random.Generator,
            stats: GenerationStats) -> Iterator[list[int]]:
        """Yield committed tokens step by step until max_new_tokens, eos or the end of the context."""
        emitted = 0
        eos = self.eos_ids
        for tokens in self._decode(list(prompt_ids), opts, rng, stats):
            tokens = tokens[:opts.max_new_tokens - emitted]
            for i, tok in enumerate(tokens):
                if tok in eos:               # tokens after eos are never shown
                    tokens, stats.stop_reason = tokens[:i + 1], "eos"
                    break
            emitted += len(tokens)
            yield tokens
            if stats.stop_reason == "eos":
                return
            if emitted >= opts.max_new_tokens:
                stats.stop_reason = "max_new_tokens"
                return
        stats.stop_reason = stats.stop_reason or "context"

    def _decode(self, ids: list[int], opts: DecodeOptions, rng, stats: GenerationStats) -> Iterator[list[int]]:
        drafter, sampling = self.drafter(opts, stats), opts.sampling
        history = TokenHistory(ids) if sampling.penalized else None       # what penalties read
        cache, reused = self._cache_for(ids, stats)
        record = self.recorder.request(ids) if self.recorder is not None else None
        ids.append(self._prefill(ids, cache, sampling, rng, stats, history, record))
        drafter.start(ids, opts.draft_window, reused)
        wants_guess = drafter.wants_guess and self.target.spec.guess is not None
        guess = self.target.guess_after(-1) if wants_guess else None
        chain = self.target.chain_after(-1, guess) if guess is not None else None
        emitted, clock, clean = 1, time.perf_counter, True
        rule = (lambda p: GREEDY) if sampling.greedy else (lambda p: p.rule)   # temperature 0: the exact walk
        try:
            yield [ids[-1]]
            while len(ids) < self.context_length:
                clean = False
                # a step emits up to L + 1 tokens; never draft past the budget or the context
                budget = min(opts.max_new_tokens - emitted - 1, self.context_length - len(ids) - 1)
                t0 = clock()
                proposal = drafter.propose(Step(ids, budget, sampling, rng, stats, guess, history, chain))  # 1. propose
                t1 = clock()
                scored = self._score(ids, cache, proposal, stats, sampling, history)                 # 2. score
                t2 = clock()
                outcome = RULES[rule(proposal)](proposal, scored, sampling, self.vocab_size, rng)     # 3. select
                t3 = clock()
                if record is not None:
                    record.add(_kept_logits(scored, outcome), outcome.tokens)
                self._commit(ids, cache, scored, outcome)                                             # 4. commit
                drafter.update(proposal, outcome)                                                     # 5. update
                stats.record_step(proposal.rows, proposal.kind, scored.tokens, scored.trie.tokens.size - 1,
                                  outcome.accepted)
                stats.add_times(propose=t1 - t0, score=t2 - t1, select=t3 - t2, commit=clock() - t3)
                if wants_guess:
                    row = len(outcome.tokens) - 1
                    guess = self.target.guess_after(row) if proposal.chose_last else None
                    chain = self.target.chain_after(row, guess) if guess is not None else None
                ids.extend(outcome.tokens)
                if history is not None:
                    history.extend(outcome.tokens)
                emitted += len(outcome.tokens)
                clean = True
                yield outcome.tokens
        finally:
            if record is not None:
                record.close()
            if clean and self.prefixes is not None:      # between steps: both caches hold what they say
                self.prefixes.put(CachedPrefix(tuple(ids[:-1]), cache, *drafter.draft_state()))

    def _cache_for(self, ids: list[int], stats: GenerationStats):
        """The target cache to prefill `ids` into: a cached prefix of them when one is kept (cropped to
        the shared tokens), else a new cache. Returns it and the reused entry (None: nothing reused)."""
        entry, common = self.prefixes.take(ids) if self.prefixes is not None else (None, 0)
        if entry is None:
            return self.target.new_cache(), None
        entry.target.crop(common)
        stats.cached_tokens = common
        entry.tokens = entry.tokens[:common]
        return entry.target, entry

    def _prefill(self, ids: list[int], cache, sampling: SamplingParams, rng, stats: GenerationStats,
                 history: TokenHistory | None = None, record: Recording | None = None) -> int:
        """Run the prompt's tokens the cache does not hold through the target; the first new token."""
        new = np.asarray([ids[cache.length:]], dtype=np.int64)                       # [1, P - cached]
        logits = self.target.forward(new, cache, last=1)[0, -1]                        # [W]
        stats.target_calls += 1
        t0 = time.perf_counter()
        if history is not None:
            logits = history.penalize(logits, sampling)
        first = self._choose(logits, sampling, rng)
        stats.add_times(select=time.perf_counter() - t0)
        if record is not None:
            record.add(logits[None], [first])
        if history is not None:
            history.extend([first])
        return first

    def _choose(self, logits: np.ndarray, sampling: SamplingParams, rng: np.random.Generator) -> int:
        if sampling.greedy:
            return int(greedy_token(logits, self.vocab_size))
        return int(sample(logits_to_probs(logits, sampling, self.vocab_size), rng))

    def _score(self, ids: list[int], cache, proposal: Proposal, stats: GenerationStats, sampling: SamplingParams,
               history: TokenHistory | None = None) -> Scored:
        """One target call over the whole proposal (rows after the last committed token ids[-1]); with
        penalties, each position's logits are penalized from its own prefix."""
        root, rows, row_of = ids[-1], proposal.rows, None
        if proposal.rule == KSEQ:           # k i.i.d. rows, duplicates allowed: score each distinct row once
            distinct, row_of = np.unique(np.asarray(rows), axis=0, return_inverse=True)   # [u, L], [k]
            rows, row_of = [list(map(int, r)) for r in distinct], row_of.reshape(-1)
        trie = TokenTrie(root, rows or [[]])
        if len(rows) <= 1:                  # one chain, or a plain step: a causal call
            logits = self.target.forward(np.asarray([[root] + (rows[0] if rows else [])], dtype=np.int64), cache)
            scored = Scored(trie, logits[0], logits, row_of, False, trie.tokens.size)   # [L+1, W]
        elif self.target.takes_tree:        # a token trie in one batch-1 call
            node_logits = self.target.forward(trie.tokens[None], cache, trie.ancestors, trie.depth)[0]   # [N, W]
            view = trie.row_view(node_logits) if trie.node_of is not None else None
            scored = Scored(trie, node_logits, view, row_of, False, trie.tokens.size)
        else:                               # k distinct rows of equal length: the cache replicated per row
            cache.repeat_rows(len(rows))
            x = np.concatenate([np.full((len(rows), 1), root, dtype=np.int64), np.asarray(rows)], axis=1)
            scored = Scored(trie, None, self.target.forward(x, cache), row_of, True, x.size)   # [u, L+1, W]
        stats.target_calls += 1
        stats.cost_units += self.cost(scored.tokens)
        return scored if history is None else _penalized(scored, rows, history, sampling)

    @staticmethod
    def _commit(ids: list[int], cache, scored: Scored, outcome: Outcome) -> None:
        """The target cache keeps ids[:-1] + the accepted path: the emitted tokens but the last."""
        if scored.replicated:
            cache.keep_row(int(scored.row_of[outcome.survivor]))
            cache.crop(len(ids) + outcome.accepted)
        else:
            past = len(ids) - 1
            cache.gather(past, past + np.asarray(outcome.path, dtype=np.int64))
