"""Recording the target's top-k log-probabilities of real generations (`--record DIR`): every row is
the target's distribution over the token it precedes, whichever drafter and rule kept the token;
whole lines only; a size cap; one-line errors. Tiny bundles exported through the real path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import spectr_edge
from spectr_edge import recording
from spectr_edge.errors import InputError
from spectr_edge.recording import Recorder, top_logprobs

PROMPT = [int(t) for t in np.random.default_rng(3).integers(3, 400, 20)]


def teacher_forced(gen, prompt, tokens, k):
    """The target's top-k log-probabilities over tokens[i] given prompt + tokens[:i], in one causal call."""
    ids = np.asarray([prompt + tokens[:-1]], dtype=np.int64)
    logits = gen.target.forward(ids, gen.target.new_cache())[0, len(prompt) - 1:]       # [n, W]
    return top_logprobs(logits, gen.bundle.tokenizer.vocab_size, k)


@pytest.mark.parametrize("options", [
    dict(), dict(num_candidates=0), dict(drafter="lookup"), dict(tree_budget=6, draft_len=3),
    dict(temperature=1.0, num_candidates=2, draft_len=3, seed=5),
    dict(temperature=1.0, tree_budget=6, draft_len=3, seed=6),
    dict(temperature=0.8, num_candidates=1, draft_len=4, seed=7, top_k=50)])
@pytest.mark.parametrize("bundle", ["tiny_qwen_bundle", "tiny_bundle"])
def test_each_row_is_the_targets_distribution_over_the_token_it_precedes(request, bundle, tmp_path, options):
    """Against the target teacher-forced over the same tokens in one causal call: same top-k ids where
    the log-probabilities are apart, log-probabilities within float16 rounding plus call-shape numerics
    (0.02). Greedy: the top token of each row is the token emitted. The tree bundle scores token tries;
    the other (no tree mask) scores k rows of a replicated cache."""
    if "tree_budget" in options and bundle == "tiny_bundle":
        pytest.skip("draft trees need a tree bundle")
    gen = spectr_edge.load(request.getfixturevalue(bundle), provider="cpu", threads=1, prefix_cache=False, record=tmp_path / "rec")
    out = gen.generate_ids(PROMPT, max_new_tokens=12, **options)
    (rec,) = list(recording.read(tmp_path / "rec"))
    assert rec.prompt == PROMPT and rec.tokens[:len(out.token_ids)] == out.token_ids
    assert rec.top_ids.shape == rec.top_logprobs.shape == (len(rec.tokens), recording.DEFAULT_TOP_K)
    want_ids, want_logp = teacher_forced(gen, PROMPT, rec.tokens, recording.DEFAULT_TOP_K)
    np.testing.assert_allclose(rec.top_logprobs, want_logp, atol=0.02)
    clear = np.abs(np.diff(want_logp, axis=1)) > 0.05          # neighbours a tie could swap
    assert np.all(rec.top_ids[:, 0][clear[:, 0]] == want_ids[:, 0][clear[:, 0]])
    if options.get("temperature", 0.0) == 0.0:
        assert rec.top_ids[:, 0].tolist() == rec.tokens
    assert np.all(np.diff(rec.top_logprobs, axis=1) <= 1e-3) and np.all(rec.top_logprobs <= 1e-3)


def test_one_line_per_generation_appended_and_torn_lines_skipped(tiny_qwen_bundle, tmp_path):
    gen = spectr_edge.load(tiny_qwen_bundle, provider="cpu", threads=1, record=tmp_path)
    a = gen.generate_ids(PROMPT, max_new_tokens=5)
    pieces = list(gen.stream("hello there", max_new_tokens=4))
    assert pieces
    path = tmp_path / recording.RECORD_FILE
    whole = path.read_bytes()
    path.write_bytes(whole + whole.splitlines(keepends=True)[0][:40])      # a write cut short by a crash
    recs = list(recording.read(path))
    assert len(recs) == 2 and recs[0].tokens[:5] == a.token_ids
    assert recs[0].vocab_sha256 == gen.bundle.tokenizer.vocab_sha256


def test_the_size_cap_stops_the_file_and_says_so_once(tiny_qwen_bundle, tmp_path, capsys):
    b = spectr_edge.load(tiny_qwen_bundle, provider="cpu", threads=1).bundle
    rec = Recorder(tmp_path, b.tokenizer.vocab_size, max_bytes=1500)
    gen = spectr_edge.load(tiny_qwen_bundle, provider="cpu", threads=1, record=rec)
    for n in (2, 30, 30):
        gen.generate_ids(PROMPT, max_new_tokens=n)
    size = (tmp_path / recording.RECORD_FILE).stat().st_size
    assert 0 < size <= 1500 and rec.written == 1 and rec.full
    assert capsys.readouterr().err.count("recording stopped") == 1


def test_recording_is_off_by_default_and_bad_places_are_one_line_errors(tiny_qwen_bundle, tmp_path):
    gen = spectr_edge.load(tiny_qwen_bundle, provider="cpu", threads=1)
    assert gen.engine.recorder is None
    (tmp_path / "f").write_text("x")
    with pytest.raises(InputError, match="is a file, not a directory"):
        spectr_edge.load(tiny_qwen_bundle, provider="cpu", record=tmp_path / "f")
    for bad in (0, 65, True, 2.0):
        with pytest.raises(InputError, match="top_k"):
            Recorder(tmp_path, 512, top_k=bad)
    with pytest.raises(InputError, match="no recording"):
        list(recording.read(tmp_path / "empty"))


def test_cli_generate_records_and_refuses_a_file(tiny_qwen_bundle, tmp_path):
    cmd = [sys.executable, "-m", "spectr_edge.cli", "generate", "--bundle", str(tiny_qwen_bundle), "--no-chat",
           "-n", "6", "--provider", "cpu", "--json"]
    done = subprocess.run(cmd + ["--record", str(tmp_path / "rec"), "hello"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (rec,) = list(recording.read(tmp_path / "rec"))
    assert rec.tokens[:6] == json.loads(done.stdout)["token_ids"]
    (tmp_path / "file").write_text("")
    bad = subprocess.run(cmd + ["--record", str(tmp_path / "file"), "hello"], capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "is a file, not a directory" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_text_written_by_one_bundle_is_scored_again_by_another_s_target(tiny_qwen_bundle, tiny_bundle, tmp_path):
    """bench/record_rescored.py: each record of the fast bundle's generations is rewritten with the
    scoring bundle's target distributions over the same tokens. Scored by the bundle that wrote it, the
    rows equal what it recorded itself (top ids where clear, log-probabilities within 0.02); scored by
    another target, they equal that target teacher-forced, and differ from the recorded ones."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import record_rescored

    gen = spectr_edge.load(tiny_qwen_bundle, provider="cpu", threads=1, prefix_cache=False, record=tmp_path / "fast")
    for seed in range(3):
        gen.generate_ids(PROMPT[seed:], max_new_tokens=10, temperature=1.0, seed=seed)
    fast = list(recording.read(tmp_path / "fast"))
    assert record_rescored.rescore(tiny_qwen_bundle, tmp_path / "fast", tmp_path / "same", 16) == (3, 30)
    for a, b in zip(fast, recording.read(tmp_path / "same"), strict=True):
        assert (a.prompt, a.tokens) == (b.prompt, b.tokens)
        np.testing.assert_allclose(b.top_logprobs, a.top_logprobs, atol=0.02)
        clear = np.abs(np.diff(a.top_logprobs, axis=1))[:, 0] > 0.05
        assert np.all(b.top_ids[clear, 0] == a.top_ids[clear, 0])

    other = spectr_edge.load(tiny_bundle, provider="cpu", threads=1, prefix_cache=False)
    assert other.bundle.tokenizer.vocab_sha256 == gen.bundle.tokenizer.vocab_sha256
    record_rescored.rescore(tiny_bundle, tmp_path / "fast", tmp_path / "other", 16)
    for a, b in zip(fast, recording.read(tmp_path / "other"), strict=True):
        ids, logp = teacher_forced(other, a.prompt, a.tokens, 16)
        np.testing.assert_allclose(b.top_logprobs, logp, atol=0.02)
        assert np.abs(b.top_logprobs - a.top_logprobs).max() > 0.1
