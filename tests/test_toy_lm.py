"""The toy LM of tests/toy_lm.py: ONNX graphs == NumPy reference, bundle well formed.

Everything the Monte Carlo tests trust is checked here, with onnxruntime directly
(no spectr_edge code): logits for prefill, cached decoding, multi-token scoring and
batched rows; sensitivity to history and positions; the reference logits processing.
"""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from toy_lm import (PAD_LOGIT, build_toy_bundle, exact_next_logits, exact_next_probs,
                    exact_sequence_law, load_params, make_params, process_logits, token_strings)

ATOL = 2e-5  # float32 graph vs float64 NumPy on logits of magnitude ~PAD_LOGIT


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return build_toy_bundle(tmp_path_factory.mktemp("toy"), seed_target=11, seed_draft=12)


@pytest.fixture(scope="module")
def target(bundle):
    session = ort.InferenceSession(str(bundle / "target/model.onnx"), providers=["CPUExecutionProvider"])
    return session, load_params(bundle)


def run(session, ids, past=None, positions=None):
    """One graph call. ids [b, s]; past: list of (key, value) [b, 1, p, D] or None."""
    ids = np.asarray(ids, np.int64)
    b, s = ids.shape
    n_layers = sum(1 for i in session.get_inputs() if i.name.endswith(".key"))
    if past is None:
        past = [(np.zeros((b, 1, 0, 4), np.float32),) * 2 for _ in range(n_layers)]
    p = past[0][0].shape[2]
    feeds = {"input_ids": ids,
             "attention_mask": np.ones((b, p + s), np.int64),
             "position_ids": np.tile(np.arange(p, p + s), (b, 1)) if positions is None else positions}
    for l, (key, value) in enumerate(past):
        feeds[f"past_key_values.{l}.key"], feeds[f"past_key_values.{l}.value"] = key, value
    out = session.run(None, feeds)
    names = [o.name for o in session.get_outputs()]
    logits = out[names.index("logits")]
    present = [(out[names.index(f"present.{l}.key")], out[names.index(f"present.{l}.value")])
               for l in range(n_layers)]
    return logits, present


def random_history(rng, n, vocab_size=5):
    return [int(t) for t in rng.integers(0, vocab_size, n)]


# --------------------------------------------------------------------------- bundle


def test_manifest_follows_bundle_spec(bundle):
    manifest = json.loads((bundle / "spectr.json").read_text())
    assert manifest["format"] == "spectr-edge-bundle" and manifest["format_version"] == 1
    tok = manifest["tokenizer"]
    assert tok["vocab_size"] == 5 and tok["eos_token_ids"] == [] and tok["chat_template"] is None
    for role in ("target", "draft"):
        model = manifest["models"][role]
        assert (bundle / model["file"]).is_file() and (bundle / model["tokenizer_file"]).is_file()
        assert model["vocab_sha256"] == tok["vocab_sha256"]
        assert model["quant"] == "none" and model["parity_max_abs_diff"] is None
        assert model["logits_width"] == 6 and model["num_kv_heads"] == 1 and model["head_dim"] == 4
        graph = onnx.load(str(bundle / model["file"])).graph
        inputs = {i.name for i in graph.input}
        outputs = {o.name for o in graph.output}
        assert set(model["inputs"][k] for k in ("input_ids", "attention_mask", "position_ids")) <= inputs
        assert {n for pair in model["inputs"]["past"] for n in pair} <= inputs
        assert {n for pair in model["outputs"]["present"] for n in pair} | {"logits"} == outputs
        assert len(model["inputs"]["past"]) == model["num_layers"]


def test_tokenizer_roundtrip(bundle):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    assert token_strings(5) == ["<unk>", "a", "b", "c", "d"]
    assert tokenizer.encode("a b d <unk> zz").ids == [1, 2, 4, 0, 0]  # unknown word -> <unk>
    assert tokenizer.decode([1, 3, 2]) == "a c b"
    assert tokenizer.get_vocab_size() == 5


def test_params_read_back_from_graph(bundle):
    target, draft = make_params(11, 12)
    for role, expected in (("target", target), ("draft", draft)):
        got = load_params(bundle, role)
        for name in ("A", "c", "EK", "PK", "EV", "PV", "EQ", "B"):
            np.testing.assert_array_equal(getattr(got, name), getattr(expected, name))


# --------------------------------------------------------------------------- graph == NumPy


def test_prefill_is_causal_and_matches_numpy(target):
    session, params = target
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 9):
        ids = random_history(rng, n)
        logits, present = run(session, [ids])  # [1, n, W]
        for t in range(n):  # position t sees ids[:t + 1] only
            np.testing.assert_allclose(logits[0, t], exact_next_logits(params, ids[: t + 1]), atol=ATOL)
        assert present[0][0].shape == (1, 1, n, 4)


def test_incremental_decoding_matches_numpy(target):
    session, params = target
    ids = random_history(np.random.default_rng(1), 12)
    logits, past = run(session, [ids[:3]])
    for t in range(3, len(ids)):
        logits, past = run(session, [[ids[t]]], past)  # one token, cache of t
        np.testing.assert_allclose(logits[0, -1], exact_next_logits(params, ids[: t + 1]), atol=ATOL)


def test_multi_token_scoring_after_cache(target):
    session, params = target
    rng = np.random.default_rng(2)
    for prefix_len, new in ((1, 4), (4, 3), (7, 5)):
        ids = random_history(rng, prefix_len + new)
        _, past = run(session, [ids[:prefix_len]])
        logits, present = run(session, [ids[prefix_len:]], past)  # [1, new, W]
        for j in range(new):
            np.testing.assert_allclose(logits[0, j], exact_next_logits(params, ids[: prefix_len + j + 1]),
                                       atol=ATOL)
        assert present[1][1].shape == (1, 1, prefix_len + new, 4)


def test_batch_rows_are_independent(target):
    """The speculative layout: one prefix cache repeated over rows, different continuations."""
    session, params = target
    rng = np.random.default_rng(3)
    prefix = random_history(rng, 4)
    _, past = run(session, [prefix])
    rows = [random_history(rng, 3) for _ in range(4)]
    past4 = [(np.repeat(k, 4, axis=0), np.repeat(v, 4, axis=0)) for k, v in past]
    logits, _ = run(session, rows, past4)  # [4, 3, W]
    for r, row in enumerate(rows):
        for j in range(3):
            np.testing.assert_allclose(logits[r, j], exact_next_logits(params, prefix + row[: j + 1]), atol=ATOL)


def test_wrong_cache_or_positions_change_the_output(target):
    """The graph punishes the runtime's likely mistakes by a large change in q."""
    session, params = target
    rng = np.random.default_rng(4)
    shifts = {"extra": [], "dropped": [], "positions": []}
    for _ in range(20):
        ids = random_history(rng, 6)
        q = exact_next_probs(params, ids)
        tv = lambda p: 0.5 * np.abs(p - q).sum()  # noqa: E731
        # a rejected token left in the cache / an accepted token cropped away
        shifts["extra"].append(tv(exact_next_probs(params, ids[:4] + [(ids[4] + 1) % 5] + ids[4:])))
        shifts["dropped"].append(tv(exact_next_probs(params, ids[:3] + ids[4:])))
        # the right cache but position ids off by one for the new token
        _, past = run(session, [ids[:5]])
        logits, _ = run(session, [ids[5:]], past, positions=np.array([[6]]))
        shifts["positions"].append(tv(process_logits(logits[0, -1], 5)))
    for name, values in shifts.items():
        assert np.mean(values) > 0.03, (name, np.mean(values))


def test_padding_id_dominates_unmasked_logits(target):
    session, params = target
    logits, _ = run(session, [[1, 2, 3]])
    raw = np.exp(logits[0] - logits[0].max(axis=-1, keepdims=True))
    raw /= raw.sum(axis=-1, keepdims=True)  # softmax over all W = 6 columns
    assert np.all(raw[:, 5] > 0.999) and np.all(logits[0, :, 5] > PAD_LOGIT - 10)
    assert exact_next_probs(params, [1, 2, 3]).shape == (5,)  # padding masked


def test_draft_is_moderately_close_to_target(bundle):
    target, draft = load_params(bundle, "target"), load_params(bundle, "draft")
    rng = np.random.default_rng(5)
    overlaps = []
    for _ in range(300):
        ids = random_history(rng, int(rng.integers(1, 8)))
        overlaps.append(np.minimum(exact_next_probs(target, ids), exact_next_probs(draft, ids)).sum())
    assert 0.55 < np.mean(overlaps) < 0.85, np.mean(overlaps)
    assert np.min(overlaps) < 0.9  # rejections really happen


# --------------------------------------------------------------------------- reference processing


def test_process_logits_hand_built():
    logits = np.log([0.1, 0.2, 0.3, 0.4])
    np.testing.assert_allclose(process_logits(logits, 4), [0.1, 0.2, 0.3, 0.4])
    # temperature 0.5 squares then renormalises
    np.testing.assert_allclose(process_logits(logits, 4, temperature=0.5), np.array([1, 4, 9, 16]) / 30)
    # top-k keeps logits >= the k-th largest, ties included
    np.testing.assert_allclose(process_logits([1.0, 2.0, 2.0, 0.0], 4, top_k=2), [0, 0.5, 0.5, 0])
    np.testing.assert_allclose(process_logits([1.0, 2.0, 2.0, 0.0], 4, top_k=1), [0, 0.5, 0.5, 0])
    np.testing.assert_allclose(process_logits(logits, 4, top_k=3), np.array([0, 2, 3, 4]) / 9)
    # top-p, HF semantics: ascending cumulative 0.1 0.3 0.6 1.0; remove cumulative <= 1 - top_p
    np.testing.assert_allclose(process_logits(logits, 4, top_p=0.75), np.array([0, 2, 3, 4]) / 9)
    np.testing.assert_allclose(process_logits(logits, 4, top_p=0.5), np.array([0, 0, 3, 4]) / 7)
    np.testing.assert_allclose(process_logits(logits, 4, top_p=0.05), [0, 0, 0, 1])  # keep >= 1
    with pytest.raises(ValueError):  # cumulative 0.1 + 0.2 sits on the 1 - 0.7 threshold
        process_logits(logits, 4, top_p=0.7)
    # top-p sees the temperature-scaled, top-k-filtered distribution
    np.testing.assert_allclose(process_logits(logits, 4, temperature=0.5, top_p=0.5), [0, 0, 0, 1])
    np.testing.assert_allclose(process_logits(logits, 4, top_k=2, top_p=0.5), [0, 0, 0, 1])
    # padding columns (index >= vocab_size) are dropped before anything else
    np.testing.assert_allclose(process_logits(np.append(logits, 50.0), 4), [0.1, 0.2, 0.3, 0.4])
    # greedy: first argmax
    np.testing.assert_array_equal(process_logits([0.0, 3.0, 3.0, 50.0], 3, temperature=0), [0, 1, 0])


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 3, 0.8), (1.3, 0, 0.9)])
def test_exact_sequence_law_factorises(bundle, temperature, top_k, top_p):
    params = load_params(bundle)
    prompt = [2, 0, 3]
    law = exact_sequence_law(bundle, prompt, 3, temperature, top_k, top_p)
    assert len(law) == 125 and abs(sum(law.values()) - 1) < 1e-12
    first = process_logits(exact_next_logits(params, prompt), 5, temperature, top_k, top_p)
    for x in range(5):  # marginal of the first token == q(. | prompt)
        assert abs(sum(v for s, v in law.items() if s[0] == x) - first[x]) < 1e-12
    seq = max(law, key=law.get)
    expected = 1.0
    for j in range(3):
        expected *= process_logits(exact_next_logits(params, prompt + list(seq[:j])), 5,
                                   temperature, top_k, top_p)[seq[j]]
    assert law[seq] == pytest.approx(expected, rel=1e-12)
    if top_k or top_p < 1:
        assert sum(v == 0 for v in law.values()) > 0  # filters remove sequences


def test_exact_sequence_law_greedy_is_a_point_mass(bundle):
    law = exact_sequence_law(bundle, [1], 3, temperature=0)
    assert sorted(law.values())[-1] == 1.0 and sum(law.values()) == 1.0
