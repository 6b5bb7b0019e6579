"""Quantization of an exported graph: weights (onnxruntime.quantization's MatMulNBits), or weights and
activations (w8a8, written here).

    quantize(src, dst, "int8" | "int4" | "w8a8")

int8: MatMulNBits with 8-bit weights, 128 per block with a scale and a zero point, accuracy_level
4 (int8 activations quantized per row and block inside the kernel). onnxruntime's quantize_dynamic
(MatMulInteger after DynamicQuantizeLinear) is not used: its activation scale is one per tensor,
i.e. per call over all its rows, so a token's logits would depend on the other tokens scored with
it and speculative greedy output would drift from target-only greedy (74 of 96 generations on the
1.5B target differed, bench/RESULTS.md). MatMulNBits keeps rows independent (the same padding
rules as int4 make every call compute the same numerics).
int4: MatMulNBits (accuracy_level 4: int8 activations in the kernel), by default 128 weights per
block with a scale and a zero point each (the "g128" layout of GPTQ/AWQ checkpoints). On the 2-core
CPU a decode of the 1.5B target costs 35 ms at block 128 against 47 ms at block 32 (symmetric), for
+0.5% perplexity (bench/RESULTS.md, 2026-12-01).
w8a8: int8 weights (one scale per output column) and int8 activations (one scale
per token row), multiplied by MatMulInteger, whose integer sums are exact (int8_rowwise), with
activation outliers first moved into the weights (SmoothQuant, alpha 0.5, statistics from 1,024
tokens of standard-library source: activation_maxima). On the 2-core CPU it decodes the 1.5B
target faster than 8-bit MatMulNBits (70 against 85-96 ms), its prefill is 2.4x faster than
int4's, and its cost curve is flat (8 tokens in one call: 1.13x a decode), which is what
speculation needs; accuracy sits between int8 and int4 (KL from float32 0.013; 0.030 without
the smoothing; int8 0.0045, int4 0.099).
Before any of them, a tied lm_head (exported as MatMul(x, Transpose(embedding))) gets its own
weight, W^T as a new initializer, so the quantizers (which only take constant weights)
quantize it too; the embedding Gather keeps the original table.
Graphs over ~1.8 GB of weights are saved with external data (model.onnx.data).
"""

from __future__ import annotations

import gc
import logging
import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from spectr_edge.errors import ExportError

QUANTS = ("none", "int8", "int4", "w8a8")
INT4_BLOCK_SIZE = 128
INT4_BLOCK_SIZES = (32, 64, 128, 256)
INT4_SYMMETRIC = False   # a zero point per block: better accuracy at the same speed
INT4_ACCURACY_LEVEL = 4
INT8_BLOCK_SIZE = 128
EXTERNAL_DATA_BYTES = 1_800_000_000  # protobuf caps a single file at 2 GB


def untie_lm_head(model) -> int:
    """Give each MatMul fed by Transpose(initializer) its own transposed initializer; return how many."""
    import numpy as np
    from onnx import numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    done = 0
    for node in list(graph.node):
        if node.op_type != "MatMul" or len(node.input) != 2:
            continue
        tr = producer.get(node.input[1])
        if tr is None or tr.op_type != "Transpose" or tr.input[0] not in inits:
            continue
        w = numpy_helper.to_array(inits[tr.input[0]])  # [vocab, hidden]
        perm = next((list(a.ints) for a in tr.attribute if a.name == "perm"), None)
        if w.ndim != 2 or perm not in (None, [1, 0]):
            continue
        name = f"{tr.input[0]}.lm_head_T"
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w.T), name))  # [hidden, vocab]
        node.input[1] = name
        consumers[tr.output[0]].remove(node)
        if not consumers[tr.output[0]] and tr.output[0] not in {o.name for o in graph.output}:
            graph.node.remove(tr)
        done += 1
    return done


@contextmanager
def _quiet_root_logger():
    """onnxruntime.quantization logs advice through the root logger (which configures it); keep it silent."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    root.handlers[:] = [logging.NullHandler()]
    try:
        yield
    finally:
        root.setLevel(level)
        root.handlers[:] = handlers


def _import_nbits():
    """MatMulNBitsQuantizer, undoing the logging.basicConfig(level=INFO) its module runs on import."""
    with _quiet_root_logger():
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    return MatMulNBitsQuantizer


def load_with_weights(path: Path):
    """onnx.load with the external data read in, also when that data file is hard-linked (bundle twins
    share their weights by hard links, which onnx's own loader refuses as a potential attack)."""
    import onnx
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    files: dict[str, object] = {}
    for tensor in _get_all_tensors(model):   # initializers and Constant nodes' values
        if not uses_external_data(tensor):
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = (path.parent / info["location"]).resolve()
        if path.parent.resolve() not in location.parents:
            raise ExportError(f"{path}: tensor {tensor.name} points outside its folder ({info['location']})")
        f = files.get(str(location)) or files.setdefault(str(location), open(location, "rb"))
        f.seek(int(info.get("offset", 0)))
        tensor.raw_data = f.read(int(info["length"])) if "length" in info else f.read()
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT
    for f in files.values():
        f.close()
    return model


def _weight_bytes(model) -> int:
    return sum(len(t.raw_data) for t in model.graph.initializer)


def min_call_tokens(path: Path) -> int:
    """2 when the graph's MatMulNBits (int4 or int8 weights) compute with int8
    activations (accuracy_level 4), else 1.

    ONNX Runtime's CPU kernel then takes another path for a 1-row call than for 2 or more rows
    (measured on the 1.5B int4 target: the same token's logits move by 0.17 between a 1-token call
    and any longer one, and are bit-identical across 2, 3, ..., 16), so greedy speculative output
    would drift from 1-token decoding at near-ties. The runtime pads 1-token calls of such a target
    to 2 (spectr_edge/onnx_model.py), which makes every call use the same numerics.
    The int8 of older bundles (DynamicQuantizeLinear) scales activations per call over all rows:
    padding cannot fix that (the runtime warns about such bundles, spectr_edge/generator.py).
    """
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    if any(n.op_type == "DynamicQuantizeLinear" for n in graph.node):
        return 1
    return 2 if quantizes_activations(graph) else 1


def quantizes_activations(graph) -> bool:
    """Whether the graph quantizes activations inside itself: int8 dynamic (DynamicQuantizeLinear),
    w8a8 (MatMulInteger) or MatMulNBits with int8 compute (accuracy_level >= 4). Their kernels or
    the rounding to int8 make a token's logits move with the shape of the call it is scored in."""
    for n in graph.node:
        if n.op_type in ("DynamicQuantizeLinear", "MatMulInteger"):
            return True
        if n.op_type == "MatMulNBits" and any(a.name == "accuracy_level" and a.i >= 4 for a in n.attribute):
            return True
    return False


def check_block_size(block_size: int) -> None:
    if block_size not in INT4_BLOCK_SIZES:
        raise ExportError(f"int4 block size {block_size} is not supported; choose one of "
                          f"{', '.join(map(str, INT4_BLOCK_SIZES))}")


def call_token_multiple(path: Path) -> int:
    """2 when min_call_tokens is 2: the same kernel computes activation rows in pairs, and the lone
    last row of an odd-sized call takes the 1-row path (measured on the 1.5B target with 128-weight
    blocks and zero points: the 3rd token of a 3-token call moved by 0.27 against a 4-token call;
    with 32-weight symmetric blocks it did not, but the pairing is the kernel's). The runtime pads
    batch-1 calls to an even count.
    w8a8: 1. Its integer GEMM is exact for any row count; what differs for a lone row are the float
    kernels around it (attention: 1e-5 on the float32 target too), which its per-row activation
    rounding can amplify, hence min_call_tokens 2; rows of 2, 3, ..., 7-token calls were
    bit-identical on the 1.5B target."""
    import onnx

    if _is_w8a8(onnx.load(str(path), load_external_data=False).graph):
        return 1
    return min_call_tokens(path)


def _is_w8a8(graph) -> bool:
    return any(n.op_type == "MatMulInteger" and n.name.startswith("/int8row/") for n in graph.node)


W8A8_SMOOTHING = 0.5          # SmoothQuant's alpha; 0.35 and 0.8 measured worse or no better (2026-12-02)
CALIBRATION_TOKENS = 1024


def calibration_ids(tokenizer_json: Path, tokens: int = CALIBRATION_TOKENS) -> np.ndarray:
    """Token ids of Python standard-library source (collections, argparse, difflib) for w8a8's
    activation statistics; not the text bench/quant_quality.py scores."""
    import argparse
    import collections
    import difflib
    import inspect

    from tokenizers import Tokenizer

    text = "".join(inspect.getsource(m)[:6000] for m in (collections, argparse, difflib))
    return np.asarray(Tokenizer.from_file(str(tokenizer_json)).encode(text).ids[:tokens], np.int64)


def activation_maxima(src: Path, ids: np.ndarray, chunk: int = 512) -> dict:
    """{x: per-channel max |x| [K]} of every input x of a weight MatMul of the graph at src, over
    `ids` scored in chunks from an empty cache (ONNX Runtime, CPU). The graph's other inputs are
    fed by name and shape: attention mask ones, positions, an empty past, a causal tree mask,
    logits_keep 1."""
    import onnx
    import onnxruntime as ort

    src = Path(src)
    model = onnx.load(str(src), load_external_data=False)
    graph = model.graph
    inits = {i.name for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}

    def weight(name: str) -> bool:
        p = producer.get(name)
        return name in inits or (p is not None and p.op_type == "Transpose" and p.input[0] in inits)
    xs = sorted({n.input[0] for n in graph.node if n.op_type == "MatMul" and weight(n.input[1])})
    have = {o.name for o in graph.output}
    graph.output.extend(onnx.helper.make_empty_tensor_value_info(x) for x in xs if x not in have)
    tmp = src.with_name(f"{src.stem}.calibration-{os.getpid()}.onnx")   # beside its external data
    try:
        onnx.save(model, str(tmp))
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        sess = ort.InferenceSession(str(tmp), opts, providers=["CPUExecutionProvider"])
    finally:
        tmp.unlink(missing_ok=True)
    maxima = {x: None for x in xs}
    for lo in range(0, len(ids), chunk):
        part = np.asarray(ids[lo:lo + chunk], np.int64)[None]                       # [1, n]
        n = part.shape[1]
        feeds = {}
        for i in sess.get_inputs():
            dims = i.shape
            if i.name.startswith("past"):
                feeds[i.name] = np.zeros((1, dims[1], 0, dims[3]), np.float32)
            elif "mask" in i.name and len(dims) == 4:
                feeds[i.name] = np.tril(np.ones((n, n), bool))[None, None]
            elif "mask" in i.name:
                feeds[i.name] = np.ones((1, n), np.int64)
            elif "position" in i.name:
                feeds[i.name] = np.arange(n, dtype=np.int64)[None]
            elif i.name == "logits_keep":
                feeds[i.name] = np.array([1], np.int64)
            else:
                feeds[i.name] = part
        for x, v in zip(xs, sess.run(xs, feeds)):
            a = np.abs(v.reshape(-1, v.shape[-1])).max(axis=0)
            maxima[x] = a if maxima[x] is None else np.maximum(maxima[x], a)
    return maxima


def quantize(src: Path, dst: Path, quant: str, block_size: int = INT4_BLOCK_SIZE,
             symmetric: bool = INT4_SYMMETRIC, calibration: np.ndarray | None = None,
             lm_head_bits: int | None = None, accuracy_level: int = INT4_ACCURACY_LEVEL) -> int:
    """Write the quant-bit version of src to dst (same I/O); return how many lm_heads were untied.

    block_size, symmetric: int4 only: weights per scale (32, 64, 128 or 256); without symmetric,
    each block also stores a zero point.
    lm_head_bits: int4 only: 8 quantizes the LM head (the untied embedding) with 8-bit
    MatMulNBits blocks of INT8_BLOCK_SIZE instead; None or 4 keeps it int4 like every other weight.
    accuracy_level: MatMulNBits' compute type (4: int8 activations in the kernel; 1: float32).
    calibration: w8a8 only: token ids whose activation statistics smooth the outliers
    (int8_rowwise's act_max); without them, no smoothing.
    """
    import onnx

    if quant not in ("int8", "int4", "w8a8"):
        raise ExportError(f"unknown quantization {quant!r}; choose one of {', '.join(QUANTS)}")
    check_block_size(block_size)
    if lm_head_bits not in (None, 4, 8) or (lm_head_bits == 8 and quant != "int4"):
        raise ExportError(f"an LM head of {lm_head_bits} bits is not supported; choose 4 or 8 (int4 targets only)")
    act_max = None
    if quant == "w8a8" and calibration is not None and len(calibration):
        act_max = activation_maxima(src, calibration)          # before the weights are in memory
        gc.collect()
    model = load_with_weights(src)
    untied = untie_lm_head(model)
    large = _weight_bytes(model) > EXTERNAL_DATA_BYTES
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if quant == "w8a8":
        int8_rowwise(model, act_max, W8A8_SMOOTHING)
        large = _weight_bytes(model) > EXTERNAL_DATA_BYTES
        onnx.save_model(model, str(dst), save_as_external_data=large, location=dst.name + ".data")
        return untied
    MatMulNBitsQuantizer = _import_nbits()
    bits, block = (4, block_size) if quant == "int4" else (8, INT8_BLOCK_SIZE)
    head = lm_head_node(model) if lm_head_bits == 8 else None
    q = MatMulNBitsQuantizer(model, bits=bits, block_size=block, is_symmetric=symmetric,
                             accuracy_level=accuracy_level, nodes_to_exclude=[head] if head else None)
    with _quiet_root_logger():
        q.process()
    del model
    gc.collect()
    if head:   # the LM head alone, in 8 bits
        q = MatMulNBitsQuantizer(q.model.model, bits=8, block_size=INT8_BLOCK_SIZE, is_symmetric=symmetric,
                                 accuracy_level=accuracy_level, nodes_to_include=[head])
        with _quiet_root_logger():
            q.process()
        gc.collect()
    q.model.save_model_to_file(str(dst), use_external_data_format=large)
    return untied


def lm_head_node(model) -> str | None:
    """The name of the MatMul that computes the logits (the graph output's producer, through at most
    a Reshape or Cast), naming it if it has no name; None when there is none."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    for out in graph.output:
        if out.name != "logits":
            continue
        node = producer.get(out.name)
        while node is not None and node.op_type in ("Reshape", "Cast", "Identity"):
            node = producer.get(node.input[0])
        if node is not None and node.op_type == "MatMul":
            node.name = node.name or "lm_head"
            return node.name
    return None


def int8_rowwise(model, act_max: dict | None = None, alpha: float = 0.5) -> int:
    """Rewrite every MatMul(x, constant W) of `model` in place as an exact int8 GEMM; return how many.

    W [K, N] -> int8 per output column, symmetric (scale = max |W[:, n]| / 127). x [..., K] -> uint8
    per row (per token), symmetric around 128: s = max |x_row| / 127, q = round(x / s) + 128, the
    zero point 128 being one scalar for every row. MatMulInteger then sums integer products exactly,
    and y = float(int32) * s_row * w_col. Nothing in these GEMMs' rows depends on the other rows of
    the call, or on how many there are (unlike MatMulNBits, whose float kernels pair rows); only the
    float kernels around them treat a lone row differently, hence min_call_tokens 2 and
    call_token_multiple 1 for such graphs. MatMuls that read the same x share its quantization
    (q, k, v; gate, up).

    act_max: {x name: per-channel max |x| [K]} measured on calibration text (SmoothQuant): a few
    channels of some activations are 100x their median (the down projections' inputs of Qwen2.5),
    and one scale per row then leaves the others a handful of levels. Each such x is divided by
    m = act_max^alpha / max|W row|^(1 - alpha) (one Mul before its quantization) and W's rows
    multiplied by m: the same product, with the outliers moved into the weights.
    """
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    targets = [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in inits
               and len(inits[n.input[1]].dims) == 2]
    if not targets:
        return 0
    if not any(o.domain in ("", "ai.onnx") and o.version >= 18 for o in model.opset_import):
        raise ExportError("int8 rows need a graph of opset 18 or later (ReduceMax takes its axes as an input)")
    users: dict[str, int] = {}
    for n in graph.node:
        for i in n.input:
            users[i] = users.get(i, 0) + 1
    consts = [numpy_helper.from_array(np.array([-1], np.int64), "int8row.axes"),
              numpy_helper.from_array(np.array(127, np.float32), "int8row.127"),
              numpy_helper.from_array(np.array(1e-30, np.float32), "int8row.tiny"),
              numpy_helper.from_array(np.array(128, np.float32), "int8row.128f"),
              numpy_helper.from_array(np.array(128, np.uint8), "int8row.zp")]
    new_inits = list(consts)
    groups: dict[str, list] = {}                    # x -> the MatMuls reading it, in graph order
    for node in targets:
        groups.setdefault(node.input[0], []).append(node)
    replaced: dict[int, list] = {}                  # id(first MatMul of a group) -> the group's nodes
    k = 0
    for g, (x, members) in enumerate(groups.items()):
        q = f"/int8row/x{g}"
        weights = [numpy_helper.to_array(inits[n.input[1]]).astype(np.float32) for n in members]   # [K, N]
        xin, nodes = x, []
        if act_max and x in act_max:
            wmax = np.max([np.abs(w).max(axis=1) for w in weights], axis=0)                       # [K]
            m = (np.maximum(act_max[x], 1e-5) ** alpha / np.maximum(wmax, 1e-5) ** (1 - alpha)).astype(np.float32)
            weights = [w * m[:, None] for w in weights]
            new_inits.append(numpy_helper.from_array(1.0 / m, q + "/inv_smooth"))
            nodes.append(helper.make_node("Mul", [x, q + "/inv_smooth"], [q + "/smoothed"], name=q + "/Smooth"))
            xin = q + "/smoothed"
        nodes += [helper.make_node("Abs", [xin], [q + "/abs"], name=q + "/Abs"),
                      helper.make_node("ReduceMax", [q + "/abs", "int8row.axes"], [q + "/max"],
                                       keepdims=1, name=q + "/ReduceMax"),
                      helper.make_node("Div", [q + "/max", "int8row.127"], [q + "/s0"], name=q + "/Div0"),
                      helper.make_node("Max", [q + "/s0", "int8row.tiny"], [q + "/s"], name=q + "/Max"),
                      helper.make_node("Div", [xin, q + "/s"], [q + "/xs"], name=q + "/Div"),
                      helper.make_node("Round", [q + "/xs"], [q + "/xr"], name=q + "/Round"),
                      helper.make_node("Add", [q + "/xr", "int8row.128f"], [q + "/xu"], name=q + "/Add"),
                  helper.make_node("Cast", [q + "/xu"], [q + "/q"], to=TensorProto.UINT8, name=q + "/Cast")]
        for node, w in zip(members, weights):
            w_name, p = node.input[1], f"/int8row/{k}"
            k += 1
            scale = np.maximum(np.abs(w).max(axis=0), 1e-30) / 127.0                     # [N]
            wq = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
            new_inits += [numpy_helper.from_array(wq, w_name + ".int8"),
                          numpy_helper.from_array(scale.astype(np.float32), w_name + ".int8_scale")]
            nodes += [helper.make_node("MatMulInteger", [q + "/q", w_name + ".int8", "int8row.zp"], [p + "/i32"],
                                       name=p + "/MatMulInteger"),
                      helper.make_node("Cast", [p + "/i32"], [p + "/f"], to=TensorProto.FLOAT, name=p + "/Cast"),
                      helper.make_node("Mul", [p + "/f", q + "/s"], [p + "/fs"], name=p + "/MulRow"),
                      helper.make_node("Mul", [p + "/fs", w_name + ".int8_scale"], [node.output[0]], name=p + "/MulCol")]
            users[w_name] -= 1
        replaced[id(members[0])] = nodes
        del weights
    dropped = {id(n) for ms in groups.values() for n in ms[1:]}   # emitted with their group's first
    rebuilt = []
    for n in graph.node:
        if id(n) not in dropped:
            rebuilt += replaced.get(id(n), [n])
    del graph.node[:]
    graph.node.extend(rebuilt)
    dead = {name for name, count in users.items() if count == 0}
    keep = [i for i in graph.initializer if i.name not in dead]
    del graph.initializer[:]
    graph.initializer.extend(keep + new_inits)
    return len(targets)
