"""Acceptance rules: token level (K-SEQ, standard, deterministic) and sequence level (one per kind
of proposal: the greedy walk, SpecTr's k-SEQ over rows, the one-hot chain, the target's own walk
through a copied trie, Sequoia's tree rule). docs/ALGORITHMS.md gives the formulas.

Pure NumPy, float64 inside, randomness passed in as a numpy.random.Generator.
Names (defined once, used throughout):
  draft_probs     p  [V]  the exact vector the candidates were drawn from
  target_probs    q  [V]  the processed target distribution; the output follows it exactly
  num_candidates  SpecTr's k: how many i.i.d. candidates were drawn from p
  rho             division factor in [1, num_candidates]; candidate x is accepted w.p. min(1, q/(rho p))
  beta            beta(rho) = sum_x min(p(x), q(x)/rho): probability one candidate is accepted
  p_acc           1 - (1 - beta)^num_candidates: probability that some candidate is accepted
Inputs need not sum exactly to 1 (float32 softmax): both are renormalised in float64, which
matches `sampling.sample`, whose draws follow probs / probs.sum().
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .sampling import greedy_token, logits_to_probs, sample

VALIDITY_TOL = 1e-12    # a plan is valid when p_acc <= rho * beta + this; the law is off by at most this
RESIDUAL_EPS = 1e-12    # a residual with less mass is rounding noise (reached w.p. < this): use q
_SORT_AT_MOST = 512     # histogram the ratios until this few breakpoints remain, then sort them
_BINS = 2048            # log-spaced ratio bins per histogram level


@dataclass(frozen=True)
class KSeqPlan:
    rho: float
    beta: float     # beta(rho)
    p_acc: float    # P_acc(rho) = 1 - (1 - beta)^num_candidates


# -- choosing rho --------------------------------------------------------------------------------

def kseq_rho(draft_probs, target_probs, num_candidates: int) -> KSeqPlan:
    """[V], [V] -> the plan at rho* = the smallest rho in [1, num_candidates] with f(rho) >= 0,
    where f(rho) = rho * beta(rho) - P_acc(rho) (the residual is non-negative iff f >= 0)."""
    p, q = _as_dist(draft_probs), _as_dist(target_probs)     # [V], [V]
    plan = _plan(p, q, num_candidates, 1.0)
    if num_candidates == 1 or _is_valid(plan):                # standard spec sampling, p == q, disjoint
        return plan
    plan = _plan(p, q, num_candidates, _smallest_root(p, q, num_candidates))
    if _is_valid(plan):                                       # checked on the full vectors
        return plan
    return _plan(p, q, num_candidates, float(num_candidates))   # rho = k: always valid


def plan_at_rho(draft_probs, target_probs, num_candidates: int, rho: float) -> KSeqPlan:
    """[V], [V] -> beta and P_acc at a given rho (tests use it to force rho = 1)."""
    return _plan(_as_dist(draft_probs), _as_dist(target_probs), num_candidates, rho)


def _plan(p: np.ndarray, q: np.ndarray, num_candidates: int, rho: float) -> KSeqPlan:
    bound = q / rho                                          # [V] (p, q: normalised float64)
    beta = float(np.minimum(p, bound, out=bound).sum())      # in place: V-sized temporaries are slow
    return KSeqPlan(float(rho), beta, _acceptance(beta, num_candidates))


def _is_valid(plan: KSeqPlan) -> bool:
    return plan.p_acc <= plan.rho * plan.beta + VALIDITY_TOL


def _acceptance(beta: float, num_candidates: int) -> float:
    """P_acc = 1 - (1 - beta)^k, accurate for tiny beta."""
    beta = min(max(beta, 0.0), 1.0)
    return 1.0 if beta == 1.0 else -math.expm1(num_candidates * math.log1p(-beta))


def _smallest_root(p: np.ndarray, q: np.ndarray, num_candidates: int) -> float:
    """Smallest root of f on [1, num_candidates], given f(1) < 0; returns the valid (upper) end.

    With ratio = q/p, sum_x min(rho p, q) = rho * (p mass with ratio >= rho) + (q mass with
    ratio < rho). A histogram of the ratios (log-spaced bins) gives f exactly at every bin
    edge in O(V); entries outside the bin holding the root fold into those two constants.
    """
    ratio = np.divide(q, p, out=np.full_like(q, np.inf), where=p > 0)   # [V] q/p, inf where p = 0
    lo, hi, above, below = 1.0, float(num_candidates), 0.0, 0.0
    for _ in range(4):                                       # each level shrinks [lo, hi) _BINS-fold
        if ratio.size <= _SORT_AT_MOST or not hi > lo * (1 + 1e-12):
            break
        ratio, p, q, lo, hi, above, below = _narrow(ratio, p, q, lo, hi, above, below, num_candidates)
    return _root_among_breakpoints(ratio, p, q, lo, hi, above, below, num_candidates)


def _narrow(ratio, p, q, lo, hi, above, below, num_candidates):
    """[n] entries -> the entries, bracket and constants of the one bin of [lo, hi) holding the root."""
    position = ratio / lo                                                   # [n], then in place:
    with np.errstate(divide="ignore"):
        np.log(position, out=position)
    position *= _BINS / math.log(hi / lo)                                   # [0, _BINS) inside
    np.clip(position, -1.0, _BINS, out=position)
    position += 1.0
    bins = position.astype(np.intp)                                         # [n] 0: < lo; _BINS + 1: >= hi
    p_bins = np.bincount(bins, weights=p, minlength=_BINS + 2)              # [_BINS + 2]
    q_bins = np.bincount(bins, weights=q, minlength=_BINS + 2)              # [_BINS + 2]
    edges = lo * np.exp(np.arange(_BINS + 1) * (math.log(hi / lo) / _BINS))   # [_BINS + 1]; bin j = [e_j-1, e_j)
    edges[0], edges[-1] = lo, hi
    above_at = above + np.cumsum(p_bins[::-1])[::-1][1:]    # [_BINS + 1] p mass in bins > j
    below_at = below + np.cumsum(q_bins)[:-1]                # [_BINS + 1] q mass in bins <= j
    f_at = _f_vector(edges, edges * above_at + below_at, num_candidates)   # [_BINS + 1] f(e_j)
    found = np.flatnonzero(f_at[1:] >= 0)
    root_bin = int(found[0]) + 1 if found.size else _BINS   # f(e_j-1) < 0 <= f(e_j)
    keep = np.flatnonzero(bins == root_bin)
    return (ratio.take(keep), p.take(keep), q.take(keep), edges[root_bin - 1], edges[root_bin],
            above_at[root_bin], below_at[root_bin - 1])


def _f_vector(rho: np.ndarray, mass: np.ndarray, num_candidates: int) -> np.ndarray:
    """[n], [n] -> [n] f(rho) = mass - P_acc(mass / rho)."""
    beta = np.clip(mass / rho, 0.0, 1.0)
    with np.errstate(divide="ignore"):
        return mass + np.expm1(num_candidates * np.log1p(-beta))


def _root_among_breakpoints(ratio, p, q, lo, hi, above, below, num_candidates) -> float:
    """2. Sort the n breakpoints left in [lo, hi); f is smooth between them: find the piece
    where f turns >= 0, then solve inside it in closed form."""
    above += float(p[ratio >= hi].sum())                     # fold what lies outside [lo, hi)
    below += float(q[ratio < lo].sum())
    inside = (ratio >= lo) & (ratio < hi)
    ratio, p, q = ratio[inside], p[inside], q[inside]
    order = np.argsort(ratio)
    ratio, p, q = ratio[order], p[order], q[order]           # [n] ascending ratio
    above_at = above + np.cumsum(p[::-1])[::-1]              # [n] p mass with ratio >= ratio[j]
    below_at = below + np.cumsum(q) - q                      # [n] q mass with ratio < ratio[j]
    mass = ratio * above_at + below_at                       # [n] rho * beta at rho = ratio[j]
    f_at = _f_vector(ratio, mass, num_candidates)           # [n] f(ratio[j])
    piece = int(np.argmax(f_at >= 0)) if np.any(f_at >= 0) else ratio.size
    left = ratio[piece - 1] if piece > 0 else lo
    right = ratio[piece] if piece < ratio.size else hi
    above_piece = above + float(p[piece:].sum())             # constant for rho in (left, right)
    below_piece = below + float(q[:piece].sum())
    return _root_in_piece(float(left), float(right), above_piece, below_piece, num_candidates)


def _root_in_piece(left, right, above, below, num_candidates) -> float:
    """Root of f(rho) = rho*beta - P_acc(beta), beta = above + below/rho, given f(left) < 0 <= f(right).

    Illinois false position (superlinear; keeps the bracket), down to ~1e-14 relative width;
    returns the right end, where f >= 0.
    """
    def f(rho):
        beta = min(above + below / rho, 1.0)
        return rho * beta + (math.expm1(num_candidates * math.log1p(-beta)) if beta < 1.0 else -1.0)

    f_left, f_right, last_side = f(left), f(right), 0
    for _ in range(200):
        if right - left <= 1e-14 * right:
            break
        rho = (left * f_right - right * f_left) / (f_right - f_left) if f_right > f_left else left
        if not left < rho < right:                          # degenerate: bisect instead
            rho = 0.5 * (left + right)
        f_rho = f(rho)
        if f_rho >= 0:
            right, f_right = rho, f_rho
            f_left *= 0.5 if last_side == 1 else 1.0   # Illinois: halve the stale end
            last_side = 1
        else:
            left, f_left = rho, f_rho
            f_right *= 0.5 if last_side == -1 else 1.0
            last_side = -1
    return right


# -- the residual and the selection rules --------------------------------------------------------

def kseq_residual(draft_probs, target_probs, plan: KSeqPlan, num_candidates: int) -> np.ndarray:
    """[V], [V] -> [V] float64 p_res = (q - min(p, q/rho) * p_acc/beta) / (1 - beta)^k.

    Negative entries (rounding, or an invalid rho forced by a test) are clipped to 0 and the
    rest renormalised; a residual with ~0 mass (never reached) falls back to q.
    """
    p, q = _as_dist(draft_probs), _as_dist(target_probs)     # [V], [V]
    per_beta = plan.p_acc / plan.beta if plan.beta > 0 else float(num_candidates)   # beta -> 0: k
    residual = q / plan.rho                                  # [V], then in place:
    np.minimum(p, residual, out=residual)
    residual *= per_beta                                     # P(Y = x and Y is a candidate)
    np.subtract(q, residual, out=residual)
    np.maximum(residual, 0.0, out=residual)                  # (1 - beta)^k * p_res, clipped
    mass = residual.sum()
    return q if mass <= RESIDUAL_EPS else residual / mass


def kseq_select(candidates: Sequence[int], draft_probs, target_probs,
                rng: np.random.Generator) -> tuple[int, int | None]:
    """K-SEQ: candidates are num_candidates i.i.d. draws from draft_probs (duplicates allowed).

    Returns (token, index of the accepted candidate) or (token, None) if it came from the
    residual. The token follows target_probs exactly. One candidate = standard speculative
    sampling (accept w.p. min(1, q/p), residual norm(max(q - p, 0))).
    """
    num_candidates = len(candidates)
    if num_candidates < 1:
        raise ValueError("kseq_select needs at least one candidate")
    p, q = _as_dist(draft_probs), _as_dist(target_probs)     # [V], [V]
    plan = kseq_rho(p, q, num_candidates)                    # module-level name: tests patch it
    for index, token in enumerate(candidates):
        token, u = int(token), rng.random()
        # accept w.p. min(1, q / (rho p)); q == 0 is never accepted (also guards p == 0)
        if q[token] > 0 and u * plan.rho * p[token] <= q[token]:
            return token, index
    return int(sample(kseq_residual(p, q, plan, num_candidates), rng)), None


def deterministic_select(candidate: int, target_probs, rng: np.random.Generator) -> tuple[int, bool]:
    """One-hot draft (prompt lookup, greedy drafter): accept w.p. q(x); otherwise draw from
    q with x removed and renormalised. Returns (token, accepted)."""
    q = _as_dist(target_probs)                               # [V]
    candidate = int(candidate)
    if rng.random() < q[candidate]:
        return candidate, True
    rest = q.copy()                                          # [V]
    rest[candidate] = 0.0
    if not rest.sum() > 0:                                   # q(x) == 1: always accepted
        return candidate, True
    return int(sample(rest, rng)), False


def _as_dist(probs) -> np.ndarray:
    """[V] -> [V] float64 summing to 1."""
    dist = np.array(probs, dtype=np.float64)                 # [V] a copy: the caller's is untouched
    total = dist.sum()
    if not (np.isfinite(total) and total > 0):
        raise ValueError("a probability vector needs positive, finite mass")
    dist /= total
    return dist


# -- sequence-level rules: one per kind of proposal ----------------------------------------------
# Each reads the target's logits at the proposal's nodes and returns the emitted tokens (the
# accepted drafted tokens, then one token of the target's own) and the accepted path in the
# proposal's trie (root included). docs/ALGORITHMS.md says why each keeps the target's law.

def greedy_walk(trie, node_logits, vocab_size: int) -> tuple[list[int], list[int]]:
    """Temperature 0, any proposal (chain, side leaves, draft tree, copied trie): from the root,
    emit the target's argmax and follow the child holding it; stop at the first token no child
    holds (it is still emitted). Exactly plain greedy decoding with some rows precomputed."""
    return target_walk(trie, node_logits, lambda logits: int(greedy_token(logits, vocab_size)))


def target_walk(trie, node_logits, choose) -> tuple[list[int], list[int]]:
    """From the root, emit choose(the node's logits) (the target's own argmax or draw) and follow the
    child holding that token; stop at the first token no child holds. A deterministic proposal then
    only decides which rows were precomputed, so the output law is the target's."""
    node, out, path = 0, [], [0]
    while True:
        tok = choose(node_logits[node])
        out.append(tok)
        child = trie.children.get((node, tok))
        if child is None:
            return out, path
        node = child
        path.append(node)


def one_hot_chain(draft, chain_logits, sampling, vocab_size: int, rng) -> list[int]:
    """A deterministic chain (prompt lookup) at temperature > 0: per position accept x w.p. q(x),
    else draw from q without x and stop (deterministic_select); a bonus token from q when every
    position was accepted. chain_logits # [L+1, W]."""
    out: list[int] = []
    for j, tok in enumerate(draft):
        token, ok = deterministic_select(tok, logits_to_probs(chain_logits[j], sampling, vocab_size), rng)
        out.append(int(token))
        if not ok:
            return out
    out.append(int(sample(logits_to_probs(chain_logits[len(draft)], sampling, vocab_size), rng)))
    return out


def select_sequence(drafts, draft_probs, target_logits, row_of, sampling, vocab_size, rng):
    """Sequence-level SpecTr selection over k candidate rows (the sequence step of k-SEQ).

    drafts        # [k, L] candidate tokens (i.i.d. rows)
    draft_probs   # [k, L, W] processed draft probs each token was drawn from (None if greedy)
    target_logits # [u, L+1, W] target logits for the distinct rows (indexable as [row, j]);
    row_of        # [k] maps candidate -> row
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
        token, picked = kseq_select(drafts[survivors, j], draft_probs[survivors[0], j], target_probs, rng)
        out.append(int(token))
        if picked is None:                               # residual sample: the step ends here
            return out, int(survivors[0])
        survivors = survivors[drafts[survivors, j] == token]
    # bonus token: every position accepted, sample from q after the last draft token
    row = row_of[survivors[0]]
    if sampling.greedy:
        out.append(int(greedy_token(target_logits[row, draft_len], vocab_size)))
    else:
        out.append(int(sample(logits_to_probs(target_logits[row, draft_len], sampling, vocab_size), rng)))
    return out, int(survivors[0])


def sequoia_residual(q: np.ndarray, p: np.ndarray) -> np.ndarray:
    """norm(max(q - p, 0)): what the target still owes after a draft token drawn from p was rejected."""
    r = np.maximum(q - p, 0.0)
    total = r.sum()
    return r / total if total > 0 else q


def sequoia_walk(tree, trie, node_logits, sampling, vocab_size: int, rng) -> tuple[list[int], list[int]]:
    """A Sequoia tree (children drawn without replacement from the draft, in drawing order): at each
    node, child x is accepted if u p~(x) < q(x), p~ the draft renormalised without the rejected
    siblings, else q <- norm(max(q - p~, 0)) and the next child is tried; when no child is accepted
    (or at a leaf) the next token is drawn from q. tree.draft_probs[node] is the p a node's
    children were drawn from."""
    node, trie_node, out, path = 0, 0, [], [0]
    while True:
        q = logits_to_probs(node_logits[trie_node], sampling, vocab_size).astype(np.float64)
        chosen = None
        if node in tree.draft_probs:
            p = tree.draft_probs[node].copy()
            for child in tree.kids[node]:
                x = tree.tokens[child]
                if rng.random() * p[x] < q[x]:
                    chosen = child
                    break
                q = sequoia_residual(q, p)
                p[x] = 0.0
                if p.sum() <= 0:
                    break
                p /= p.sum()
        if chosen is None:
            out.append(int(sample(q, rng)))
            return out, path
        out.append(tree.tokens[chosen])
        node, trie_node = chosen, trie.children[(trie_node, tree.tokens[chosen])]
        path.append(trie_node)
