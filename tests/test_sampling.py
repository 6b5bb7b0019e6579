"""Logits processing and sampling (spectr_edge.sampling): hand-built rows, an HF reference, Monte Carlo."""

import numpy as np
import pytest

from spectr_edge import sampling
from spectr_edge.sampling import SamplingParams, greedy_token, logits_to_probs, mask_padding, sample

NEG_INF = -np.inf


# -- slow, obviously-correct references (HF transformers' warpers, one row, float64) -------------

def softmax(logits):
    shifted = np.exp(logits - np.max(logits))
    return shifted / shifted.sum()


def hf_top_k(scores, top_k):
    """TopKLogitsWarper: remove scores < the top_k-th largest (ties with it survive)."""
    top_k = min(top_k, scores.size)
    kth = np.sort(scores)[::-1][top_k - 1]
    return np.where(scores < kth, NEG_INF, scores)


def hf_top_p(scores, top_p):
    """TopPLogitsWarper: sort ascending, remove cumulative prob <= 1 - top_p, keep the last."""
    order = np.argsort(scores, kind="stable")
    cumulative = np.cumsum(softmax(scores[order]))
    remove_sorted = cumulative <= 1 - top_p
    remove_sorted[-1] = False
    remove = np.empty_like(remove_sorted)
    remove[order] = remove_sorted
    return np.where(remove, NEG_INF, scores)


def reference_probs(logits, params, vocab_size):
    scores = np.asarray(logits, dtype=np.float64)[:vocab_size] / params.temperature
    if params.top_k > 0:
        scores = hf_top_k(scores, params.top_k)
    if params.top_p < 1.0:
        scores = hf_top_p(scores, params.top_p)
    return np.concatenate([softmax(scores), np.zeros(len(logits) - vocab_size)])


# -- padding and greedy -------------------------------------------------------------------------

def test_padding_ids_never_get_mass():
    # width 6, vocab 4: the two padding ids carry the largest logits and must still get 0
    logits = np.array([1.0, 2.0, 0.5, -1.0, 50.0, 60.0], dtype=np.float32)
    probs = logits_to_probs(logits, SamplingParams(temperature=0.7, top_k=3, top_p=0.9), vocab_size=4)
    assert probs.shape == (6,) and probs.dtype == np.float32
    assert np.all(probs[4:] == 0)
    assert probs.sum() == pytest.approx(1.0, abs=1e-6)
    assert greedy_token(logits, vocab_size=4) == 1


def test_mask_padding_returns_a_new_array():
    logits = np.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]], dtype=np.float32)
    masked = mask_padding(logits, vocab_size=2)
    assert np.array_equal(masked, [[1.0, 2.0, NEG_INF], [3.0, 2.0, NEG_INF]])
    assert np.array_equal(logits, [[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])   # caller's array untouched


def test_greedy_takes_first_max_on_ties():
    rows = np.array([
        [1.0, 3.0, 3.0, 2.0, 9.0],    # ids 1 and 2 tie; id 4 is padding -> 1
        [5.0, 5.0, 5.0, 5.0, 5.0],    # all tie -> 0
        [0.0, 0.0, 0.0, 7.0, 0.0],    # unique max -> 3
    ], dtype=np.float32)
    assert greedy_token(rows[0], vocab_size=4) == 1
    assert isinstance(greedy_token(rows[0], vocab_size=4), int)
    assert greedy_token(rows, vocab_size=4).tolist() == [1, 0, 3]


def test_temperature_zero_is_rejected():
    with pytest.raises(ValueError):
        logits_to_probs(np.zeros(4, dtype=np.float32), SamplingParams(temperature=0.0), vocab_size=4)
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams().greedy


# -- temperature, top-k, top-p ------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_scales_logits(temperature):
    # softmax(logits / T), checked in float64
    logits = np.array([2.0, 1.0, 0.0, -3.0, 4.5], dtype=np.float32)
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature), vocab_size=5)
    np.testing.assert_allclose(probs, softmax(logits.astype(np.float64) / temperature), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("top_k, kept", [
    (1, [0]),              # unique max
    (2, [0, 2, 3]),        # 2nd largest is 2.0, tied by ids 2 and 3: both kept
    (3, [0, 2, 3]),        # 3rd largest is also 2.0
    (4, [0, 1, 2, 3]),     # 4th largest is 1.0
    (5, [0, 1, 2, 3, 4]),  # everything
    (99, [0, 1, 2, 3, 4]),  # more than the vocabulary: off
])
def test_top_k_keeps_ties(top_k, kept):
    logits = np.array([3.0, 1.0, 2.0, 2.0, 0.0, 8.0], dtype=np.float32)   # id 5 is padding
    probs = logits_to_probs(logits, SamplingParams(top_k=top_k), vocab_size=5)
    assert np.flatnonzero(probs).tolist() == kept
    np.testing.assert_allclose(probs, reference_probs(logits, SamplingParams(top_k=top_k), 5), rtol=1e-6)


@pytest.mark.parametrize("top_p, kept", [
    (0.0, [0]),            # nothing is "< 0": the largest is always kept
    (0.5, [0]),            # mass above id 0 is 0 < 0.5; above id 1 is 0.6 >= 0.5
    (0.59, [0]),           # mass above id 1 is 0.6, not < 0.59 (HF: its ascending cum 0.4 <= 0.41)
    (0.61, [0, 1]),
    (0.95, [0, 1, 2]),     # masses above: 0, 0.6, 0.9 -> ids 0..2
    (0.999, [0, 1, 2, 3]),
])
def test_top_p_hand_built(top_p, kept):
    # probabilities 0.6, 0.3, 0.08, 0.02 as logits
    logits = np.log(np.array([0.6, 0.3, 0.08, 0.02])).astype(np.float32)
    probs = logits_to_probs(logits, SamplingParams(top_p=top_p), vocab_size=4)
    assert np.flatnonzero(probs).tolist() == kept


def test_top_p_keeps_ties_with_the_last_kept_logit():
    # ids 1 and 2 tie at 0.25 each; mass above the first of them is 0.5 < 0.6, so one is kept
    # and, to be independent of sort order, so is its twin
    logits = np.log(np.array([0.5, 0.25, 0.25])).astype(np.float32)
    probs = logits_to_probs(logits, SamplingParams(top_p=0.6), vocab_size=3)
    assert np.flatnonzero(probs).tolist() == [0, 1, 2]


def top_1024_mass(logits, temperature):
    probs = softmax(logits.astype(np.float64) / temperature)
    return np.sort(probs)[::-1][:sampling.TOP_P_CANDIDATES].sum()


@pytest.mark.parametrize("scale, vocab_size, temperature, top_k, top_p", [
    (6.0, 5000, 1.0, 0, 0.9),     # peaked: the first 1024 candidates suffice
    (6.0, 5000, 0.7, 40, 0.8),    # top-k then top-p
    (3.0, 3000, 1.3, 0, 0.5),
    (0.1, 5000, 1.0, 0, 0.9),     # nearly flat: the top 1024 hold ~20%, falls back to more
    (0.3, 40000, 1.0, 0, 0.97),   # flat and wide: 1024 -> 16384 -> all
    (0.1, 5000, 1.0, 2000, 0.7),  # top-k wider than the first candidate set
])
def test_matches_hf_reference_on_random_logits(scale, vocab_size, temperature, top_k, top_p):
    rng = np.random.default_rng(1234)
    params = SamplingParams(temperature, top_k, top_p)
    for _ in range(5):
        logits = (rng.standard_normal(vocab_size + 7) * scale).astype(np.float32)   # 7 padding ids
        expected = reference_probs(logits, params, vocab_size)
        probs = logits_to_probs(logits, params, vocab_size)
        assert np.array_equal(np.flatnonzero(probs), np.flatnonzero(expected))
        np.testing.assert_allclose(probs, expected, rtol=2e-5, atol=1e-9)


def test_fallback_cases_really_fall_back():
    # documents that the flat cases above exercise the path beyond the first 1024 candidates
    rng = np.random.default_rng(1234)
    assert top_1024_mass((rng.standard_normal(5007) * 0.1)[:5000], 1.0) < 0.9
    assert top_1024_mass((rng.standard_normal(40007) * 0.3)[:40000], 1.0) < 0.97


def test_rows_are_processed_independently():
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((2, 3, 50)).astype(np.float32)   # [2, 3, W]
    params = SamplingParams(0.9, 10, 0.8)
    probs = logits_to_probs(logits, params, vocab_size=45)
    assert probs.shape == (2, 3, 50)
    for index in np.ndindex(2, 3):
        np.testing.assert_array_equal(probs[index], logits_to_probs(logits[index], params, 45))


# -- sample -------------------------------------------------------------------------------------

def test_sample_never_returns_zero_probability_ids():
    rng = np.random.default_rng(0)
    cases = [
        np.array([0.0, 0.0, 1.0, 0.0]),                # one id
        np.array([0.5, 0.0, 0.0, 0.5, 0.0, 0.0]),      # trailing zeros (cdf rounding target)
        np.array([1e-30, 0.0, 1.0 - 1e-16, 0.0]),      # a denormal-scale id and a near-1 id
        np.full(3000, 1 / 3000) * (np.arange(3000) % 7 == 0),   # spans several blocks, sparse
    ]
    for probs in cases:
        draws = sample(np.tile(probs, (2000, 1)), rng)           # [2000]
        assert np.all(probs[draws] > 0)
        assert all(probs[sample(probs, rng)] > 0 for _ in range(200))


def test_sample_clips_a_rounded_up_target_to_the_last_positive_id():
    class AlmostOne:   # a generator whose uniform is the largest double below 1
        def random(self, size=None):
            u = np.nextafter(1.0, 0.0)
            return u if size is None else np.full(size, u)
    probs = np.array([0.1, 0.2, 0.7, 0.0, 0.0], dtype=np.float32)
    assert sample(probs, AlmostOne()) == 2
    wide = np.zeros(5000, dtype=np.float32)
    wide[[3, 1500]] = [0.25, 0.75]
    assert sample(wide, AlmostOne()) == 1500


def test_sample_shapes():
    rng = np.random.default_rng(0)
    probs = np.full((4, 3, 10), 0.1)
    assert isinstance(sample(probs[0, 0], rng), int)
    draws = sample(probs, rng)
    assert draws.shape == (4, 3) and draws.dtype == np.int64


def chi_square(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_sample_follows_the_law():
    # 2e5 draws over 6 cells (5 degrees of freedom); P(chi2_5 > 30) ~ 1.5e-5
    rng = np.random.default_rng(2024)
    probs = np.array([0.05, 0.3, 0.0, 0.15, 0.4, 0.1], dtype=np.float32) / np.float32(1.0000001)
    draws = sample(np.tile(probs, (200_000, 1)), rng)
    counts = np.bincount(draws, minlength=6)
    assert counts[2] == 0
    support = probs > 0
    assert chi_square(counts[support], probs[support].astype(np.float64) / probs.sum()) < 30


def test_sample_follows_the_law_across_blocks():
    # 2e4 single-row draws over a 3000-wide row (several blocks), 5 coarse cells; P(chi2_4 > 30) ~ 5e-6
    rng = np.random.default_rng(99)
    probs = rng.random(3000) ** 4
    probs /= probs.sum()
    cells = np.arange(3000) // 600                         # [3000] -> 5 cells of 600 ids
    draws = np.array([sample(probs, rng) for _ in range(20_000)])
    counts = np.bincount(cells[draws], minlength=5)
    assert chi_square(counts, np.bincount(cells, weights=probs)) < 30
