"""Prompt-lookup drafting (SPECTR.md section 6) and the length rule that keeps it from costing time.

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
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .ngram_table import NgramTable
from .policy import PRIOR_ACCEPTED, PRIOR_REACHED, CostCurve, best_length, step_rate

class PromptLookup:
    """The drafter and its per-generation acceptance statistics."""

    def __init__(self, cost: CostCurve, max_len: int, max_ngram: int = 3, min_ngram: int = 1,
                 table: NgramTable | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("prompt lookup needs 1 <= min_ngram <= max_ngram")
        self.cost, self.max_len = cost, max_len
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.table = table
        # sizes -1 / -2: a one-token guess from the static table after one / two tokens
        sizes = list(range(min_ngram, max_ngram + 1)) + ([-1, -2] if table is not None else [])
        self.accepted = {n: PRIOR_ACCEPTED for n in sizes}
        self.reached = {n: PRIOR_REACHED for n in sizes}

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

    def acceptance(self, n: int) -> float:
        return self.accepted[n] / self.reached[n]

    def rate(self, n: int, length: int) -> float:
        """Expected tokens per unit of target time of verifying `length` tokens of an n-gram match."""
        return step_rate(self.cost, 0.0, [self.acceptance(n)] * length)

    def best_length(self, n: int, available: int) -> int:
        """Draft length in [0, available] with the most expected tokens per unit of target time
        (policy.best_length with a free drafter and the same acceptance at every position)."""
        return best_length(self.cost, 0.0, [self.acceptance(n)] * available)[0]

    def propose(self, ids, limit: int) -> tuple[list[int], int]:
        """The draft to verify this step (possibly empty) and its n-gram size (negative: the table's)."""
        draft, n = self.search(ids, min(limit, self.max_len))
        if not draft and self.table is not None and limit >= 1:
            guess = self.table.guess(ids)
            if guess is not None:
                draft, n = [guess[0]], -guess[1]
        if not draft:
            return [], 0
        return draft[:self.best_length(n, len(draft))], n

    def update(self, n: int, draft_len: int, accepted: int) -> None:
        """Positions verified: accepted + 1 (the first rejected one) unless all were accepted."""
        self.reached[n] += min(accepted + 1, draft_len)
        self.accepted[n] += accepted
