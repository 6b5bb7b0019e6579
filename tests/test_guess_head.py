"""The target's guess head (export/guess_head.py): its graph, its training on a real export, and
its use as prompt lookup's one-token draft (exact greedy; the Monte Carlo law test is in
test_montecarlo.py::test_guess_head_drafts_keep_the_target_law)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest

pytest.importorskip("torch")

from spectr_edge_export import guess_head  # noqa: E402

PROMPTS = ["def fibonacci(n):\n    if n < 2:", "The quick brown fox jumps over", "Hello, world! How are you?",
           "class Stack:\n    def push(self, item):"]


def _run_head(model, feeds: dict) -> np.ndarray:
    import onnxruntime as ort
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run([guess_head.GUESS_OUTPUT], {k: v for k, v in feeds.items() if k in names})[0]


@pytest.mark.parametrize("follow_chosen", [False, True])
def test_head_graph_computes_the_formula(follow_chosen):
    """guess_ids = ids[argmax((h + SiLU(h A + Emb[x] B + a)) E + c)] per row, x the row's argmax among
    the real ids (without B: no Emb[x] term); the 8-bit graph agrees with it on nearly every row."""
    rng = np.random.default_rng(0)
    d, v, vocab, width = 128, 40, 300, 320
    params = {"A": rng.normal(0, 0.1, (d, d)).astype(np.float32), "a": rng.normal(0, 0.1, d).astype(np.float32),
              "E": rng.normal(0, 1, (d, v)).astype(np.float32), "c": rng.normal(0, 1, v).astype(np.float32),
              "ids": rng.permutation(vocab)[:v].astype(np.int64)}
    h = rng.normal(0, 1, (2, 50, d)).astype(np.float32)                      # [batch, rows, D]
    logits = rng.normal(0, 1, (2, 50, width)).astype(np.float32)             # [batch, rows, W]
    logits[..., vocab:] = 50.0                                                # padding columns never chosen
    emb = rng.normal(0, 1, (vocab, d)).astype(np.float32)
    pre = h @ params["A"] + params["a"]
    if follow_chosen:
        params.update(B=rng.normal(0, 0.1, (d, d)).astype(np.float32), vocab_size=vocab)
        pre = pre + emb[logits[..., :vocab].argmax(-1)] @ params["B"]
    want = params["ids"][np.argmax((h + pre / (1 + np.exp(-pre))) @ params["E"] + params["c"], axis=-1)]
    feeds = {"hidden": h, "logits": logits, "embedding": emb}
    exact = _run_head(guess_head.head_model(params, bits=0), feeds)
    assert exact.shape == (2, 50) and exact.dtype == np.int64
    np.testing.assert_array_equal(exact, want)
    quantized = guess_head.head_model(params, bits=8)
    assert [n.op_type for n in quantized.graph.node].count("MatMulNBits") == 2 + follow_chosen
    assert np.mean(_run_head(quantized, feeds) == want) >= 0.9


def test_chain_graph_computes_the_formula_and_the_head_returns_its_state():
    """next_state = g + SiLU(g A2 + EB2[col(token)] + a2), next_token = ids[argmax(next_state E + c)];
    the head graph with a chain also returns its state g. The 8-bit chain agrees on nearly every row."""
    import onnxruntime as ort

    rng = np.random.default_rng(1)
    d, v, vocab = 128, 40, 300
    ids = rng.permutation(vocab)[:v].astype(np.int64)
    params = {"A": rng.normal(0, 0.1, (d, d)).astype(np.float32), "a": rng.normal(0, 0.1, d).astype(np.float32),
              "E": rng.normal(0, 1, (d, v)).astype(np.float32), "c": rng.normal(0, 1, v).astype(np.float32),
              "ids": ids, "A2": rng.normal(0, 0.1, (d, d)).astype(np.float32),
              "a2": rng.normal(0, 0.1, d).astype(np.float32), "EB2": rng.normal(0, 1, (v, d)).astype(np.float32)}
    g = rng.normal(0, 1, (64, d)).astype(np.float32)
    tokens = ids[rng.integers(0, v, 64)]
    col = {int(t): i for i, t in enumerate(ids)}
    pre = g @ params["A2"] + params["EB2"][[col[int(t)] for t in tokens]] + params["a2"]
    want_state = g + pre / (1 + np.exp(-pre))
    want = ids[np.argmax(want_state @ params["E"] + params["c"], axis=-1)]

    def run(model):
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run(["next_state", "next_token"], {"state": g, "token": tokens})

    state, token = run(guess_head.chain_model(params, vocab, bits=0))
    np.testing.assert_allclose(state, want_state, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(token, want)
    assert np.mean(run(guess_head.chain_model(params, vocab, bits=8))[1] == want) >= 0.9
    h = rng.normal(0, 1, (1, 5, d)).astype(np.float32)
    sess = ort.InferenceSession(guess_head.head_model(params, bits=0).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    pre = h @ params["A"] + params["a"]
    np.testing.assert_allclose(sess.run([guess_head.STATE_OUTPUT], {"hidden": h})[0], h + pre / (1 + np.exp(-pre)),
                               rtol=1e-5, atol=1e-5)


def test_chain_examples_follow_each_row_and_stop_at_its_end():
    """Position t of a row: the token its row chooses (greedy[t]), then labels greedy[t + 1 ...], -1 past
    the row's end; rows never run into each other."""
    d = 4
    scored = [(np.arange(5 * d, dtype=np.float32).reshape(5, d), np.asarray([10, 11, 12, 13, 14])),
              (np.zeros((3, d), np.float32), np.asarray([20, 21, 22]))]
    hidden, tokens, labels = guess_head.chain_examples(scored, 2)
    assert hidden.shape == (4 + 2, d) and tokens.shape == labels.shape == (6, 3)
    np.testing.assert_array_equal(hidden[1], scored[0][0][1])
    np.testing.assert_array_equal(tokens[0], [10, 11, 12])
    np.testing.assert_array_equal(labels[0], [11, 12, 13])
    np.testing.assert_array_equal(labels[3], [14, -1, -1])
    np.testing.assert_array_equal(tokens[4], [20, 21, 22])
    np.testing.assert_array_equal(labels[5], [22, -1, -1])


def test_training_stops_its_epochs_at_the_deadline():
    """Without a deadline every epoch runs; with one already passed only the first, and it says so."""
    rng = np.random.default_rng(0)
    d, n, vocab_size = 16, 600, 50
    hidden = rng.normal(size=(n, d)).astype(np.float32)
    labels = rng.integers(0, vocab_size, n)
    emb = rng.normal(size=(vocab_size, d)).astype(np.float32)
    assert guess_head.train(hidden, labels, emb, epochs=3, log=lambda s: None)["epochs"] == 3
    said: list[str] = []
    bound = guess_head.train(hidden, labels, emb, epochs=3, log=said.append, deadline=time.perf_counter())
    assert bound["epochs"] == 1 and "stopped after 1 of 3 epochs" in said[-1], said


def test_gather_scores_rows_within_its_token_cap_and_time_budget(tiny_bundle, tmp_path):
    """gather scores what next_rows gives (hidden state and the target's own greedy token at each
    position, as a plain prefill computes them), stops at max_tokens, and with its time spent after
    the first round asks for no second one."""
    from spectr_edge.bundle import read_bundle
    from spectr_edge.onnx_model import OnnxLM

    out = tmp_path / "bundle"                 # the scoring graph is written beside the target graph
    shutil.copytree(tiny_bundle, out)
    b = read_bundle(out)
    vocab = b.tokenizer.vocab_size
    rows = [[1 + (i * 7 + j * 3) % 97 for j in range(100)] for i in range(120)]    # 12,000 tokens

    def source():
        asked: list[int] = []
        take = guess_head.rows_from(rows)
        return asked, lambda n, r: (asked.append(n), take(n, r))[1]

    asked, next_rows = source()
    capped = guess_head.gather(b.target, next_rows, vocab, seconds=1e6, max_tokens=1000, log=lambda s: None)
    assert asked == [1000] and sum(len(g) for _, g in capped) == 1000
    target = OnnxLM(b.target, provider="cpu", threads=1)
    logits = target.forward(np.asarray([rows[3]], dtype=np.int64), target.new_cache())[0]
    h, greedy = capped[3]
    assert h.shape[0] == len(greedy) == 100
    np.testing.assert_array_equal(greedy, logits[-100:, :vocab].argmax(-1))
    asked, next_rows = source()
    spent = guess_head.gather(b.target, next_rows, vocab, seconds=1e-9, max_tokens=12000, log=lambda s: None)
    assert asked == [guess_head.ROUND_TOKENS], asked          # the first round always runs, then no more
    assert sum(len(g) for _, g in spent) == 4100              # whole rows: 41 of 100 tokens
    assert not list(out.rglob("*.hidden.onnx"))               # the scoring graph is gone


def test_exported_bundle_has_a_trained_head(tiny_qwen_bundle):
    """The export trained a head on conversation from the tiny draft; it beats the table's kind of
    guess by far on held-out text (the tiny models are near-deterministic, so it can learn them)."""
    from spectr_edge.bundle import read_bundle

    b = read_bundle(tiny_qwen_bundle)
    assert b.target.guess == guess_head.GUESS_OUTPUT
    entry = b.manifest["guess_head"]
    assert entry["train_positions"] > 1000 and entry["heldout_positions"] > 100
    assert entry["epochs"] == guess_head.HEAD_EPOCHS and entry["tokens"] > entry["train_positions"]
    assert 0 <= entry["minutes"] <= guess_head.HEAD_MINUTES
    assert entry["heldout_agreement"] > 0.3, entry
    graph = onnx.load(str(b.target.file), load_external_data=False).graph
    assert sum(o.name == guess_head.GUESS_OUTPUT for o in graph.output) == 1
    assert [n.op_type for n in graph.node if n.name.startswith(guess_head.PREFIX)].count("MatMulNBits") == 3
    # its chain: the graph returns the head's state, the chain graph sits beside it, both declared
    assert b.target.guess_state == guess_head.STATE_OUTPUT
    assert sum(o.name == guess_head.STATE_OUTPUT for o in graph.output) == 1
    assert b.target.guess_chain == b.target.file.with_name(guess_head.CHAIN_FILE) and b.target.guess_chain.is_file()
    chain = entry["chain"]
    assert chain["trained_positions"] == guess_head.CHAIN_DEPTH == len(chain["heldout_agreement"])
    assert chain["heldout_agreement"][0] > 0.3, chain       # the tiny models are near-deterministic


def test_lookup_with_guess_head_is_exact_greedy_and_uses_the_right_row(tiny_qwen_bundle, monkeypatch):
    """Greedy --draft lookup on the head's bundle equals target-only decoding token for token, the
    head drafted on many steps, its chain further guesses on some, and each guess it drafted is what
    the target graph (and the chain graph from its state) guesses after a fresh prefill of the same
    text (a guess or a state read from the wrong row of a call would differ).

    The target is read as the quantized targets that get a head by default are (calls padded to an
    even number of rows, at least 2: ModelSpec.min_call_tokens / call_multiple), so a one-token guess
    is free and drafted whenever the text has no match. With 1-token calls the length rule drops
    guesses after a few misses, and how soon depends on the head this machine's training produced:
    on an AVX2-only AMD EPYC the first four guesses of every prompt missed (16 steps, none accepted,
    although the head was right on 5-54% of the positions)."""
    import dataclasses

    from spectr_edge import lookup
    from spectr_edge.bundle import read_bundle
    from spectr_edge.generator import Generator
    from spectr_edge.onnx_model import OnnxLM

    seen: list[tuple[list[int], int, list[int]]] = []
    original = lookup.PromptLookup.propose

    def spy(self, ids, limit, guess=None, chain=None):
        draft, key = original(self, ids, limit, guess, chain)
        if key == lookup.GUESS and draft:
            seen.append((list(ids), int(guess), list(draft)))
        return draft, key

    monkeypatch.setattr(lookup.PromptLookup, "propose", spy)
    bundle = read_bundle(tiny_qwen_bundle)
    bundle = dataclasses.replace(bundle, target=dataclasses.replace(bundle.target, min_call_tokens=2,
                                                                    call_multiple=2))
    gen = Generator(bundle, provider="cpu", threads=1)
    steps = accepted = drafted = 0
    for prompt in PROMPTS:
        ids = gen.codec.tokenizer.encode(prompt).ids
        plain = gen.generate_ids(ids, max_new_tokens=40, num_candidates=0)
        res = gen.generate_ids(ids, max_new_tokens=40, drafter="lookup", num_candidates=1)
        assert res.token_ids == plain.token_ids, prompt
        steps += res.stats.guess_steps
        accepted += res.stats.guess_accepted
        drafted += res.stats.guess_drafted
    assert steps >= 20 and 0 < accepted, (steps, accepted)
    assert drafted > steps, (drafted, steps)              # the chain drafted further guesses on some steps
    assert len(seen) == steps
    target = OnnxLM(gen.engine.target.spec, provider="cpu", threads=1)
    for ids, guess, draft in seen:
        target.forward(np.asarray([ids[:-1]], dtype=np.int64), target.new_cache(), last=1)
        assert int(target.guess[0, -1]) == guess == draft[0], (len(ids), guess)
        # the chain continues from the state of the same row
        assert target.chain_after(-1, guess)(len(draft) - 1) == draft[1:], (len(ids), draft)


def test_add_guess_head_replaces_the_head_in_place(tiny_bundle, tmp_path):
    """`spectr-edge export --add-guess-head` on an existing bundle: one head (the old one replaced),
    the manifest records it, `info` reports it; a second run, with a time budget (--guess-head-minutes)
    spent by its first round of text, trains one epoch and leaves one head too."""
    out = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, out)
    cli = [sys.executable, "-m", "spectr_edge.cli"]
    for budget in ([], ["--guess-head-minutes", "0.0001"]):
        res = subprocess.run(cli + ["export", "--add-guess-head", "--out", str(out)] + budget, capture_output=True,
                             text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-2000:]
        assert "held-out" in res.stdout
        graph = onnx.load(str(out / "target" / "model.onnx"), load_external_data=False).graph
        assert sum(o.name == guess_head.GUESS_OUTPUT for o in graph.output) == 1
        assert sum(n.name.startswith(guess_head.PREFIX) for n in graph.node) == 15   # with the state's Identity
        assert (out / "target" / guess_head.CHAIN_FILE).is_file()
        manifest = json.loads((out / "spectr.json").read_text())
        entry = manifest["models"]["target"]
        assert entry["outputs"]["guess"] == guess_head.GUESS_OUTPUT
        assert manifest["guess_head"]["epochs"] == (1 if budget else guess_head.HEAD_EPOCHS), manifest["guess_head"]
        tokens = manifest["guess_head"]["tokens"]      # one round of text within the budget, all of it without
        assert tokens < 2 * guess_head.ROUND_TOKENS if budget else tokens >= guess_head.HEAD_TOKENS, tokens
        assert entry["size_bytes"] == sum(f.stat().st_size for f in (out / "target").glob("model.onnx*"))
    info = subprocess.run(cli + ["info", "--bundle", str(out)], capture_output=True, text=True, timeout=120)
    assert "guess head: the target guesses" in info.stdout, info.stdout
    bad = subprocess.run(cli + ["export", "--add-guess-head", "--out", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "bundle" in bad.stderr


def test_missing_or_corrupt_chain_graph_is_a_one_line_error(tiny_qwen_bundle, tmp_path):
    """A bundle whose manifest names a chain graph that is gone or corrupt fails to load with the fix."""
    import spectr_edge
    from spectr_edge.errors import BundleError

    out = tmp_path / "bundle"
    shutil.copytree(tiny_qwen_bundle, out)
    chain = out / "target" / guess_head.CHAIN_FILE
    chain.write_bytes(b"not an onnx graph")
    with pytest.raises(BundleError, match="chain graph .* corrupt .*--add-guess-head"):
        spectr_edge.load(out, provider="cpu", load_draft=False)
    chain.unlink()
    with pytest.raises(BundleError, match="chain graph .* missing; re-run spectr-edge export --add-guess-head"):
        spectr_edge.load(out, provider="cpu", load_draft=False)
