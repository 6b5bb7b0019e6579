"""Drafters: each proposes the tokens a step verifies, and learns from what was accepted.

A drafter has two methods. `propose(step)` returns a Proposal: the candidate rows (a chain, k
rows, a copied trie, or a draft tree's root-to-leaf paths) and the rule that verifies them
(a name in RULES, spectr_edge/selection.py), with what the rule needs (the draft probabilities
each sampled token was drawn from; a Sequoia tree's drawing order). No rows is a plain step.
`update(proposal, outcome)` commits the drafter's own state to the accepted tokens (the draft
model's cache: crop, keep the surviving row, gather a tree path) and updates its statistics
(acceptance per position, per n-gram size; the adaptive length's counts).

    ModelRows      the draft model's k i.i.d. continuations (k = 1: a chain; SpecTr's k-SEQ at T > 0)
    SideLeaves     greedy: the draft's chain plus its next-best tokens at every depth as leaves
    OptTree        greedy: a draft tree of the nodes with the highest path probability (OPT-Tree)
    SequoiaTree    sampling: a fixed Sequoia shape whose children are drawn without replacement
    Lookup         prompt lookup: the continuation of the text's latest n-gram match (or a one-token
                   guess of the bundle's table or of the target's guess head)
    LookupTrie     prompt lookup: several copied continuations verified as one token trie
    LookupFirst    prompt lookup when the text matches, the draft model otherwise
    NoDraft        target-only decoding

`build_drafter` turns validated DecodeOptions into one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .lookup import GUESS, PromptLookup
from .policy import AdaptiveLength, CostCurve
from .sampling import TokenHistory, greedy_token, logits_to_probs, sample
from .stats import GenerationStats
from .trees import DraftTree, SequoiaShape, top_ids

# the rules a proposal can name (selection.py implements them; engine.RULES maps the names)
GREEDY, KSEQ, ONE_HOT, WALK, SEQUOIA = "greedy", "kseq", "one_hot", "walk", "sequoia"


@dataclass
class Proposal:
    """What one step verifies. rows: the candidate continuations, each a list of token ids after
    the last committed token (k rows for k-SEQ, duplicates allowed; [] = a plain step)."""
    rows: list[list[int]]
    rule: str                                  # how verification reads the rows when sampling: KSEQ, ONE_HOT,
                                               # WALK, SEQUOIA (at temperature 0 always the GREEDY walk)
    draft_probs: np.ndarray | None = None      # KSEQ: [k, L, W] the processed draft probs each token was drawn from
    tree: DraftTree | None = None              # draft trees: the tree (its nodes' draft-cache positions; Sequoia's
                                               # drawing order and draft probs per node)
    kind: str = "model"                        # statistics: "model", "lookup", "guess" (the guess head's token)
    chose_last: bool = False                   # a chain call whose row len(tokens) - 1 chose its last token:
                                               # the target's guess head then guesses the token after it
    note: object = None                        # the drafter's own bookkeeping for update()

    @property
    def depth(self) -> int:
        """Draft positions offered for verification (the longest row)."""
        return max((len(r) for r in self.rows), default=0)


@dataclass
class Outcome:
    """What verification kept: the emitted tokens (accepted drafted tokens + one of the target's),
    the accepted path in the proposal's trie (root included), the surviving candidate row."""
    tokens: list[int]
    path: list[int]
    survivor: int = 0

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1


@dataclass
class Step:
    """What a drafter knows when it proposes."""
    ids: list[int]                             # every committed token; the target cache holds ids[:-1]
    budget: int                                # the most tokens this step may draft (max_new_tokens, context)
    sampling: object                           # SamplingParams
    rng: np.random.Generator
    stats: GenerationStats
    guess: int | None = None                   # the target guess head's token for after ids[-1], if any
    history: TokenHistory | None = None        # with penalties: the committed tokens they read
    chain: object = None                       # n -> the guess head's n further guesses after `guess` (its
                                               # chain graph; None without one)

    def processed(self, logits: np.ndarray, paths) -> np.ndarray:
        """Draft logits # [rows, W] with penalties applied from each row's path of drafted tokens
        (the draft then proposes from the same processed distribution the target is verified with)."""
        if self.history is None:
            return logits
        return np.stack([self.history.penalize(row, self.sampling, path) for row, path in zip(logits, paths)])


PLAIN = Proposal([], WALK, chose_last=True)     # the target alone chooses the next token


class NoDraft:
    """Target-only decoding: every step is a plain step."""

    wants_guess = False

    def start(self, ids: list[int], window: int, reused=None) -> None:
        """A new generation, after the prefill; `reused`: the prefix-cache entry the target's cache
        came from (prefix_cache.CachedPrefix), whose draft cache may serve too."""

    def propose(self, step: Step) -> Proposal:
        return PLAIN

    def update(self, proposal: Proposal, outcome: Outcome) -> None:
        pass

    def draft_state(self) -> tuple:
        """(the draft model's cache, tokens it has read) to keep with the target's, or (None, 0)."""
        return None, 0


class _ModelDrafter(NoDraft):
    """A drafter of the draft model's: starts its cache after the prefill."""

    draft: "DraftModel"

    def start(self, ids: list[int], window: int, reused=None) -> None:
        self.draft.start(ids, window, reused)

    def draft_state(self) -> tuple:
        return self.draft.cache, self.draft.seen


# -- the draft model ---------------------------------------------------------------------------------

@dataclass
class DraftCosts:
    """Predicted costs in target decode steps: one drafted token, and a call over r rows (or tree
    nodes) relative to one row."""
    token: float
    rows: CostCurve


class DraftModel:
    """The draft model's side of every model drafter: its cache, which holds ids[:seen] (the committed
    tokens it has read), and its calls. It catches up on the newest committed tokens at the start of
    each step. With a window it reads only the prompt's latest `window` tokens."""

    def __init__(self, lm, vocab_size: int, costs: DraftCosts):
        self.lm, self.vocab_size, self.costs = lm, vocab_size, costs
        self.cache, self.seen = None, 0

    def start(self, ids: list[int], window: int, reused=None) -> None:
        """A new generation; `ids` = the prompt and the prefill's first token. With a window the draft
        reads the prompt's latest `window` tokens only: its prefill is the largest draft cost on long
        prompts, and what it drafts never changes the law. A reused entry's draft cache serves when it
        starts where this generation's window starts; it keeps the tokens shared with the prompt."""
        offset = max(0, len(ids) - 1 - window) if window > 0 else 0
        if reused is not None and reused.draft is not None and reused.draft.offset == offset:
            seen = min(reused.draft_seen, len(reused.tokens))
            if seen > offset:
                self.cache, self.seen = reused.draft, seen
                self.cache.crop(seen - offset)
                return
        self.cache, self.seen = self.lm.new_cache(), offset
        self.cache.offset = offset

    def charge(self, stats: GenerationStats, calls: int, units: float) -> None:
        stats.draft_calls += calls
        stats.cost_units += self.costs.token * units

    def chain(self, step: Step, num_candidates: int, draft_len: int, draft_stop: float = 0.0, alternatives: int = 0):
        """num_candidates i.i.d. continuations of draft_len tokens, one batch of rows.

        Returns tokens # [k, L] and, when sampling, the processed draft probs they were drawn from
        # [k, L, W] (None when greedy); with alternatives > 0 (greedy, k = 1) also the draft's
        next-best tokens at every position, best first # [L, alternatives]. draft_stop: stop early
        once the draft's probability of its own token falls below it (only draft-side information
        decides, so the output law is unchanged)."""
        ids, sampling, rng, cache = step.ids, step.sampling, step.rng, self.cache
        alts = []
        catch_up = np.asarray([ids[self.seen:]], dtype=np.int64)             # [1, unseen]
        logits = step.processed(self.lm.forward(catch_up, cache, last=1)[:, -1], [[]])   # [1, W]
        tokens = np.empty((num_candidates, draft_len), dtype=np.int64)        # [k, L]
        probs = None
        for j in range(draft_len):
            if j > 0:
                logits = step.processed(self.lm.forward(tokens[:, j - 1:j], cache)[:, 0], tokens[:, :j])  # [k, W]
            if sampling.greedy:
                tokens[:, j] = greedy_token(logits, self.vocab_size)
                if alternatives:
                    alts.append(next_best(logits[0, :self.vocab_size], int(tokens[0, j]), alternatives))
            else:
                p = logits_to_probs(logits, sampling, self.vocab_size)         # [1 or k, W]
                if probs is None:
                    probs = np.empty((num_candidates, draft_len, p.shape[-1]), dtype=p.dtype)
                probs[:, j] = p
                tokens[:, j] = sample(np.broadcast_to(p, (num_candidates, p.shape[-1])), rng)
            stop = (draft_stop > 0 and num_candidates == 1 and j < draft_len - 1 and
                    _confidence(logits[0, :self.vocab_size], p[0] if probs is not None else None, tokens[0, j])
                    < draft_stop)
            if j == 0:
                cache.repeat_rows(num_candidates)
            if stop:
                tokens = tokens[:, :j + 1]
                probs = probs[:, :j + 1] if probs is not None else None
                break
        self.charge(step.stats, tokens.shape[1], 1 + (tokens.shape[1] - 1) * self.costs.rows(num_candidates))
        return tokens, probs, alts[:tokens.shape[1]]

    def commit_row(self, survivor: int, seen: int) -> None:
        """Keep the surviving candidate's row, holding ids[:seen]."""
        self.cache.keep_row(survivor)
        self.seen = seen
        self.cache.crop(seen - self.cache.offset)

    # -- draft trees: one call per depth over the newest nodes ------------------------------------
    def tree_root(self, step: Step) -> tuple[np.ndarray, int]:
        """Catch up on the committed ids; the draft's logits after them # [1, W] and the cache length
        where the tree's nodes start."""
        logits = self.lm.forward(np.asarray([step.ids[self.seen:]], dtype=np.int64), self.cache, last=1)[0, -1:]
        self.charge(step.stats, 1, 1.0)
        return logits, self.cache.length

    def tree_nodes(self, tree: DraftTree, new: list[int], base: int, stats: GenerationStats) -> np.ndarray:
        """One draft call over a tree's newest nodes; their logits # [len(new), W]. Each node sees the
        committed ids (the first `base` cache positions) and its own ancestors, not the other
        branches; position = base - 1 + depth."""
        past = self.cache.length
        past_mask = np.zeros((len(new), past), dtype=bool)                  # [new, past]
        past_mask[:, :base] = True
        for i, node in enumerate(new):
            for a in tree.ancestors_of(node):
                if tree.fed[a] is not None:
                    past_mask[i, tree.fed[a]] = True
        positions = np.asarray([base - 1 + tree.depth[n] for n in new], dtype=np.int64)
        logits = self.lm.forward(np.asarray([[tree.tokens[n] for n in new]], dtype=np.int64), self.cache,
                                 np.eye(len(new), dtype=bool), positions - past, past_mask)[0]
        for i, node in enumerate(new):
            tree.fed[node] = past + i
        # a call over n nodes costs like a step over n rows (MatMulNBits grows with rows like with tokens)
        self.charge(stats, 1, self.costs.rows(len(new)))
        return logits

    def commit_tree(self, tree: DraftTree, base: int, tokens: list[int], accepted: int) -> None:
        """Keep the accepted path's nodes the draft has read, after the committed ids."""
        kept = tree.fed_path(tokens[:accepted])
        self.cache.gather(base, np.asarray(kept, dtype=np.int64))
        self.seen = self.cache.offset + base + len(kept)


class ModelRows(_ModelDrafter):
    """The draft model's k i.i.d. continuations of up to draft_len tokens (k = 1: one chain). Greedy:
    the rows would coincide, so one is drafted. adaptive (k = 1): each step's length, 0 included,
    from this generation's acceptance and the cost model (policy.AdaptiveLength)."""

    wants_guess = False

    def __init__(self, draft: DraftModel, num_candidates: int, draft_len: int, draft_stop: float,
                 adaptive: AdaptiveLength | None = None):
        self.draft, self.k, self.draft_len, self.draft_stop = draft, num_candidates, draft_len, draft_stop
        self.adaptive = adaptive

    def length(self, step: Step) -> int:
        draft_len = min(self.draft_len, step.budget)
        if self.adaptive is not None and draft_len >= 1:
            draft_len = self.adaptive.choose(draft_len)
            step.stats.undrafted += draft_len == 0          # the length rule chose a plain step
        return draft_len

    def propose(self, step: Step, draft_len: int | None = None) -> Proposal:
        draft_len = self.length(step) if draft_len is None else draft_len
        if draft_len < 1:
            return PLAIN
        k = 1 if step.sampling.greedy else self.k
        tokens, probs, _ = self.draft.chain(step, k, draft_len, self.draft_stop)
        return Proposal([list(map(int, r)) for r in tokens], KSEQ, draft_probs=probs, note=len(step.ids))

    def update(self, proposal: Proposal, outcome: Outcome) -> None:
        if not proposal.rows:
            return
        draft_len = proposal.depth
        self.draft.commit_row(outcome.survivor, proposal.note + min(outcome.accepted, draft_len - 1))
        if self.adaptive is not None:
            self.adaptive.update(draft_len, outcome.accepted)


class SideLeaves(_ModelDrafter):
    """Greedy on a tree target: the draft's greedy chain plus, at every depth, its next
    `branches - 1` best tokens as leaves, all verified in one call by the exact greedy walk. A leaf
    costs one more scored token and no draft call; when the chain's token is wrong but a leaf's is
    right, the step gains that token and the target's next one."""

    wants_guess = False

    def __init__(self, draft: DraftModel, branches: int, draft_len: int, draft_stop: float):
        self.draft, self.branches, self.draft_len, self.draft_stop = draft, branches, draft_len, draft_stop

    def propose(self, step: Step) -> Proposal:
        draft_len = min(self.draft_len, step.budget)
        if draft_len < 1:
            return PLAIN
        chain, _, alternatives = self.draft.chain(step, 1, draft_len, self.draft_stop, alternatives=self.branches - 1)
        chain = [int(t) for t in chain[0]]
        rows = [chain] + [chain[:j] + [int(a)] for j in range(len(chain)) for a in alternatives[j]]
        return Proposal(rows, GREEDY, note=(len(step.ids), chain))

    def update(self, proposal: Proposal, outcome: Outcome) -> None:
        if not proposal.rows:
            return
        committed, chain = proposal.note
        on_chain = 0                                    # accepted tokens that are the chain's (the draft saw them)
        while on_chain < min(outcome.accepted, len(chain)) and outcome.tokens[on_chain] == chain[on_chain]:
            on_chain += 1
        self.draft.seen = committed + min(on_chain, len(chain) - 1)
        self.draft.cache.crop(self.draft.seen - self.draft.cache.offset)


class OptTree(_ModelDrafter):
    """Greedy: a draft tree of `budget` nodes grown one draft call per depth over the newest nodes,
    keeping the nodes with the highest draft path probability (OPT-Tree); verified by the exact
    greedy walk."""

    wants_guess = False

    def __init__(self, draft: DraftModel, budget: int, max_depth: int):
        self.draft, self.budget, self.max_depth = draft, budget, max_depth

    def propose(self, step: Step) -> Proposal:
        max_depth = min(self.max_depth, step.budget)
        if max_depth < 1:
            return PLAIN
        tree = DraftTree(step.ids[-1], self.budget)
        logits, base = self.draft.tree_root(step)                 # [1, W]
        frontier = [0]
        for depth in range(1, max_depth + 1):
            if step.history is not None:
                logits = step.processed(logits, [tree.path(n) for n in frontier])
            new = tree.grow(frontier, logits[:, :self.draft.vocab_size])
            if not new or depth == max_depth:
                break
            logits = self.draft.tree_nodes(tree, new, base, step.stats)
            frontier = new
        return Proposal(tree.rows(), GREEDY, tree=tree, note=base)

    def update(self, proposal: Proposal, outcome: Outcome) -> None:
        if proposal.tree is not None:
            self.draft.commit_tree(proposal.tree, proposal.note, outcome.tokens, outcome.accepted)


class SequoiaTree(OptTree):
    """Sampling: a Sequoia tree: the fixed shape's children of a node are drawn without replacement
    from the draft there, one draft call per depth; verified by Sequoia's rule."""

    def __init__(self, draft: DraftModel, shape: SequoiaShape, max_depth: int):
        self.draft, self.shape, self.max_depth = draft, shape, max_depth

    def propose(self, step: Step) -> Proposal:
        max_depth = min(self.max_depth, step.budget)
        if max_depth < 1:
            return PLAIN
        sampling, vocab, shape = step.sampling, self.draft.vocab_size, self.shape
        tree = DraftTree(step.ids[-1], 0)
        logits, base = self.draft.tree_root(step)
        frontier, shape_of = [0], {0: 0}                   # tree node -> shape node
        for depth in range(1, max_depth + 1):
            new = []
            if step.history is not None:
                logits = step.processed(logits, [tree.path(n) for n in frontier])
            probs = logits_to_probs(logits, sampling, vocab)                      # [f, W]
            for fi, node in enumerate(frontier):
                width = shape.children[shape_of[node]]
                if not width:
                    continue
                p = probs[fi].astype(np.float64)
                tree.draft_probs[node] = p.copy()
                for rank in range(width):                  # without replacement, in drawing order
                    total = p.sum()
                    if total <= 0:
                        break
                    tok = int(sample(p / total, step.rng))
                    child = tree.add_child(node, tok)
                    shape_of[child] = shape.child(shape_of[node], rank)
                    new.append(child)
                    p[tok] = 0.0
            expand = [n for n in new if shape.children[shape_of[n]]]
            if not expand or depth == max_depth:
                break
            logits = self.draft.tree_nodes(tree, expand, base, step.stats)
            frontier = expand
        return Proposal(tree.rows(), SEQUOIA, tree=tree, note=base)


# -- prompt lookup -----------------------------------------------------------------------------------

class Lookup(NoDraft):
    """Prompt lookup: the continuation of the text's latest n-gram match, as long as it pays
    (lookup.PromptLookup), or a one-token guess (the bundle's table, the target's guess head); a
    deterministic draft, verified by the greedy walk or the one-hot rule."""

    def __init__(self, lookup: PromptLookup, wants_guess: bool):
        self.lookup, self.wants_guess = lookup, wants_guess

    def propose(self, step: Step) -> Proposal:
        if step.budget < 1:
            return PLAIN
        draft, ngram = self.lookup.propose(step.ids, step.budget, step.guess, step.chain)
        if not draft:
            return PLAIN
        return Proposal([draft], ONE_HOT, kind="guess" if ngram == GUESS else "lookup", chose_last=True, note=ngram)

    def update(self, proposal: Proposal, outcome: Outcome) -> None:
        if proposal.rows:
            self.lookup.update(proposal.note, proposal.depth, outcome.accepted)


class LookupTrie(NoDraft):
    """Prompt lookup's candidates (other matches, the table's chain) verified as one token trie: from
    the root each position's token is the target's own choice at that node, so the drafts only decide
    which rows were precomputed. A trie of one row is verified as a chain."""

    wants_guess = False

    def __init__(self, lookup: PromptLookup, count: int):
        self.lookup, self.count = lookup, count

    def propose(self, step: Step) -> Proposal:
        if step.budget < 1:
            return PLAIN
        rows, verified = self.lookup.propose_trie(step.ids, step.budget, self.count)
        if not rows:
            return PLAIN
        if len(rows) == 1:
            return Proposal(rows, ONE_HOT, kind="lookup", chose_last=True, note=verified)
        return Proposal(rows, WALK, kind="lookup", note=verified)

    def update(self, proposal: Proposal, outcome: Outcome) -> None:
        if proposal.rows:
            self.lookup.update_trie(proposal.note, outcome.tokens)


class LookupFirst:
    """Prompt lookup when the text has a match, the draft model otherwise. adaptive: a match is
    taken only when it is expected to yield more tokens per unit of time than the draft model."""

    def __init__(self, lookup: Lookup, model, adaptive: AdaptiveLength | None = None):
        self.lookup, self.model, self.adaptive = lookup, model, adaptive
        self.wants_guess = lookup.wants_guess

    def start(self, ids: list[int], window: int, reused=None) -> None:
        self.model.start(ids, window, reused)

    def draft_state(self) -> tuple:
        return self.model.draft_state()

    def propose(self, step: Step) -> Proposal:
        proposal = self.lookup.propose(step)
        if proposal.rows and self.adaptive is not None:
            draft_len = min(self.model.draft_len, step.budget)
            if draft_len >= 1 and self.adaptive.best(draft_len)[1] > \
                    self.lookup.lookup.rate(proposal.note, proposal.depth):
                proposal = PLAIN     # the draft model is expected to yield more per unit of time this step
        if proposal.rows:
            return proposal
        return self.model.propose(step)

    def update(self, proposal: Proposal, outcome: Outcome) -> None:
        (self.lookup if proposal.kind != "model" else self.model).update(proposal, outcome)


# -- helpers -------------------------------------------------------------------------------------------

def next_best(logits: np.ndarray, best: int, count: int) -> list[int]:
    """The `count` highest-logit ids other than `best`, highest first."""
    return [int(t) for t in top_ids(logits, count + 1) if t != best][:count]


def _confidence(logits: np.ndarray, probs: np.ndarray | None, token: int) -> float:
    """Draft-side confidence in a drafted token: its draft probability (softmax of raw logits if greedy)."""
    if probs is not None:
        return float(probs[token])
    top = logits.max()
    return float(1.0 / np.exp(logits - top).sum()) if logits[token] == top else 0.0
