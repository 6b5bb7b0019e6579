"""Token-level selection (spectr_edge.selection): analytic checks, exact laws, Monte Carlo.

docs/ALGORITHMS.md: residual >= 0, from-draft + (1 - beta)^k p_res == q, rho* minimal,
acceptance within the section 1 bounds; the output law is exactly q (enumerated and Monte
Carlo), and the naive rho = 1 rule for several candidates is caught (negative control).
"""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spectr_edge import selection
from spectr_edge.selection import (KSeqPlan, deterministic_select, kseq_residual, kseq_rho,
                                   kseq_select, plan_at_rho)


def normalise(weights):
    weights = np.asarray(weights, dtype=np.float64)
    return weights / weights.sum()


# -- direct float64 references --------------------------------------------------------------------

def f_of_rho(p, q, num_candidates, rho):
    """f(rho) = rho * beta(rho) - (1 - (1 - beta(rho))^k), straight from docs/ALGORITHMS.md"""
    beta = np.minimum(p, q / rho).sum()
    return rho * beta - (1 - (1 - beta) ** num_candidates)


def reference_rho(p, q, num_candidates):
    """Slow bisection over the full vectors: the smallest root of f on [1, k] (upper end)."""
    if num_candidates == 1 or f_of_rho(p, q, num_candidates, 1.0) >= -1e-12:
        return 1.0
    lo, hi = 1.0, float(num_candidates)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if f_of_rho(p, q, num_candidates, mid) >= 0 else (mid, hi)
    return hi


def assert_as_good_as_reference(plan, p, q, num_candidates):
    """Acceptance at least the slow bisection's, to 1e-12. (rho itself may differ where f is
    flat to ~1e-16, e.g. f = (1 - 1/rho)^k once rho exceeds every ratio q/p.)"""
    rho = reference_rho(p, q, num_candidates)
    reference_p_acc = 1 - (1 - np.minimum(p, q / rho).sum()) ** num_candidates
    assert plan.p_acc >= reference_p_acc - 1e-12


def from_draft(p, q, plan, num_candidates):
    """[V] P(Y = x and Y was a candidate) = min(p, q/rho) * p_acc / beta."""
    per_beta = plan.p_acc / plan.beta if plan.beta > 0 else num_candidates
    return np.minimum(p, q / plan.rho) * per_beta


def check_plan(p, q, num_candidates):
    """The section 7 analytic checks for one (p, q, k); returns the plan."""
    plan = kseq_rho(p, q, num_candidates)
    residual = kseq_residual(p, q, plan, num_candidates)
    beta_one = np.minimum(p, q).sum()                                # k = 1 acceptance
    upper = np.minimum(q, 1 - (1 - p) ** num_candidates).sum()       # cheap upper bound
    assert 1.0 <= plan.rho <= num_candidates
    assert plan.beta == pytest.approx(np.minimum(p, q / plan.rho).sum(), abs=1e-12)
    assert plan.p_acc == pytest.approx(1 - (1 - plan.beta) ** num_candidates, abs=1e-12)
    assert plan.p_acc <= plan.rho * plan.beta + 1e-12                # valid: residual >= 0
    assert np.all(residual >= 0) and residual.sum() == pytest.approx(1.0)
    np.testing.assert_allclose(from_draft(p, q, plan, num_candidates)
                               + (1 - plan.beta) ** num_candidates * residual, q, atol=1e-9)
    assert beta_one - 2e-12 <= plan.p_acc <= upper + 2e-12   # VALIDITY_TOL (1e-12) + renormalisation rounding
    return plan


def exact_law(p, q, num_candidates, plan, residual):
    """[V] P(kseq_select returns y), by enumerating every candidate tuple (tiny V only)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        accept = np.where(q > 0, np.minimum(1.0, q / (plan.rho * p)), 0.0)   # [V] P(accept | X = x)
    law = np.zeros_like(q)
    for tup in itertools.product(np.flatnonzero(p > 0), repeat=num_candidates):
        weight = np.prod(p[list(tup)])                               # P(X_1..X_k = tup)
        for x in tup:                                                # try them in order
            law[x] += weight * accept[x]
            weight *= 1 - accept[x]
        law += weight * residual                                     # none accepted
    return law


# -- hand-built distributions ---------------------------------------------------------------------

HAND_BUILT = {
    # name: (draft p, target q)
    "close": ([0.30, 0.30, 0.20, 0.20], [0.25, 0.35, 0.20, 0.20]),
    "far": ([0.70, 0.10, 0.10, 0.10], [0.05, 0.15, 0.30, 0.50]),
    "draft misses target mass": ([0.50, 0.50, 0.00, 0.00], [0.40, 0.20, 0.30, 0.10]),
    "target never emits drafted token": ([0.10, 0.20, 0.30, 0.40], [0.50, 0.50, 0.00, 0.00]),
    "target peaked, draft flat": ([0.25, 0.25, 0.25, 0.25], [0.97, 0.01, 0.01, 0.01]),
    "draft peaked, target flat": ([0.97, 0.01, 0.01, 0.01], [0.25, 0.25, 0.25, 0.25]),
    "one-hot draft": ([0.00, 1.00, 0.00, 0.00], [0.30, 0.40, 0.20, 0.10]),
    "one-hot target": ([0.40, 0.30, 0.20, 0.10], [0.00, 0.00, 1.00, 0.00]),
    "disjoint supports": ([0.60, 0.40, 0.00, 0.00], [0.00, 0.00, 0.50, 0.50]),
    "equal": ([0.10, 0.20, 0.30, 0.40], [0.10, 0.20, 0.30, 0.40]),
}


@pytest.mark.parametrize("name", HAND_BUILT)
@pytest.mark.parametrize("num_candidates", [1, 2, 3, 5, 8])
def test_hand_built_plans(name, num_candidates):
    p, q = map(normalise, HAND_BUILT[name])
    plan = check_plan(p, q, num_candidates)
    assert plan.rho == pytest.approx(reference_rho(p, q, num_candidates), rel=1e-9)
    assert_as_good_as_reference(plan, p, q, num_candidates)


@pytest.mark.parametrize("name", HAND_BUILT)
@pytest.mark.parametrize("num_candidates", [1, 2, 3])
def test_exact_law_is_target(name, num_candidates):
    p, q = map(normalise, HAND_BUILT[name])
    plan = kseq_rho(p, q, num_candidates)
    law = exact_law(p, q, num_candidates, plan, kseq_residual(p, q, plan, num_candidates))
    np.testing.assert_allclose(law, q, atol=1e-12)


def test_one_candidate_is_standard_speculative_sampling():
    # accept x w.p. min(1, q/p), residual norm(max(q - p, 0)), acceptance sum min(p, q)
    p = normalise([0.5, 0.2, 0.2, 0.1, 0.0])
    q = normalise([0.1, 0.4, 0.2, 0.0, 0.3])
    plan = kseq_rho(p, q, 1)
    assert plan == KSeqPlan(rho=1.0, beta=pytest.approx(0.5), p_acc=pytest.approx(0.5))
    np.testing.assert_allclose(kseq_residual(p, q, plan, 1), [0, 0.4, 0, 0, 0.6], atol=1e-15)
    law = exact_law(p, q, 1, plan, kseq_residual(p, q, plan, 1))
    np.testing.assert_allclose(law, q, atol=1e-15)


def test_equal_distributions_accept_always():
    # p == q: rho = 1, beta = 1, every first candidate is accepted
    p = normalise([0.1, 0.2, 0.3, 0.4])
    for num_candidates in (1, 2, 4):
        plan = kseq_rho(p, p, num_candidates)
        assert plan.rho == 1.0 and plan.beta == pytest.approx(1.0) and plan.p_acc == pytest.approx(1.0)
        np.testing.assert_array_equal(kseq_residual(p, p, plan, num_candidates), p)   # ~0 mass -> q
    rng = np.random.default_rng(0)
    assert all(kseq_select([3, 1], p, p, rng) == (3, 0) for _ in range(100))


def test_disjoint_supports_never_accept():
    # no candidate can be accepted; the residual is q itself
    p, q = normalise([0.6, 0.4, 0, 0]), normalise([0, 0, 0.5, 0.5])
    plan = kseq_rho(p, q, 4)
    assert (plan.rho, plan.beta, plan.p_acc) == (1.0, 0.0, 0.0)
    np.testing.assert_array_equal(kseq_residual(p, q, plan, 4), q)
    rng = np.random.default_rng(0)
    for _ in range(200):
        token, index = kseq_select([0, 1, 1, 0], p, q, rng)
        assert index is None and token in (2, 3)


def test_rho_is_minimal():
    # far apart: rho* > 1 and f is negative just below it
    p, q = map(normalise, HAND_BUILT["far"])
    for num_candidates in (2, 4, 8):
        rho = kseq_rho(p, q, num_candidates).rho
        assert rho > 1
        assert f_of_rho(p, q, num_candidates, rho * (1 - 1e-9)) < 0 <= f_of_rho(p, q, num_candidates, rho)


def test_more_candidates_accept_more():
    p, q = map(normalise, HAND_BUILT["far"])
    acceptance = [kseq_rho(p, q, n).p_acc for n in range(1, 9)]
    assert all(a < b for a, b in zip(acceptance, acceptance[1:]))


def test_unnormalised_float32_inputs():
    # float32 softmax rows do not sum exactly to 1; both are renormalised the same way
    p = np.array([0.3, 0.3, 0.2, 0.2000001], dtype=np.float32)
    q = np.array([0.05, 0.15, 0.3, 0.4999999], dtype=np.float32)
    plan = check_plan(normalise(p), normalise(q), 3)
    assert kseq_rho(p, q, 3).rho == pytest.approx(plan.rho, rel=1e-12)


def test_zero_probability_candidate_is_never_emitted():
    # a candidate the target never emits (q = 0), even with p = 0 for it (cannot happen; guarded)
    p, q = normalise([0.5, 0.5, 0.0]), normalise([0.5, 0.0, 0.5])
    rng = np.random.default_rng(1)
    for candidates in ([1, 1], [2, 1], [1]):
        for _ in range(300):
            token, index = kseq_select(candidates, p, q, rng)
            assert q[token] > 0 and (index is None or candidates[index] == token)


def test_invalid_root_falls_back_to_num_candidates(monkeypatch):
    # if the fast root finder were wrong (here: returns 1), the full-vector check catches it
    monkeypatch.setattr(selection, "_smallest_root", lambda p, q, num_candidates: 1.0)
    p, q = map(normalise, HAND_BUILT["far"])
    plan = kseq_rho(p, q, 4)
    assert plan.rho == 4.0 and plan.p_acc <= plan.rho * plan.beta


# -- property tests -------------------------------------------------------------------------------

@st.composite
def integer_distributions(draw, max_size=10):
    """(p, q, k) from small integer weights: sparse supports, ties, exact zeros."""
    size = draw(st.integers(2, max_size))
    weights = st.lists(st.integers(0, 20), min_size=size, max_size=size).filter(lambda w: sum(w) > 0)
    return normalise(draw(weights)), normalise(draw(weights)), draw(st.integers(1, 8))


@st.composite
def mixed_scale_distributions(draw):
    """(p, q, k) with entries spanning 1e-12..1: tails, near-one masses."""
    size = draw(st.integers(2, 12))
    values = st.sampled_from([0.0, 1e-12, 1e-6, 1e-3, 0.05, 0.3, 1.0, 5.0])
    weights = st.lists(values, min_size=size, max_size=size).filter(lambda w: sum(w) > 0)
    return normalise(draw(weights)), normalise(draw(weights)), draw(st.integers(1, 16))


@settings(max_examples=300, deadline=None)
@given(integer_distributions())
def test_property_plan_valid_and_minimal(case):
    p, q, num_candidates = case
    plan = check_plan(p, q, num_candidates)
    if plan.rho > 1 + 1e-6:                                          # minimal: f < 0 just below rho*
        assert f_of_rho(p, q, num_candidates, plan.rho - 1e-6) < 0
    assert_as_good_as_reference(plan, p, q, num_candidates)


@settings(max_examples=300, deadline=None)
@given(mixed_scale_distributions())
def test_property_plan_valid_mixed_scales(case):
    check_plan(*case)


@settings(max_examples=100, deadline=None)
@given(integer_distributions(max_size=5).filter(lambda case: case[2] <= 3))
def test_property_exact_law_is_target(case):
    p, q, num_candidates = case
    plan = kseq_rho(p, q, num_candidates)
    law = exact_law(p, q, num_candidates, plan, kseq_residual(p, q, plan, num_candidates))
    np.testing.assert_allclose(law, q, atol=1e-12)


# -- large vocabularies (the histogram path of the root finder) ----------------------------------

@pytest.mark.parametrize("vocab, noise, num_candidates", [
    (20_000, 0.5, 2), (20_000, 1.0, 4), (50_000, 2.0, 8), (3_000, 0.05, 3), (20_000, 3.0, 16),
])
def test_large_vocab_matches_full_bisection(vocab, noise, num_candidates, monkeypatch):
    histogram_levels = []                                  # the O(V) path really runs
    narrow = selection._narrow
    monkeypatch.setattr(selection, "_narrow", lambda *args: histogram_levels.append(1) or narrow(*args))
    rng = np.random.default_rng(vocab + num_candidates)
    logits = rng.standard_normal(vocab) * 2
    logits[rng.choice(vocab, 20, replace=False)] += rng.uniform(6, 12, 20)     # a few strong tokens
    q = normalise(np.exp(logits - logits.max()))
    p = normalise(np.exp(logits + rng.standard_normal(vocab) * noise - logits.max()))
    plan = check_plan(p, q, num_candidates)
    assert plan.rho == pytest.approx(reference_rho(p, q, num_candidates), rel=1e-9)
    assert_as_good_as_reference(plan, p, q, num_candidates)
    assert histogram_levels


def test_large_vocab_sparse_supports():
    # a top-k draft (50 ids with mass) against a top-p-like target (the 3000 largest ids):
    # most ratios are 0/0, q/0 = inf or 0/p
    rng = np.random.default_rng(11)
    logits = rng.standard_normal(60_000) * 2
    logits[rng.choice(60_000, 20, replace=False)] += rng.uniform(6, 12, 20)
    draft_logits = logits + rng.standard_normal(60_000) * 0.7
    p = np.where(draft_logits >= np.sort(draft_logits)[-50], np.exp(draft_logits - draft_logits.max()), 0)
    q = np.where(logits >= np.sort(logits)[-3000], np.exp(logits - logits.max()), 0)
    p, q = normalise(p), normalise(q)
    for num_candidates in (2, 4, 8):
        plan = check_plan(p, q, num_candidates)
        assert plan.rho == pytest.approx(reference_rho(p, q, num_candidates), rel=1e-9)
        assert_as_good_as_reference(plan, p, q, num_candidates)


def test_large_vocab_with_clustered_ratios():
    # the tail has p proportional to q: 29950 ids share one ratio q/p ~ 2.4, inside [1, k),
    # so no histogram level can split them; the head differs
    rng = np.random.default_rng(5)
    q = rng.random(30_000) ** 8
    p = q.copy()
    p[:50], q[:50] = rng.random(50) * 200, rng.random(50) * 3
    p, q = normalise(p), normalise(q)
    tail_ratio = q[-1] / p[-1]
    for num_candidates in (3, 5):
        assert 1 < tail_ratio < num_candidates
        plan = check_plan(p, q, num_candidates)
        assert plan.rho == pytest.approx(reference_rho(p, q, num_candidates), rel=1e-9)
        assert_as_good_as_reference(plan, p, q, num_candidates)


@pytest.mark.parametrize("num_candidates, min_levels", [(2, 2), (4, 1), (8, 1)])
def test_large_vocab_nearly_equal(num_candidates, min_levels, monkeypatch):
    # p = q up to 0.1% noise on 200000 ids: thousands of ratios share the root's bin, so
    # (for k = 2) the histogram has to zoom in a second time
    histogram_levels = []
    narrow = selection._narrow
    monkeypatch.setattr(selection, "_narrow", lambda *args: histogram_levels.append(1) or narrow(*args))
    rng = np.random.default_rng(3)
    q = normalise(rng.random(200_000) ** 4)
    p = normalise(q * np.exp(rng.standard_normal(200_000) * 1e-3))
    plan = check_plan(p, q, num_candidates)
    assert_as_good_as_reference(plan, p, q, num_candidates)    # k = 8: f ~ 1e-19 near rho*
    assert len(histogram_levels) >= min_levels


# -- Monte Carlo: kseq_select's output law is q, and rho = 1 is caught --------------------------

MC_DRAFT = normalise([0.10, 0.20, 0.30, 0.25, 0.15])     # drafts a token the target never emits
MC_TARGET = normalise([0.40, 0.30, 0.20, 0.10, 0.00])    # and under-drafts its top token
MC_DRAWS = 100_000
CHI2_LIMIT = 35.0     # 4 degrees of freedom (ids 0..3); P(chi2_4 > 35) ~ 5e-7


def chi_square(counts, probs):
    support = probs > 0
    expected = probs[support] * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(counts[~support].sum())


def monte_carlo_counts(num_candidates, seed):
    """[V] counts of kseq_select outputs over MC_DRAWS fresh candidate sets."""
    rng = np.random.default_rng(seed)
    candidates = rng.choice(MC_DRAFT.size, size=(MC_DRAWS, num_candidates), p=MC_DRAFT)   # [N, k]
    counts = np.zeros(MC_DRAFT.size, dtype=np.int64)
    for row in candidates:
        counts[kseq_select(row, MC_DRAFT, MC_TARGET, rng)[0]] += 1
    return counts


@pytest.mark.parametrize("num_candidates", [1, 2, 4])
def test_monte_carlo_law_is_target(num_candidates):
    chi2, impossible = chi_square(monte_carlo_counts(num_candidates, seed=100 + num_candidates), MC_TARGET)
    assert impossible == 0 and chi2 < CHI2_LIMIT


def force_rho_one(monkeypatch):
    monkeypatch.setattr(selection, "kseq_rho",
                        lambda draft_probs, target_probs, num_candidates:
                        plan_at_rho(draft_probs, target_probs, num_candidates, 1.0))


def test_negative_control_rho_one_is_not_exact(monkeypatch):
    # naive multi-draft (rho = 1, k = 4) breaks the law; exact enumeration says by how much,
    # and the Monte Carlo check above must notice
    force_rho_one(monkeypatch)
    plan = selection.kseq_rho(MC_DRAFT, MC_TARGET, 4)
    law = exact_law(MC_DRAFT, MC_TARGET, 4, plan, kseq_residual(MC_DRAFT, MC_TARGET, plan, 4))
    assert 0.5 * np.abs(law - MC_TARGET).sum() > 0.05               # total variation
    chi2, _ = chi_square(monte_carlo_counts(4, seed=104), MC_TARGET)
    assert chi2 > 10 * CHI2_LIMIT


# -- deterministic (one-hot) drafts ---------------------------------------------------------------

def test_deterministic_select_law_is_target():
    # 1e5 draws with candidate 1 (q = 0.3): accept rate within 6 sigma of 0.3, law chi-square
    q = normalise([0.4, 0.3, 0.2, 0.1, 0.0])
    rng = np.random.default_rng(7)
    outcomes = [deterministic_select(1, q, rng) for _ in range(MC_DRAWS)]
    counts = np.bincount([token for token, _ in outcomes], minlength=5)
    accepted = sum(ok for _, ok in outcomes)
    assert abs(accepted - 0.3 * MC_DRAWS) < 6 * np.sqrt(MC_DRAWS * 0.3 * 0.7)
    assert all(token == 1 for token, ok in outcomes if ok)
    chi2, impossible = chi_square(counts, q)
    assert impossible == 0 and chi2 < CHI2_LIMIT


def test_deterministic_select_edges():
    rng = np.random.default_rng(3)
    q = normalise([0.0, 1.0, 0.0])
    assert all(deterministic_select(1, q, rng) == (1, True) for _ in range(100))   # q(x) = 1
    q = normalise([0.5, 0.0, 0.5])
    for _ in range(200):                                            # q(x) = 0: never emitted
        token, accepted = deterministic_select(1, q, rng)
        assert not accepted and token in (0, 2)
