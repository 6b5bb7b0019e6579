"""How long to draft: expected accepted tokens per unit of predicted step time (docs/ALGORITHMS.md).

Both drafters choose their length per step from the same two ingredients:
  * the target's verification cost curve c(n), the time of one call scoring n tokens in one row
    relative to a single-token decode (c(1) = 1), and the draft's cost per drafted token d in the
    same unit: measured on this machine by `spectr-edge tune` and stored in the manifest, else
    defaults (DEFAULT_COST_CURVES by target precision, measured on a 2-core CPU, and d = the
    draft's weight bytes / the target's, decode being memory-bound: 0.13 for the default bundle's
    int4 0.5B draft over its float32 1.5B target, where 0.14 was measured);
  * running acceptance estimates from this generation's own verified steps (a prior worth two
    observations, then counts that decay by DECAY per step so they follow the text).
A step drafting L tokens is worth E(L) = 1 + a1 + a1 a2 + ... (a_j: acceptance of position j given
the earlier ones) tokens at a cost of c(L + 1) + d L. L = 0 is a plain decode step, worth 1 at cost
1; it wins when no draft pays. Nothing here reads a clock or the target's output beyond accept /
reject counts, so the output law is unchanged and a seed reproduces a generation exactly.
"""

from __future__ import annotations

import numpy as np

# relative cost of one target call scoring n tokens in one row (n = 1 is 1.0), by target precision:
# Qwen2.5-Coder-1.5B on a 2-core AMD EPYC, ONNX Runtime 1.32 (bench/RESULTS.md, 2026-11-30)
DEFAULT_COST_CURVES = {
    "none": ((1, 1.0), (2, 1.19), (4, 1.27), (8, 1.58), (16, 2.29), (32, 3.96)),
    "int8": ((1, 1.0), (2, 1.06), (4, 1.11), (8, 1.32), (16, 1.82), (32, 2.89)),
    "int4": ((1, 1.0), (2, 1.23), (4, 1.81), (8, 3.02), (16, 5.37), (32, 10.3)),
    # int8 weights and activations (MatMulInteger), `spectr-edge tune` on a 2-core Intel Xeon (2026-12-02)
    "w8a8": ((1, 1.0), (2, 1.01), (4, 1.07), (8, 1.13), (16, 1.30)),
}


class CostCurve:
    """Piecewise-linear relative cost c(n) of scoring n tokens in one call; c(1) = 1."""

    def __init__(self, points):
        pts = sorted((int(n), float(c)) for n, c in points)
        if not pts or pts[0][0] != 1:
            raise ValueError("a cost curve starts at n = 1")
        self.n = np.array([n for n, _ in pts], dtype=np.float64)
        self.c = np.array([c for _, c in pts], dtype=np.float64) / pts[0][1]

    @classmethod
    def for_quant(cls, quant: str, measured=None) -> "CostCurve":
        return cls(measured or DEFAULT_COST_CURVES.get(quant, DEFAULT_COST_CURVES["none"]))

    def floored(self, min_tokens: int, multiple: int = 1) -> "CostCurve":
        """The curve when every call scores at least min_tokens, rounded up to a multiple of
        `multiple` (the runtime pads the rest), relative to such a padded single-token decode."""
        if min_tokens <= 1 and multiple <= 1:
            return self
        real = lambda n: -(-max(n, min_tokens) // multiple) * multiple  # noqa: E731
        base = self(real(1))
        if multiple <= 1:
            points = [(1, 1.0)] + [(int(n), c / base) for n, c in zip(self.n, self.c) if n > min_tokens]
            return CostCurve(points + [(min_tokens, 1.0)])
        return CostCurve([(n, self(real(n)) / base) for n in range(1, int(self.n[-1]) + 1)])

    def __call__(self, n: int) -> float:
        if n <= self.n[-1]:
            return float(np.interp(n, self.n, self.c))
        slope = (self.c[-1] - self.c[-2]) / (self.n[-1] - self.n[-2])   # extrapolate the last piece
        return float(self.c[-1] + slope * (n - self.n[-1]))


PRIOR_ACCEPTED, PRIOR_REACHED = 1.0, 2.0   # an acceptance estimate starts at 0.5, worth two observations
DECAY = 0.95                                # per verified step: the estimate follows the last ~20 steps
EXPLORE_AFTER = 8                           # plain steps in a row before one probing draft of 1 token


def default_draft_cost(target_bytes: int | None, draft_bytes: int | None) -> float:
    """Draft cost per drafted token relative to a target decode, from weight bytes (memory-bound decode)."""
    if not target_bytes or not draft_bytes:
        return 0.15
    return draft_bytes / target_bytes


def step_rate(cost: CostCurve, draft_cost: float, acceptance, free: int = 0) -> float:
    """Expected tokens per unit of time of a step drafting len(acceptance) tokens; acceptance[j] is
    the chance position j is accepted given the earlier ones. free: leading drafted tokens that cost
    no drafting (the guess head's first guess comes with the target's call)."""
    length = len(acceptance)
    expected = 1.0 + float(np.cumprod(np.asarray(acceptance, dtype=np.float64)).sum())
    return expected / (cost(length + 1) + draft_cost * max(length - free, 0))


def best_length(cost: CostCurve, draft_cost: float, acceptance, free: int = 0) -> tuple[int, float]:
    """(length, rate): the prefix of `acceptance` worth drafting; length 0 (a plain step, rate 1)
    unless some length beats it. The shortest wins ties."""
    best, best_rate = 0, 1.0
    for length in range(1, len(acceptance) + 1):
        r = step_rate(cost, draft_cost, acceptance[:length], free)
        if r > best_rate * (1 + 1e-9):
            best, best_rate = length, r
    return best, best_rate


class AdaptiveLength:
    """Per-generation draft length for the draft model (k = 1): per-position acceptance estimates and
    the length with the most expected tokens per unit of predicted step time."""

    def __init__(self, cost: CostCurve, draft_cost: float, max_len: int):
        self.cost, self.draft_cost, self.max_len = cost, float(draft_cost), max_len
        self.accepted = np.full(max_len, PRIOR_ACCEPTED)
        self.reached = np.full(max_len, PRIOR_REACHED)
        self.plain_run = 0

    def rate(self, length: int) -> float:
        """Expected tokens per unit of time for a step drafting `length` tokens."""
        return step_rate(self.cost, self.draft_cost, self.accepted[:length] / self.reached[:length])

    def best(self, budget: int) -> tuple[int, float]:
        """(length, expected tokens per unit of time) of the best draft within `budget`; no side effects."""
        upto = min(self.max_len, budget)
        return best_length(self.cost, self.draft_cost, self.accepted[:upto] / self.reached[:upto])

    def choose(self, budget: int) -> int:
        best, _ = self.best(budget)
        if best == 0 and budget >= 1:
            self.plain_run += 1
            if self.plain_run >= EXPLORE_AFTER:   # keep learning: a cheap probe now and then
                self.plain_run = 0
                return 1
            return 0
        self.plain_run = 0
        return best

    def update(self, draft_len: int, accepted: int) -> None:
        self.accepted *= DECAY
        self.reached *= DECAY
        upto = min(accepted + 1, draft_len)
        self.reached[:upto] += 1
        self.accepted[:accepted] += 1
