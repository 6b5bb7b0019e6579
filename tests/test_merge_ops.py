"""Merged projections and residual adds inside the norms (export/merge_ops.py).

A hand-built decoder layer (the exported patterns: Q, K, V with biases packed by a Concat, the
MLP's gate and up, the RMS norm as Pow/ReduceMean/Add/Sqrt/Div/Mul after a residual Add) is
rewritten and run by ONNX Runtime before and after, in float32 and quantized to int4 MatMulNBits:
the outputs must be bit-identical for the merges (each output column is computed alone) and within
float rounding for the norm kernel. The tiny bundles are exported with the rewrites; a bundle made
without them is upgraded in place and decodes exactly as before.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter

import numpy as np
import pytest

HIDDEN, KV, FFN = 64, 32, 96


def _layer_graph(path, rng):
    """x, r -> h = x + r -> RMS norm -> y; outputs Q, K, V of y (+ biases) packed, and h + down(SiLU(gate) * up)
    of h (a real layer's MLP reads the next norm: here h, so that its products are a group of their own)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def w(name, *shape):
        return numpy_helper.from_array(rng.normal(0, 0.2, shape).astype(np.float32), name)

    def c(name, value):
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, np.float32)))

    inits = [w("Wq", HIDDEN, HIDDEN), w("Wk", HIDDEN, KV), w("Wv", HIDDEN, KV), w("bq", HIDDEN), w("bk", KV),
             w("bv", KV), w("Wg", HIDDEN, FFN), w("Wu", HIDDEN, FFN), w("Wd", FFN, HIDDEN), w("gamma", HIDDEN),
             numpy_helper.from_array(np.array([-1], np.int64), "axes")]
    n = helper.make_node
    nodes = [
        n("Add", ["x", "r"], ["h"]), n("Cast", ["h"], ["hf"], to=TensorProto.FLOAT),
        c("two", 2.0), c("eps", 1e-6), c("one", 1.0),
        n("Pow", ["hf", "two"], ["sq"]), n("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
        n("Add", ["ms", "eps"], ["mse"]), n("Sqrt", ["mse"], ["rms"]), n("Div", ["one", "rms"], ["inv"]),
        n("Mul", ["hf", "inv"], ["normed"]), n("Cast", ["normed"], ["normed_f"], to=TensorProto.FLOAT),
        n("Mul", ["gamma", "normed_f"], ["y"]),
        n("MatMul", ["y", "Wq"], ["q0"]), n("Add", ["q0", "bq"], ["q"]),
        n("MatMul", ["y", "Wk"], ["k0"]), n("Add", ["k0", "bk"], ["k"]),
        n("MatMul", ["y", "Wv"], ["v0"]), n("Add", ["v0", "bv"], ["v"]),
        n("Concat", ["q", "k", "v"], ["qkv"], axis=-1),
        n("MatMul", ["hf", "Wg"], ["g"]), n("Sigmoid", ["g"], ["sg"]), n("Mul", ["g", "sg"], ["silu"]),
        n("MatMul", ["hf", "Wu"], ["u"]), n("Mul", ["silu", "u"], ["act"]), n("MatMul", ["act", "Wd"], ["mlp"]),
        n("Add", ["hf", "mlp"], ["out"]),          # the residual path reads the sum
    ]
    io = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, "s", HIDDEN]) for name in ("x", "r")]
    outs = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("out", TensorProto.FLOAT, None)]
    model = helper.make_model(helper.make_graph(nodes, "layer", io, outs, inits),
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(path))
    return path


def _run(path, feed):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"]).run(["qkv", "out"], feed)


def _rewrite(src, dst, merge=True, norms=True):
    import onnx

    from spectr_edge_export.tree_mask import fewer_ops

    model = onnx.load(str(src), load_external_data=False)
    weights, count = fewer_ops(model, src, dst, log=lambda _: None) if merge else (None, 0)
    if not merge and norms:
        from spectr_edge_export.merge_ops import fuse_skip_norms
        count = fuse_skip_norms(model)
    if weights is not None:
        weights.commit()
    onnx.save(model, str(dst))
    return model, count


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_merged_layer_computes_the_same_numbers(tmp_path, quant):
    from spectr_edge_export import quantize

    rng = np.random.default_rng(0)
    src = _layer_graph(tmp_path / "layer.onnx", rng)
    if quant == "int4":
        q = tmp_path / "int4" / "layer.onnx"
        q.parent.mkdir()
        quantize.quantize(src, q, "int4", 32)
        src = q
    feed = {"x": rng.normal(size=(1, 5, HIDDEN)).astype(np.float32),
            "r": rng.normal(size=(1, 5, HIDDEN)).astype(np.float32)}
    before = _run(src, feed)

    merged, count = _rewrite(src, src.with_name("merged.onnx"), merge=True)
    ops = Counter(n.op_type for n in merged.graph.node)
    product = "MatMul" if quant == "none" else "MatMulNBits"
    assert count == 3 and ops[product] == 3 and ops["Concat"] == 0          # QKV, gate/up, down; one norm
    assert ops["SkipSimplifiedLayerNormalization"] == 1 and ops["ReduceMean"] == 0
    # the stacked weights live in the new graph's own file; the old ones are not read
    assert (src.parent / "merged.onnx.data").exists()
    after = _run(src.with_name("merged.onnx"), feed)
    np.testing.assert_allclose(after[0], before[0], rtol=1e-6, atol=1e-5)   # the norm kernel rounds its own way
    np.testing.assert_allclose(after[1], before[1], rtol=1e-6, atol=1e-5)

    # the merges alone (norm as exported) are exact: each output column is computed by itself
    src_norm, _ = _rewrite(src, src.with_name("norm.onnx"), merge=False, norms=True)
    both, _ = _rewrite(src.with_name("norm.onnx"), src.with_name("both.onnx"), merge=True)
    exact_before, exact_after = _run(src.with_name("norm.onnx"), feed), _run(src.with_name("both.onnx"), feed)
    assert np.array_equal(exact_after[0], exact_before[0]) and np.array_equal(exact_after[1], exact_before[1])


def test_shared_weights_and_other_readers_are_left_alone(tmp_path):
    """A weight read twice (a tied head) is never stacked; a split output read elsewhere keeps the Split."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.normal(size=(8, 8)).astype(np.float32), "W")
    v = numpy_helper.from_array(rng.normal(size=(8, 4)).astype(np.float32), "V")
    u = numpy_helper.from_array(rng.normal(size=(8, 4)).astype(np.float32), "U")
    n = helper.make_node
    nodes = [n("MatMul", ["x", "W"], ["a"]), n("MatMul", ["a", "W"], ["b"]),       # W read twice
             n("MatMul", ["x", "V"], ["p"]), n("MatMul", ["x", "U"], ["q"]),
             n("Concat", ["p", "q"], ["pq"], axis=-1), n("Relu", ["p"], ["p2"])]     # p read by two nodes
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 8])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("b", "pq", "p2")],
                              [w, v, u])
    src = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(src))
    model, count = _rewrite(src, tmp_path / "m.onnx")
    ops = Counter(node.op_type for node in model.graph.node)
    assert count == 1 and ops["MatMul"] == 3 and ops["Split"] == 1 and ops["Concat"] == 1
    x = {"x": rng.normal(size=(1, 2, 8)).astype(np.float32)}
    import onnxruntime as ort
    before = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, x)
    after = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, x)
    for a, b in zip(after, before):
        assert np.array_equal(a, b)


def test_tiny_bundles_are_exported_with_fewer_ops(tiny_qwen_bundle):
    import onnx

    manifest = json.loads((tiny_qwen_bundle / "spectr.json").read_text())
    for role, entry in manifest["models"].items():
        graph = onnx.load(str(tiny_qwen_bundle / entry["file"]), load_external_data=False).graph
        own = [node for node in graph.node if not node.name.startswith("/guess_head/")]
        ops = Counter(node.op_type for node in own)
        layers = entry["num_layers"]
        assert ops["MatMul"] + ops["MatMulNBits"] == 4 * layers + 1     # QKV, output, gate+up, down; the LM head
        assert ops["SkipSimplifiedLayerNormalization"] == 2 * layers      # all but the first layer's input norm
        assert ops["Concat"] == 0                                        # Q, K, V come packed from one product


def test_a_bundle_made_before_the_merge_is_upgraded_in_place(tiny_bundle, tmp_path):
    """A bundle fused and folded without the merges gets them from `export --add-tree-mask`: a new graph
    with its own weights file (model.merged.onnx), the old graph's files removed, the same greedy tokens."""
    import spectr_edge
    from spectr_edge_export.tree_mask import add_tree_mask_to_bundle

    out = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, out, copy_function=os.link)     # hard links, as bench/quant_twin.py's twins
    add_tree_mask_to_bundle(out, log=lambda _: None, merge=False)
    before_files = {role: sorted(p.name for p in (out / role).iterdir()) for role in ("target", "draft")}
    assert add_tree_mask_to_bundle(out, log=lambda _: None) == ["target", "draft"]
    manifest = json.loads((out / "spectr.json").read_text())
    for role, entry in manifest["models"].items():
        assert entry["file"] == f"{role}/model.merged.onnx"
        names = sorted(p.name for p in (out / role).iterdir())
        # the new graph and its weights; the old graph's files are gone, the others are kept
        assert {n for n in names if n.startswith("model.")} == {"model.merged.onnx", "model.merged.onnx.data"}
        assert {n for n in before_files[role] if not n.startswith("model.")} <= set(names)
        assert entry["size_bytes"] == sum((out / role / n).stat().st_size for n in names
                                          if n.startswith("model.merged"))
    assert add_tree_mask_to_bundle(out, log=lambda _: None) == []          # nothing more to merge
    prompt = [5, 6, 7, 8, 9]
    plain = spectr_edge.load(tiny_bundle, provider="cpu").generate_ids(
        prompt, max_new_tokens=24, temperature=0, num_candidates=0).token_ids
    upgraded = spectr_edge.load(out, provider="cpu")
    assert upgraded.generate_ids(prompt, max_new_tokens=24, temperature=0, num_candidates=0).token_ids == plain
    assert upgraded.generate_ids(prompt, max_new_tokens=24, temperature=0, draft_len=3).token_ids == plain
