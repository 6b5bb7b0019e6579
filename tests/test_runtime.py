"""Runtime on real ONNX Runtime sessions over the hand-built toy bundle (tests/toy_lm.py):
greedy equality of speculative and target-only decoding, eos / budget / context handling,
KV-cache operations, and every bad input getting a one-line error."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import spectr_edge
from spectr_edge import BundleError, InputError, ProviderError
from spectr_edge.device import GraphDevice, HostDevice
from spectr_edge.kv_cache import KVCache
from toy_lm import build_toy_bundle


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return build_toy_bundle(tmp_path_factory.mktemp("toy") / "bundle", seed_target=11, seed_draft=12)


@pytest.fixture(scope="module")
def gen(toy_dir):
    return spectr_edge.load(toy_dir, provider="cpu")


def _edited_copy(src, dst, edit):
    """Copy a bundle and apply edit(manifest) to its spectr.json."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "spectr.json").read_text())
    edit(manifest)
    (dst / "spectr.json").write_text(json.dumps(manifest))
    return dst


PROMPTS = [[0], [1, 2], [3, 3, 0, 1], [4, 2, 1, 0, 3, 2]]


@pytest.mark.parametrize("num_candidates,draft_len,draft_stop", [(1, 1, 0), (1, 3, 0), (2, 2, 0), (4, 5, 0),
                                                                  (1, 5, 0.6)])
def test_greedy_speculative_equals_target_only(gen, num_candidates, draft_len, draft_stop):
    drafted = accepted = 0
    for prompt in PROMPTS:
        plain = gen.generate_ids(prompt, max_new_tokens=20, temperature=0, num_candidates=0)
        spec = gen.generate_ids(prompt, max_new_tokens=20, temperature=0, draft_stop=draft_stop,
                                num_candidates=num_candidates, draft_len=draft_len)
        assert spec.token_ids == plain.token_ids
        assert plain.stats.target_calls == 20 and plain.stats.draft_calls == 0
        drafted += spec.stats.drafted
        accepted += spec.stats.accepted
        assert spec.stats.target_calls < 20 or spec.stats.accepted == 0
    # speculation really ran and accepted tokens; rejections happened too
    assert 0 < accepted < drafted


def test_budget_is_exact_and_stats_add_up(gen):
    for n in (1, 2, 3, 7):
        res = gen.generate_ids([1, 2], max_new_tokens=n, temperature=1.0, num_candidates=2, draft_len=4, seed=3)
        assert len(res.token_ids) == n and res.stats.new_tokens == n
        assert res.stats.stop_reason == "max_new_tokens"
        assert res.stats.target_calls >= 1 + res.stats.steps      # prefill + speculative (+ plain tail) calls
        assert res.stats.reached[0] == res.stats.steps            # every step verifies position 1
        assert sum(res.stats.accepted_at) == res.stats.accepted
        assert all(0 <= t < 5 for t in res.token_ids)  # the padded id 5 never appears


def test_sampling_is_reproducible_with_a_seed(gen):
    a = gen.generate_ids([0, 1], max_new_tokens=12, temperature=0.8, top_k=3, num_candidates=2, seed=42)
    b = gen.generate_ids([0, 1], max_new_tokens=12, temperature=0.8, top_k=3, num_candidates=2, seed=42)
    assert a.token_ids == b.token_ids


def test_eos_inside_an_accepted_block_ends_generation(toy_dir, tmp_path):
    plain_gen = spectr_edge.load(toy_dir, provider="cpu")
    reference = plain_gen.generate_ids([2], max_new_tokens=20, temperature=0, num_candidates=0).token_ids
    eos = reference[5]   # a token greedy decoding emits at position 5 (maybe earlier too)
    first = reference.index(eos)
    bundle = _edited_copy(toy_dir, tmp_path / "eos", lambda m: m["tokenizer"].update(eos_token_ids=[eos]))
    g = spectr_edge.load(bundle, provider="cpu")
    for k, L in [(0, 1), (1, 4), (1, 6)]:
        res = g.generate_ids([2], max_new_tokens=20, temperature=0, num_candidates=k, draft_len=L)
        assert res.token_ids == reference[:first + 1]   # eos included, nothing after it
        assert res.stats.stop_reason == "eos"


def test_generation_stops_at_the_end_of_the_context(toy_dir, tmp_path):
    bundle = _edited_copy(toy_dir, tmp_path / "ctx", lambda m: [
        m["models"][r].update(context_length=10) for r in ("target", "draft")])
    g = spectr_edge.load(bundle, provider="cpu")
    plain = g.generate_ids([1, 2, 3], max_new_tokens=50, temperature=0, num_candidates=0)
    spec = g.generate_ids([1, 2, 3], max_new_tokens=50, temperature=0, num_candidates=1, draft_len=4)
    assert len(plain.token_ids) == 7 and plain.stats.stop_reason == "context"   # 3 + 7 = context 10
    assert spec.token_ids == plain.token_ids and spec.stats.stop_reason == "context"
    with pytest.raises(InputError, match="context is 10"):
        g.generate_ids(list(range(5)) * 2, max_new_tokens=1)


@pytest.mark.parametrize("device", [HostDevice(), GraphDevice("cpu")], ids=["host", "graph"])
def test_kv_cache_operations(device):
    cache = KVCache(device, num_layers=2, num_kv_heads=3, head_dim=4)
    assert cache.length == 0 and cache.batch == 1
    layer = np.arange(1 * 3 * 6 * 4, dtype=np.float32).reshape(1, 3, 6, 4)   # [1, heads, 6, dim]
    cache.values = [device.from_host(layer + i) for i in range(4)]
    cache.repeat_rows(3)
    assert cache.batch == 3 and np.array_equal(cache.host_layers()[1][0][2], layer[0] + 2)
    cache.keep_row(2)
    cache.crop(4)
    assert cache.batch == 1 and cache.length == 4
    k0v = cache.host_layers()[0][1]
    assert np.array_equal(k0v, (layer + 1)[:, :, :4]) and k0v.flags.c_contiguous
    with pytest.raises(ValueError):
        cache.crop(5)


# -- bad input: one line naming the problem and the fix ------------------------------------------
@pytest.mark.parametrize("options,message", [
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(num_candidates=-1), r"num_candidates must be an integer in \[0, 64\]"),
    (dict(draft_len=0), r"draft_len must be an integer in \[1, 128\]"),
    (dict(draft_stop=1.0), r"draft_stop must be in \[0, 1\)"),
    (dict(tree_budget=-1), r"tree_budget must be an integer in \[0, 1024\]"),
    (dict(tree_budget=4), "needs a bundle whose graphs take a tree mask"),
    (dict(tree_budget=4, drafter="lookup"), "drafts with the draft model"),
    (dict(draft_window=-1), "draft_window must be an integer >= 0"),
])
def test_bad_generation_options(gen, options, message):
    with pytest.raises(InputError, match=message) as err:
        gen.generate_ids([1], **options)
    assert "\n" not in str(err.value)


def test_bad_prompts(gen):
    with pytest.raises(InputError, match="prompt is empty"):
        gen.generate_ids([])
    with pytest.raises(InputError, match="outside the vocabulary"):
        gen.generate_ids([5])          # the padded id
    with pytest.raises(InputError, match="prompt is empty"):
        gen.generate("")


def test_missing_bundle_and_manifest(tmp_path):
    with pytest.raises(BundleError, match="was not found at .*no spectr.json"):
        spectr_edge.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BundleError, match="no spectr.json"):
        spectr_edge.load(tmp_path / "empty")
    (tmp_path / "empty" / "spectr.json").write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        spectr_edge.load(tmp_path / "empty")


def test_default_bundle_missing_names_the_build_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPECTR_EDGE_BUNDLE", str(tmp_path / "models" / "default"))
    with pytest.raises(BundleError, match="spectr-edge export --preset qwen2.5-coder --out models/default"):
        spectr_edge.load()


def test_corrupt_onnx_file(toy_dir, tmp_path):
    bundle = _edited_copy(toy_dir, tmp_path / "corrupt", lambda m: None)
    data = (bundle / "target" / "model.onnx").read_bytes()
    (bundle / "target" / "model.onnx").write_bytes(data[: len(data) // 2])   # truncated
    with pytest.raises(BundleError, match="target model .* corrupt or truncated"):
        spectr_edge.load(bundle, provider="cpu")


def test_manifest_pointing_outside_the_bundle(toy_dir, tmp_path):
    bundle = _edited_copy(toy_dir, tmp_path / "escape", lambda m: m["models"]["target"].update(
        file="../../elsewhere/model.onnx"))
    with pytest.raises(BundleError, match="points outside the bundle"):
        spectr_edge.load(bundle, provider="cpu")


def test_tokenizer_mismatch_names_the_first_differing_token(toy_dir, tmp_path):
    bundle = _edited_copy(toy_dir, tmp_path / "mismatch", lambda m: m["models"]["draft"].update(vocab_sha256="x"))
    tok = json.loads((bundle / "draft" / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["zz"] = vocab.pop("c")          # same id, another token
    (bundle / "draft" / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(BundleError, match=r"differ at id \d+: target 'c' vs draft 'zz'"):
        spectr_edge.load(bundle, provider="cpu")


def test_graph_without_kv_inputs(toy_dir, tmp_path):
    bundle = _edited_copy(toy_dir, tmp_path / "nokv", lambda m: m["models"]["target"]["inputs"].update(
        past=[["past.0.k", "past.0.v"]] * m["models"]["target"]["num_layers"]))
    with pytest.raises(BundleError, match="lacks the expected KV-cache inputs"):
        spectr_edge.load(bundle, provider="cpu")


def test_providers(toy_dir):
    with pytest.raises(ProviderError, match="unknown provider 'npu'"):
        spectr_edge.load(toy_dir, provider="npu")
    from spectr_edge.onnx_model import available_providers
    if "cuda" not in available_providers():
        with pytest.raises(ProviderError, match="'cuda' was requested but is not available"):
            spectr_edge.load(toy_dir, provider="cuda")
    # auto falls back to the CPU here and works; the draft may use another provider than the target
    g = spectr_edge.load(toy_dir, provider="auto", draft_provider="cpu")
    assert g.target.provider in ("CPU", "CUDA", "Tensorrt") and g.draft.provider == "CPU"


def test_no_draft_bundle_and_no_draft_option(toy_dir, tmp_path):
    bundle = _edited_copy(toy_dir, tmp_path / "target-only", lambda m: m["models"].pop("draft"))
    g = spectr_edge.load(bundle, provider="cpu")
    assert g.generate_ids([1], max_new_tokens=3).stats.num_candidates == 0
    with pytest.raises(InputError, match="no draft model"):
        g.generate_ids([1], max_new_tokens=3, num_candidates=1)
    g2 = spectr_edge.load(toy_dir, provider="cpu", load_draft=False)
    assert g2.draft is None


def test_adaptive_draft_length_stops_early(gen):
    """With a high confidence threshold the draft stops before draft_len: fewer draft calls."""
    full = gen.generate_ids([1, 2], max_new_tokens=30, temperature=1.0, num_candidates=1, draft_len=5, seed=4)
    short = gen.generate_ids([1, 2], max_new_tokens=30, temperature=1.0, num_candidates=1, draft_len=5, seed=4,
                             draft_stop=0.95)
    assert short.stats.drafted / short.stats.steps < 0.5 * full.stats.drafted / full.stats.steps


def test_lookup_table_missing_or_corrupt(toy_dir, tmp_path):
    entry = {"file": "lookup_table.npz", "source": "test"}
    bundle = _edited_copy(toy_dir, tmp_path / "no_table", lambda m: m.update(lookup_table=entry))
    with pytest.raises(BundleError, match="lookup table .* is missing; rebuild it with spectr-edge export "
                                         "--add-lookup-table"):
        spectr_edge.load(bundle, provider="cpu")
    (bundle / "lookup_table.npz").write_bytes(b"PK\x03\x04 not a zip archive")
    with pytest.raises(BundleError, match="lookup table .* is corrupt"):
        spectr_edge.load(bundle, provider="cpu")
    bundle = _edited_copy(toy_dir, tmp_path / "bad_entry", lambda m: m.update(lookup_table="yes"))
    with pytest.raises(BundleError, match="lookup_table is malformed"):
        spectr_edge.load(bundle, provider="cpu")


def test_top_ids_is_the_stable_top_k_and_leaves_the_logits_alone():
    """trees.top_ids (the draft tree's branching and greedy side leaves): the ids of argsort(-x,
    stable)[:k] per row, ties to the lower id, for rows with ties, -inf entries and a row that is
    all -inf; the input comes back bit-identical, and a read-only input works."""
    from spectr_edge.trees import top_ids

    rng = np.random.default_rng(5)
    x = rng.integers(-4, 5, (6, 50)).astype(np.float32)           # many ties
    x[1, ::3] = -np.inf
    x[2] = -np.inf
    before = x.copy()
    for k in (1, 4, 9):
        got = top_ids(x, k)
        want = np.argsort(-x, axis=-1, kind="stable")[:, :k]
        assert got.shape == (6, k) and np.array_equal(got[[0, 1, 3, 4, 5]], want[[0, 1, 3, 4, 5]]), k
        assert np.array_equal(x, before)
    x.flags.writeable = False
    assert top_ids(x[0], 3).tolist() == np.argsort(-before[0], kind="stable")[:3].tolist()


def test_huge_pages_keep_memory_intact():
    """A 64 MiB array moved into huge pages holds the same bytes; what the kernel accepted is whole 2 MiB
    pages of this process's anonymous memory and shows in its AnonHugePages (where MADV_COLLAPSE exists)."""
    from spectr_edge.huge_pages import HUGE, back_with_huge_pages, huge_page_bytes

    data = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
    before = data.copy()
    accepted = back_with_huge_pages(min_bytes=32 << 20)
    assert accepted % HUGE == 0
    assert np.array_equal(data, before)
    if accepted:
        assert huge_page_bytes() > 0


def test_huge_pages_option(toy_dir):
    """huge_pages=False loads without the advice, greedy output is the same either way, and a value that
    is not a bool is a one-line error."""
    bundle = toy_dir
    with_pages = spectr_edge.load(bundle, provider="cpu", huge_pages=True).generate_ids([1, 2, 3], max_new_tokens=12)
    without = spectr_edge.load(bundle, provider="cpu", huge_pages=False).generate_ids([1, 2, 3], max_new_tokens=12)
    assert with_pages.token_ids == without.token_ids
    with pytest.raises(InputError, match="huge_pages must be true or false"):
        spectr_edge.load(bundle, provider="cpu", huge_pages="yes")


def test_huge_pages_default_follows_the_target_quantization(toy_dir, monkeypatch):
    """Unset, huge_pages asks for 2 MiB pages for a quantized target only (a float32 target's weights take
    long to move for little gain); True and False are obeyed whatever the target."""
    import dataclasses

    import spectr_edge.generator as generator
    from spectr_edge.bundle import read_bundle

    asked = []
    real = generator.back_with_huge_pages
    monkeypatch.setattr(generator, "back_with_huge_pages", lambda: asked.append(1) or real())
    plain = read_bundle(toy_dir)
    quantized = dataclasses.replace(plain, target=dataclasses.replace(plain.target, quant="int8"))
    assert plain.target.quant == "none"
    for bundle, option, expected in [(plain, None, 0), (quantized, None, 1), (plain, True, 1), (quantized, False, 0)]:
        asked.clear()
        generator.Generator(bundle, provider="cpu", huge_pages=option)
        assert len(asked) == expected, (bundle.target.quant, option)
