"""Draft-length rules (spectr_edge/policy.py) and `spectr-edge tune` (spectr_edge/tune.py).

The rules' arithmetic is checked on hand-set acceptance counts; the engine's output law with
adaptive lengths is in test_montecarlo.py. tune is run for real on a toy bundle: its timings
are not asserted (ground rule 3), only what it writes and that the bundle still generates."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spectr_edge.policy import EXPLORE_AFTER, AdaptiveLength, CostCurve, default_draft_cost
from toy_lm import build_toy_bundle

FP32 = CostCurve.for_quant("none")


def _set(policy: AdaptiveLength, acceptance: float) -> None:
    policy.reached[:] = 100.0
    policy.accepted[:] = 100.0 * acceptance


def test_length_maximises_expected_tokens_per_cost():
    policy = AdaptiveLength(FP32, draft_cost=0.13, max_len=8)
    _set(policy, 0.68)
    best = policy.choose(8)
    # by hand: E(L) = sum_{j<=L} 0.68^j over c(L + 1) + 0.13 L; L = 3 gives 2.456832 / 1.66 = 1.48
    assert best == 3 and policy.rate(3) == pytest.approx(2.456832 / (1.27 + 0.39), rel=1e-6)
    assert all(policy.rate(best) >= policy.rate(L) for L in range(1, 9))
    assert policy.choose(2) == 2                         # the budget caps it


def test_no_draft_when_it_cannot_pay_but_a_probe_now_and_then():
    policy = AdaptiveLength(CostCurve.for_quant("int4"), draft_cost=0.46, max_len=6)
    _set(policy, 0.3)
    choices = [policy.choose(6) for _ in range(2 * EXPLORE_AFTER)]
    assert choices.count(1) == 2 and set(choices) == {0, 1}   # plain steps, one 1-token probe every 8
    _set(policy, 0.98)
    assert policy.choose(6) >= 2                          # a draft that is nearly always right pays even here


def test_update_counts_reached_positions_and_decays():
    policy = AdaptiveLength(FP32, draft_cost=0.1, max_len=4)
    policy.update(4, 1)                                   # position 1 accepted, position 2 rejected
    assert policy.reached.tolist() == pytest.approx([0.95 * 2 + 1, 0.95 * 2 + 1, 0.95 * 2, 0.95 * 2])
    assert policy.accepted.tolist() == pytest.approx([0.95 + 1, 0.95, 0.95, 0.95])


def test_default_draft_cost_is_the_weight_ratio():
    assert default_draft_cost(6_000, 780) == pytest.approx(0.13)
    assert default_draft_cost(None, 10) == 0.15


CLI = [sys.executable, "-m", "spectr_edge.cli"]


def test_tune_writes_costs_that_generate_uses(tmp_path):
    bundle = build_toy_bundle(tmp_path / "b", seed_target=41, seed_draft=42)
    before = (bundle / "spectr.json").read_text()
    dry = subprocess.run(CLI + ["tune", "--bundle", str(bundle), "--provider", "cpu", "--repeats", "2", "--dry-run"],
                         capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr
    assert "draft model" in dry.stdout and "prompt lookup" in dry.stdout
    assert (bundle / "spectr.json").read_text() == before
    res = subprocess.run(CLI + ["tune", "--bundle", str(bundle), "--provider", "cpu", "--repeats", "2"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    m = json.loads((bundle / "spectr.json").read_text())
    curve = m["models"]["target"]["cost_curve"]
    assert [n for n, _ in curve] == [1, 2, 3, 4, 6, 8, 12, 16] and curve[0][1] == 1.0
    assert all(b >= a for (_, a), (_, b) in zip(curve, curve[1:]))       # non-decreasing by construction
    assert m["models"]["draft"]["decode_cost"] > 0 and m["tuning"]["provider"] == "CPU"
    assert not list(bundle.glob(".spectr.json.*"))                        # no temporary left behind
    info = subprocess.run(CLI + ["info", "--bundle", str(bundle)], capture_output=True, text=True, timeout=120)
    assert "tuned 20" in info.stdout
    import spectr_edge
    gen = spectr_edge.load(bundle, provider="cpu", threads=1)
    assert gen.engine.draft_cost == m["models"]["draft"]["decode_cost"]
    plain = gen.generate_ids([1, 2, 3], max_new_tokens=12, num_candidates=0).token_ids
    assert gen.generate_ids([1, 2, 3], max_new_tokens=12, adaptive=True, num_candidates=1).token_ids == plain
    bad = subprocess.run(CLI + ["tune", "--bundle", str(bundle), "--repeats", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--repeats" in bad.stderr and "Traceback" not in bad.stderr


def test_cost_curve_floored_for_padded_calls():
    from spectr_edge.policy import CostCurve

    curve = CostCurve([(1, 1.0), (2, 1.25), (4, 2.0), (8, 3.5)])
    assert curve.floored(1) is curve
    padded = curve.floored(2)          # a 1-token call costs what a 2-token call costs: the new unit
    assert padded(1) == padded(2) == 1.0
    assert padded(4) == pytest.approx(2.0 / 1.25) and padded(8) == pytest.approx(3.5 / 1.25)
    assert padded(16) == pytest.approx((3.5 + 8 * 0.375) / 1.25)      # extrapolated like the original
    even = curve.floored(2, 2)         # odd calls are padded to the next even count too
    assert even(1) == even(2) == 1.0 and even(3) == even(4) == pytest.approx(2.0 / 1.25)
    assert even(5) == even(6) == pytest.approx(2.75 / 1.25) and even(8) == pytest.approx(3.5 / 1.25)


# -- tune chooses the decoding defaults; generate uses them for options left unset ------------------
def test_tune_chooses_defaults_end_to_end(tiny_qwen_bundle, tmp_path):
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(tiny_qwen_bundle, bundle)
    res = subprocess.run(CLI + ["tune", "--bundle", str(bundle), "--provider", "cpu", "--repeats", "1",
                                "--calibration-tokens", "16"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "greedy: chose" in res.stdout and "sampling: chose" in res.stdout
    m = json.loads((bundle / "spectr.json").read_text())
    assert set(m["defaults"]) == {"greedy", "sampling"}
    assert [k for k, _ in m["models"]["draft"]["decode_rows_curve"]] == [1, 2, 4]
    for regime, choice in m["tuning"]["choice"].items():
        rows = choice["candidates"]
        # target-only is always a candidate at exactly 1.00x, and the best measured speedup wins
        assert {"policy": "target only", "predicted": 1.0, "measured": 1.0} == \
            {k: rows[0][k] for k in ("policy", "predicted", "measured")}
        assert choice["policy"] == max(rows, key=lambda r: r["measured"])["policy"]
        assert any(r["policy"] == "prompt lookup" for r in rows) and len(rows) >= 6
    info = subprocess.run(CLI + ["info", "--bundle", str(bundle)], capture_output=True, text=True, timeout=120)
    assert "default when greedy:" in info.stdout and "default when sampling:" in info.stdout
    import spectr_edge
    gen = spectr_edge.load(bundle, provider="cpu", threads=1)
    plain = gen.generate_ids([5, 6, 7, 8], max_new_tokens=24, num_candidates=0).token_ids
    assert gen.generate_ids([5, 6, 7, 8], max_new_tokens=24).token_ids == plain     # the tuned greedy default


def _with_defaults(src, dst, defaults):
    import shutil

    shutil.copytree(src, dst)
    m = json.loads((dst / "spectr.json").read_text())
    m["defaults"] = defaults
    (dst / "spectr.json").write_text(json.dumps(m))
    return dst


def test_generate_uses_tuned_defaults_unless_options_are_given(tiny_qwen_bundle, tmp_path):
    import spectr_edge

    bundle = _with_defaults(tiny_qwen_bundle, tmp_path / "b", {
        "greedy": {"drafter": "lookup", "num_candidates": 1},
        "sampling": {"drafter": "model", "num_candidates": 2, "draft_len": 2, "draft_stop": 0.0, "adaptive": False}})
    gen = spectr_edge.load(bundle, provider="cpu", threads=1)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    st = gen.generate_ids(prompt, max_new_tokens=24).stats                  # greedy: the tuned prompt lookup
    assert st.draft_calls == 0 and st.steps > 0 and st.num_candidates == 1
    st = gen.generate_ids(prompt, max_new_tokens=24, drafter="model").stats  # another drafter: built-in defaults
    assert st.draft_calls > 0 and st.lookup_steps == 0
    st = gen.generate_ids(prompt, max_new_tokens=24, num_candidates=0).stats
    assert st.num_candidates == 0 and st.steps == 0                          # an explicit option always wins
    st = gen.generate_ids(prompt, max_new_tokens=24, temperature=1.0, seed=3).stats   # sampling: k=2 L=2
    assert (st.num_candidates, st.draft_len) == (2, 2)
    st = gen.generate_ids(prompt, max_new_tokens=24, temperature=1.0, seed=3, draft_len=4).stats
    assert (st.num_candidates, st.draft_len) == (1, 4)    # any option set replaces the tuned policy as a whole
    # the CLI does not even load the draft when the tuned greedy default needs none
    res = subprocess.run(CLI + ["generate", "hello", "--bundle", str(bundle), "--provider", "cpu", "-n", "8",
                                "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["stats"]["draft_calls"] == 0 and out["stats"]["num_candidates"] == 1
    # a tuned lookup trie (several copied candidates) keeps its k
    trie = spectr_edge.load(_with_defaults(tiny_qwen_bundle, tmp_path / "t", {"greedy": {"drafter": "lookup",
                                                                                       "lookup_candidates": 4}}),
                            provider="cpu", threads=1)
    assert trie.target.takes_tree
    res = trie.generate_ids(prompt, max_new_tokens=24)
    assert res.stats.num_candidates == 4 and res.stats.draft_calls == 0
    assert res.token_ids == trie.generate_ids(prompt, max_new_tokens=24, num_candidates=0).token_ids


def test_tune_cost_curve_fit_is_monotone_and_local():
    """One slow timing is averaged with its neighbour, not carried to every larger call."""
    from spectr_edge.tune import monotone_fit

    fitted = monotone_fit([1.0, 1.0, 1.13, 1.03, 1.07, 1.11, 1.22, 1.49])     # the float32 tune of 2026-12-01
    pooled = (1.13 + 1.03 + 1.07) / 3                                         # the three out-of-order points
    assert list(fitted) == pytest.approx([1.0, 1.0, pooled, pooled, pooled, 1.11, 1.22, 1.49], abs=1e-9)
    assert all(b >= a for a, b in zip(fitted, fitted[1:]))
    assert list(monotone_fit([1.0, 1.2, 1.5])) == [1.0, 1.2, 1.5]             # already monotone: unchanged


def test_tune_race_interleaves_and_settles_near_ties(monkeypatch):
    """The choice statistics of `tune` on a scripted machine (the ONNX runs are covered above): every
    prompt's sweep runs target-only before and after the candidates, speedups are per prompt
    against that baseline, and the candidates within RACE_MARGIN of the best get a second pass.
    The machine slows 2% per generation, so a candidate-by-candidate schedule would be off by tens
    of percent; the bound checked is 3% of the true speedup."""
    from types import SimpleNamespace

    from spectr_edge import tune

    speed = {"target only": 1.0, "prompt lookup": 1.25, "model k=1 L=3": 1.21, "model k=1 L=6": 0.9}
    options = [{"num_candidates": 0}, {"drafter": "lookup"},
               {"drafter": "model", "num_candidates": 1, "draft_len": 3},
               {"drafter": "model", "num_candidates": 1, "draft_len": 6}]
    monkeypatch.setattr(tune, "candidates", lambda gen: {"greedy": options, "sampling": options})
    calls = []

    def generate_ids(prompt, max_new_tokens, temperature, seed, **opts):
        policy = tune.describe(opts)
        calls.append((prompt[0], policy))
        per_token = 0.05 * (1 + prompt[0] / 10) * (1 + 0.02 * len(calls)) / speed[policy]
        st = SimpleNamespace(new_tokens=max_new_tokens, seconds_first_token=0.1, target_calls=max_new_tokens,
                             seconds_total=0.1 + per_token * (max_new_tokens - 1), cost_units=max_new_tokens - 1)
        return SimpleNamespace(stats=st)

    gen = SimpleNamespace(generate_ids=generate_ids, engine=SimpleNamespace(context_length=1000), bundle=None)
    prompts = [[p, 7, 7] for p in range(5)]
    out = tune._choose(gen, 16, prompts, progress=lambda *_: None)
    greedy = out["greedy"]
    assert greedy["policy"] == "prompt lookup"
    rows = {r["policy"]: r for r in greedy["candidates"]}
    for policy, row in rows.items():
        assert row["measured"] == pytest.approx(speed[policy], rel=0.03)
    # the two within 10% of the best raced again; the slow one and the baseline ran once
    assert [rows[p]["passes"] for p in speed] == [1, 2, 2, 1]
    assert len(rows["prompt lookup"]["per_prompt"]) == 10 and len(rows["model k=1 L=6"]["per_prompt"]) == 5
    # per prompt: target-only, the candidates, target-only again
    first = [c for c in calls[:6]]
    assert first == [(0, "target only"), (0, "prompt lookup"), (0, "model k=1 L=3"), (0, "model k=1 L=6"),
                     (0, "target only"), (1, "target only")]


def test_tune_cost_curve_survives_a_slow_spell(monkeypatch):
    """tune.measure on a scripted machine (the ONNX runs are covered above): a call of n tokens
    takes 10 + n ms, and forward calls 9 to 13 (counting the past's prefill as call 0) run 4x
    slower, as when another job or the disk's write-back takes the CPU for a moment. Measured
    size by size, those calls were all of the 2-token size's timed calls and its cost came out
    4.4x a decode (2.0x after the monotone fit); with the sizes taking turns they fall in one round and the medians drop them.
    Bound checked: every relative cost within 2% of (10 + n) / 11."""
    from types import SimpleNamespace

    import numpy as np

    from spectr_edge import tune

    clock, calls = [0.0], [0]

    class Cache:
        def crop(self, n):
            pass

    def forward(ids, cache):
        slow = 4.0 if 9 <= calls[0] <= 13 else 1.0
        calls[0] += 1
        clock[0] += slow * (10 + ids.shape[1]) / 1000

    model = SimpleNamespace(new_cache=Cache, forward=forward)
    monkeypatch.setattr(tune.time, "perf_counter", lambda: clock[0])
    gen = SimpleNamespace(target=model, draft=None, engine=SimpleNamespace(context_length=4096),
                          bundle=SimpleNamespace(tokenizer=SimpleNamespace(vocab_size=100)))
    out = tune.measure(gen, repeats=5, progress=lambda *_: None)
    curve = dict(out["cost_curve"])
    assert sorted(curve) == list(tune.SIZES)
    for n, c in curve.items():
        assert c == pytest.approx((10 + n) / 11, rel=0.02), (n, c)
    assert np.isclose(out["target_ms"][1], 11.0)
