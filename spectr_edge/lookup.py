"""Prompt-lookup drafting (docs/ALGORITHMS.md) and the length rule that keeps it from costing time.

Drafting copies: find the longest n-gram (max_ngram down to min_ngram) that ends the committed
text and occurred earlier in it (prompt included), and propose the tokens that followed that
earlier occurrence. The draft is deterministic, so verification uses the one-hot rule
(selection.deterministic_select; exact greedy at temperature 0) and the output law is the
target's whatever is proposed.

How many of the proposed tokens to verify is chosen per step by expected tokens per unit of
target time: with a running acceptance estimate a (per n-gram size, this generation only) a
step verifying L drafted tokens yields 1 + a + ... + a^L tokens on average and costs c(L + 1)
single-token decodes, c being the target's verification cost curve. L = 0 (a plain decode step)
wins whenever no L > 0 beats 1 / c(1) = 1, so a bad match costs nothing but the search. The
curve comes from the bundle's manifest when `spectr-edge tune` measured one, else from defaults
measured on a 2-core CPU (policy.py); only draft-side information and fixed numbers decide, so a
seed gives the same output on every run and the law is unchanged.

The target's guess head (export/guess_head.py) drafts too when the text has nothing better to copy:
its first guess, and with a chain graph its further guesses, as many as their own per-position
estimates pay for (position j given the earlier ones, from the export's held-out agreement as
prior), each guess after the first adding the chain graph's cost.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .ngram_table import NgramTable
from .policy import PRIOR_ACCEPTED, PRIOR_REACHED, CostCurve, best_length, step_rate

GUESS = "guess"     # statistics key of the guess head's one-token drafts


class PromptLookup:
    """The drafter and its per-generation acceptance statistics."""

    def __init__(self, cost: CostCurve, max_len: int, max_ngram: int = 3, min_ngram: int = 1,
                 table: NgramTable | None = None, chain_cost: float = 0.0, chain_prior=()):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("prompt lookup needs 1 <= min_ngram <= max_ngram")
        self.cost, self.max_len = cost, max_len
        self.chain_cost = chain_cost      # one guess of the head's chain graph, in target decode steps
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.table = table
        # sizes -1 / -2: a one-token guess from the static table after one / two tokens
        sizes = list(range(min_ngram, max_ngram + 1)) + ([-1, -2] if table is not None else [])
        self.accepted = {n: PRIOR_ACCEPTED for n in sizes}
        self.reached = {n: PRIOR_REACHED for n in sizes}
        # the guess head's chain positions 2, 3, ...: priors from the export's held-out agreement, worth
        # as many observations as the others' (the last one for later positions); else 0.5
        self.chain_prior = [float(a) for a in chain_prior]

    def search(self, ids, limit: int) -> tuple[list[int], int]:
        """(continuation of the best earlier match, its n-gram size); ([], 0) when nothing matches.

        Longest n-gram first; among its matches the latest one that still has `limit` tokens after
        it, else the earliest (the longest continuation)."""
        arr = np.asarray(ids, dtype=np.int64)                       # [T]
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(arr) <= n:
                continue
            windows = sliding_window_view(arr[:-1], n)              # [T - n, n]: windows that have a next token
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if hits.size:
                full = hits[hits + n + limit <= len(arr)]
                start = int(full[-1] if full.size else hits[0]) + n
                return [int(t) for t in arr[start:start + limit]], n
        return [], 0

    def acceptance(self, n) -> float:
        return self.key_acceptance(n)

    def rate(self, n, length: int) -> float:
        """Expected tokens per unit of target time of verifying `length` tokens of an n-gram match (or
        of the guess head's chain: its own acceptance per position, and each guess after the first
        costs chain_cost)."""
        if n == GUESS:
            return step_rate(self.cost, self.chain_cost, self._guess_acceptance(length), free=1)
        return step_rate(self.cost, 0.0, [self.acceptance(n)] * length)

    def best_length(self, n, available: int) -> int:
        """Draft length in [0, available] with the most expected tokens per unit of target time
        (policy.best_length with a free drafter and the same acceptance at every position; for the
        guess head's chain, its per-position acceptance and cost). The shortest wins ties."""
        if n == GUESS:
            return best_length(self.cost, self.chain_cost, self._guess_acceptance(available), free=1)[0]
        return best_length(self.cost, 0.0, [self.acceptance(n)] * available)[0]

    def _guess_acceptance(self, length: int) -> list[float]:
        """The guess head's acceptance at chain positions 1 .. length, each given the earlier ones:
        keys GUESS, then (GUESS, j)."""
        return [self.key_acceptance(GUESS if j == 0 else (GUESS, j)) for j in range(length)]

    def propose(self, ids, limit: int, guess: int | None = None, chain=None) -> tuple[list[int], object]:
        """The draft to verify this step (possibly empty) and its statistics key: the n-gram size
        (negative: the table's), or GUESS for the target's guess head.

        guess: the target's guess-head token for after ids[-1] (export/guess_head.py); chain: n -> the
        head's n further guesses after it (its chain graph), or None. The guesses replace the copied
        draft when they are expected to yield more per unit of target time, and the table's guess
        always; how many are drafted follows their own per-position acceptance."""
        draft, n = self.search(ids, min(limit, self.max_len))
        if guess is not None and limit >= 1:
            reach = min(limit, self.max_len) if chain is not None else 1
            length = self.best_length(GUESS, reach)
            if not draft or (draft[0] != guess and self.rate(GUESS, max(1, length)) >
                             self.rate(n, max(1, self.best_length(n, len(draft))))):
                if length <= 1:
                    draft = [int(guess)]
                else:
                    draft = [int(guess)] + chain(length - 1)
                n = GUESS
        if not draft and self.table is not None and limit >= 1:
            guess = self.table.guess(ids)
            if guess is not None:
                draft, n = [guess[0]], -guess[1]
        if not draft:
            return [], 0
        return draft[:self.best_length(n, len(draft))], n

    def update(self, n, draft_len: int, accepted: int) -> None:
        """Positions verified: accepted + 1 (the first rejected one) unless all were accepted. The
        guess head's chain keeps one estimate per position."""
        if n == GUESS:
            for j in range(min(accepted + 1, draft_len)):
                key = GUESS if j == 0 else (GUESS, j)
                self.key_acceptance(key)
                self.reached[key] += 1
                self.accepted[key] += j < accepted
            return
        self.key_acceptance(n)                 # the key's prior, if it has none yet
        self.reached[n] += min(accepted + 1, draft_len)
        self.accepted[n] += accepted

    # -- several candidates in one token trie (tree bundles) ------------------------------------
    def candidates(self, ids, limit: int, count: int) -> list[tuple[list[int], object]]:
        """Up to `count` distinct drafts (tokens, stats key): the continuations of earlier matches of
        the text's last 1-3 tokens (longest n-gram first; within one size the latest occurrences with
        `limit` tokens after them first, then the others from the earliest), then the table's chain
        of guesses (each the most common follower of the two tokens before it). The first is what
        propose() would copy; the others' keys are ("alt", n), their own acceptance statistics. A
        draft that repeats an earlier one or a prefix of it adds nothing to a trie and is skipped."""
        arr = np.asarray(ids, dtype=np.int64)                       # [T]
        out: list[tuple[list[int], object]] = []
        limit = min(limit, self.max_len)
        if limit < 1:
            return out

        def add(tokens: list[int], n: int) -> None:
            if tokens and not any(c[:len(tokens)] == tokens for c, _ in out):
                out.append((tokens, n if not out else ("alt", n)))

        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(arr) <= n or len(out) >= count:
                continue
            windows = sliding_window_view(arr[:-1], n)              # [T - n, n]
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if not hits.size:
                continue
            full = hits[hits + n + limit <= len(arr)][::-1]
            rest = hits[hits + n + limit > len(arr)]
            for h in list(full[:4 * count]) + list(rest[:4 * count]):
                start = int(h) + n
                add([int(t) for t in arr[start:start + limit]], n)
                if len(out) >= count:
                    break
        if self.table is not None and len(out) < count:
            chain, context = [], list(ids[-2:])
            first = self.table.guess(context)
            n = -first[1] if first is not None else 0
            while len(chain) < limit:
                g = self.table.guess(context)
                if g is None:
                    break
                chain.append(g[0])
                context = [context[-1], g[0]]
            add(chain, n)
        return out

    def key_acceptance(self, key) -> float:
        if key not in self.reached:
            prior = PRIOR_ACCEPTED / PRIOR_REACHED
            if isinstance(key, tuple) and key[0] == GUESS and self.chain_prior:
                prior = self.chain_prior[min(key[1], len(self.chain_prior)) - 1]
            self.accepted[key], self.reached[key] = prior * PRIOR_REACHED, PRIOR_REACHED
        return self.accepted[key] / self.reached[key]

    def propose_trie(self, ids, limit: int, count: int) -> tuple[list[list[int]], list[tuple[list[int], object, int]]]:
        """The token trie to verify this step: (rows: the paths to its leaves, [] for a plain step;
        the candidates as (tokens, key, how many of their first tokens the trie holds)).

        Each candidate's j-th token is on the accepted path with estimated chance a^j (a: its key's
        acceptance so far); a node holds the best such chance among the candidates through it,
        never above its parent's. The trie is the set of the n likeliest nodes (ancestor-closed)
        for the n with the most expected tokens, 1 + the sum of those chances, per unit of target
        time c(n + 1); n = 0, a plain step, unless some n beats it."""
        cands = self.candidates(ids, limit, count)
        children: dict[tuple[int, int], int] = {}
        parent, token, chance = [-1], [-1], [1.0]
        for tokens, key in cands:
            a, node = self.key_acceptance(key), 0
            for j, tok in enumerate(tokens):
                p = min(a ** (j + 1), chance[node])
                child = children.get((node, tok))
                if child is None:
                    child = children[(node, tok)] = len(token)
                    parent.append(node)
                    token.append(tok)
                    chance.append(p)
                else:
                    chance[child] = max(chance[child], p)
                node = child
        order = sorted(range(1, len(token)), key=lambda i: (-chance[i], i))   # parents before children
        best, best_rate, expected = 0, 1.0, 1.0
        for size, node in enumerate(order, start=1):
            expected += chance[node]
            rate = expected / self.cost(size + 1)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = size, rate
        kept = set(order[:best])
        leaves = [i for i in kept if not any(parent[j] == i for j in kept)]
        rows = []
        for leaf in sorted(leaves):
            path, node = [], leaf
            while node > 0:
                path.append(token[node])
                node = parent[node]
            rows.append(path[::-1])
        verified = []
        for tokens, key in cands:
            node, held = 0, 0
            for tok in tokens:
                node = children[(node, tok)]
                if node not in kept:
                    break
                held += 1
            verified.append((tokens, key, held))
        return rows, verified

    def update_trie(self, verified: list[tuple[list[int], object, int]], emitted: list[int]) -> None:
        """After a trie step that emitted `emitted`: each candidate's verified tokens count as reached
        up to its first one off the emitted path, accepted while on it."""
        for tokens, key, held in verified:
            if held == 0:
                continue
            accepted = 0
            while accepted < held and accepted < len(emitted) and tokens[accepted] == emitted[accepted]:
                accepted += 1
            self.key_acceptance(key)
            self.reached[key] += min(accepted + 1, held)
            self.accepted[key] += accepted
