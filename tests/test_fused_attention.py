"""Fused attention (export/fuse_attention.py) and in-place cache buffers (kv_cache.BufferKVCache).

The tiny-qwen bundle's graphs are exported through the real path, which fuses their
attention into GroupQueryAttention. The same graph also runs in ONNX Runtime's
non-shared mode (past and present separate, cache concatenated per call: `KVCache`), so
the in-place path is checked against it call for call, through every cache operation
speculation uses (crop, gather of a tree path, repeat rows / keep row, growth of the
buffers), and against the unfused graph of the same weights.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from spectr_edge.bundle import read_bundle
from spectr_edge.device import GraphDevice, HostDevice
from spectr_edge.kv_cache import BufferKVCache, KVCache

# the CPU's own cache operations, and the device graphs a GPU runs (here on the CPU)
DEVICES = pytest.mark.parametrize("device", [HostDevice(), GraphDevice("cpu")], ids=["host", "graph"])
from spectr_edge.onnx_model import OnnxLM


@pytest.fixture(scope="module")
def target(tiny_qwen_bundle):
    return OnnxLM(read_bundle(tiny_qwen_bundle).target, provider="cpu", threads=1)


@pytest.fixture(scope="module")
def draft(tiny_qwen_bundle):
    return OnnxLM(read_bundle(tiny_qwen_bundle).draft, provider="cpu", threads=1)


def test_tiny_bundle_graphs_are_fused(tiny_qwen_bundle, target, draft):
    import onnx

    manifest = json.loads((tiny_qwen_bundle / "spectr.json").read_text())
    for role, model in (("target", target), ("draft", draft)):
        entry = manifest["models"][role]
        assert entry["attention"] == "gqa" and model.in_place
        assert isinstance(model.new_cache(), BufferKVCache)
        graph = onnx.load(str(tiny_qwen_bundle / entry["file"]), load_external_data=False).graph
        ops = [n.op_type for n in graph.node]
        assert ops.count("GroupQueryAttention") == entry["num_layers"]
        assert "Softmax" not in ops                               # the unfused attention is gone
        past = {n for kv in entry["inputs"]["past"] for n in kv}
        readers = {n.op_type for n in graph.node if past & set(n.input)}
        assert readers == {"GroupQueryAttention"}                 # nothing else touches the cache
        # the rotary embedding is inside the kernel (export/fuse_rotary.py): only it reads the positions
        assert entry["rotary"] == "gqa" and model.spec.rotary == "gqa"
        positions = entry["inputs"]["position_ids"]
        assert {n.op_type for n in graph.node if positions in n.input} == {"GroupQueryAttention"}


def test_a_call_with_an_empty_cache_is_placed_from_position_zero(target):
    with pytest.raises(ValueError, match="empty cache"):
        target.forward(np.asarray([[1, 2, 3]]), target.new_cache(), np.tri(3, dtype=bool), np.array([0, 1, 1]))


def _step(model, caches, ids, tree=None, depth=None):
    """The same call on every cache; returns the logits, which must agree."""
    outs = [model.forward(np.asarray([ids], dtype=np.int64), c, tree, depth) for c in caches]
    for other in outs[1:]:
        np.testing.assert_allclose(other, outs[0], rtol=0, atol=2e-5)
    return outs[0]


@DEVICES
def test_in_place_buffers_match_concatenated_cache(target, device):
    spec = target.spec
    plain = KVCache(device, spec.num_layers, spec.num_kv_heads, spec.head_dim)
    buffered = BufferKVCache(device, spec.num_layers, spec.num_kv_heads, spec.head_dim, capacity=4)  # forces growth
    caches = [plain, buffered]
    rng = np.random.default_rng(0)
    _step(target, caches, rng.integers(0, 400, 7).tolist())                  # prefill: 7 > capacity 4
    assert buffered.capacity >= 7 and buffered.length == plain.length == 7
    for _ in range(3):                                                        # decode
        _step(target, caches, [int(rng.integers(0, 400))])
    # a verification call of 4 tokens, 2 of them rejected: roll back
    _step(target, caches, rng.integers(0, 400, 4).tolist())
    for c in caches:
        c.crop(c.length - 2)
    _step(target, caches, [5])
    # a tree call: root r, children a, b of r, c child of a; accept r, b (not contiguous)
    tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)
    past = plain.length
    _step(target, caches, [11, 12, 13, 14], tree, np.array([0, 1, 1, 2]))
    for c in caches:
        c.gather(past, past + np.array([0, 2]))
    assert buffered.length == plain.length == past + 2
    for a, b in zip(plain.host_layers(), buffered.host_layers()):
        np.testing.assert_allclose(b[0], a[0], atol=2e-5)
        np.testing.assert_allclose(b[1], a[1], atol=2e-5)
    for _ in range(300):                                                      # past the grown capacity
        _step(target, caches, [int(rng.integers(0, 400))])
    assert buffered.capacity >= buffered.length == plain.length


@DEVICES
def test_in_place_rows_for_draft_candidates(draft, device):
    """Draft k candidates: prefill in batch 1, then k rows of one token each, keep a row, roll back."""
    spec = draft.spec
    caches = [KVCache(device, spec.num_layers, spec.num_kv_heads, spec.head_dim),
              BufferKVCache(device, spec.num_layers, spec.num_kv_heads, spec.head_dim, capacity=8)]
    _step(draft, caches, [3, 1, 4, 1, 5, 9])
    for c in caches:
        c.repeat_rows(3)
    for token in ([[2], [6], [5]], [[3], [5], [8]]):
        outs = [draft.forward(np.asarray(token, dtype=np.int64), c) for c in caches]
        np.testing.assert_allclose(outs[1], outs[0], atol=2e-5)
    for c in caches:
        c.keep_row(1)
        c.crop(7)
    assert caches[1].batch == 1 and caches[1].length == 7
    _step(draft, caches, [6, 5])                                             # catch-up in batch 1
    with pytest.raises(ValueError, match="batch 1 only"):
        caches[1].repeat_rows(2)
        draft.forward(np.asarray([[1, 2], [3, 4]], dtype=np.int64), caches[1])


def test_folding_the_rotary_into_a_bundle_fused_without_it(tiny_bundle, tmp_path):
    """A bundle whose attention was fused before the rotary embedding could be folded into it is
    upgraded in place (model.rotary.onnx) and decodes and scores a tree like the unfused original."""
    import spectr_edge
    from spectr_edge_export.fuse_rotary import fold_rotary
    from spectr_edge_export.tree_mask import add_tree_mask_to_bundle
    from spectr_edge.errors import ExportError

    import onnx
    import shutil

    out = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, out)
    add_tree_mask_to_bundle(out, log=lambda _: None, fold=False)
    entry = json.loads((out / "spectr.json").read_text())["models"]["target"]
    assert entry["attention"] == "gqa" and "rotary" not in entry
    lines = []
    assert add_tree_mask_to_bundle(out, log=lines.append) == ["target", "draft"]
    assert any("folding the rotary embedding" in line for line in lines), lines
    manifest = json.loads((out / "spectr.json").read_text())
    for role, entry in manifest["models"].items():
        assert entry["rotary"] == "gqa" and entry["file"] == f"{role}/model.rotary.onnx"
        assert not (out / role / "model.gqa.onnx").exists()
        model = onnx.load(str(out / entry["file"]), load_external_data=False)
        with pytest.raises(ExportError, match="already folded"):
            fold_rotary(model, entry["inputs"]["position_ids"], entry["context_length"])
    assert add_tree_mask_to_bundle(out, log=lambda _: None) == []
    before, after = spectr_edge.load(tiny_bundle, provider="cpu"), spectr_edge.load(out, provider="cpu")
    prompt = [5, 6, 7, 8, 9]
    plain = before.generate_ids(prompt, max_new_tokens=24, temperature=0, num_candidates=0).token_ids
    assert after.generate_ids(prompt, max_new_tokens=24, temperature=0, branches=2, draft_len=3).token_ids == plain


def test_fusing_twice_is_refused(tiny_qwen_bundle):
    """(The fused graph's logits against the unfused one's are checked by every export, see
    export/tree_mask.check_tree_graph, and by test_tree's upgraded-bundle decoding test.)"""
    import onnx

    from spectr_edge_export.fuse_attention import fuse_attention
    from spectr_edge.errors import ExportError

    entry = json.loads((tiny_qwen_bundle / "spectr.json").read_text())["models"]["target"]
    model = onnx.load(str(tiny_qwen_bundle / entry["file"]), load_external_data=False)
    with pytest.raises(ExportError, match="already fused"):
        fuse_attention(model, entry["inputs"]["past"], entry["outputs"]["present"], entry["head_dim"],
                       entry["num_kv_heads"], entry["tree_mask"])


@DEVICES
def test_buffer_cache_operations(device):
    cache = BufferKVCache(device, num_layers=1, num_kv_heads=2, head_dim=3, capacity=4)

    cache.values = [device.from_host(np.broadcast_to(np.arange(4, dtype=np.float32)[None, None, :, None],
                                                     (1, 2, 4, 3))) for _ in cache.values]
    cache.commit(4)                                                           # position p holds p
    cache.reserve(9)                                                          # grows, keeps the valid part
    assert cache.capacity >= 9 and cache.host_layers()[0][0][0, 0, :, 0].tolist() == [0, 1, 2, 3]
    cache.gather(1, np.array([2, 3]))                                         # keep 0, then 2, 3
    assert cache.length == 3 and cache.host_layers()[0][1][0, 1, :, 0].tolist() == [0, 2, 3]
    cache.repeat_rows(2)
    rows = device.to_host(cache.values[0]).copy()
    rows[1, :, :3] += 10
    cache.values = [device.from_host(rows)] + cache.values[1:]
    cache.keep_row(1)
    assert cache.batch == 1 and cache.host_layers()[0][0][0, 0, :, 0].tolist() == [10, 12, 13]
    assert all(device.to_host(v).flags.c_contiguous for v in cache.values)
    with pytest.raises(ValueError):
        cache.crop(4)
