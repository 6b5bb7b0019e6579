"""Weight quantization of an exported graph with onnxruntime.quantization.

    quantize(src, dst, "int8" | "int4")

int8: MatMulNBits with 8-bit weights, 128 per block with a scale and a zero point, accuracy_level
4 (int8 activations quantized per row and block inside the kernel), since stop 16. Before, int8 was
quantize_dynamic (MatMulInteger after DynamicQuantizeLinear), whose activation scale is one per
tensor, i.e. per call over all its rows: a token's logits then depended on the other tokens scored
with it, so speculative greedy output drifted from target-only greedy (74 of 96 generations on
the 1.5B target differed, bench/RESULTS.md section 00000000). MatMulNBits keeps rows independent
(the same padding rules as int4 make every call compute the same numerics).
int4: MatMulNBits (accuracy_level 4: int8 activations in the kernel), by default 128 weights per
block with a scale and a zero point each (the "g128" layout of GPTQ/AWQ checkpoints). On the 2-core
CPU a decode of the 1.5B target costs 35 ms at block 128 against 47 ms at block 32 (symmetric, the
layout before stop 12), for +0.5% perplexity (bench/RESULTS.md section 0000).
Before either, a tied lm_head (exported as MatMul(x, Transpose(embedding))) gets its own
weight, W^T as a new initializer, so the quantizers (which only take constant weights)
quantize it too; the embedding Gather keeps the original table.
Graphs over ~1.8 GB of weights are saved with external data (model.onnx.data).
"""

from __future__ import annotations

import gc
import logging
from contextlib import contextmanager
from pathlib import Path

from spectr_edge.errors import ExportError

QUANTS = ("none", "int8", "int4")
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


def _weight_bytes(model) -> int:
    return sum(len(t.raw_data) for t in model.graph.initializer)


def min_call_tokens(path: Path) -> int:
    """2 when the graph's MatMulNBits (int4 or, since stop 16, int8 weights) compute with int8
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
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    if any(a.name == "accuracy_level" and a.i >= 4 for n in nbits for a in n.attribute):
        return 2
    return 1


def check_block_size(block_size: int) -> None:
    if block_size not in INT4_BLOCK_SIZES:
        raise ExportError(f"int4 block size {block_size} is not supported; choose one of "
                          f"{', '.join(map(str, INT4_BLOCK_SIZES))}")


def call_token_multiple(path: Path) -> int:
    """2 when min_call_tokens is 2: the same kernel computes activation rows in pairs, and the lone
    last row of an odd-sized call takes the 1-row path (measured on the 1.5B target with 128-weight
    blocks and zero points: the 3rd token of a 3-token call moved by 0.27 against a 4-token call;
    with 32-weight symmetric blocks it did not, but the pairing is the kernel's). The runtime pads
    batch-1 calls to an even count."""
    return min_call_tokens(path)


def quantize(src: Path, dst: Path, quant: str, block_size: int = INT4_BLOCK_SIZE,
             symmetric: bool = INT4_SYMMETRIC) -> int:
    """Write the quant-bit version of src to dst (same I/O); return how many lm_heads were untied.

    block_size, symmetric: int4 only: weights per scale (32, 64, 128 or 256); without symmetric,
    each block also stores a zero point.
    """
    import onnx

    if quant not in ("int8", "int4"):
        raise ExportError(f"unknown quantization {quant!r}; choose one of {', '.join(QUANTS)}")
    check_block_size(block_size)
    model = onnx.load(str(src))
    untied = untie_lm_head(model)
    large = _weight_bytes(model) > EXTERNAL_DATA_BYTES
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    MatMulNBitsQuantizer = _import_nbits()
    bits, block = (4, block_size) if quant == "int4" else (8, INT8_BLOCK_SIZE)
    q = MatMulNBitsQuantizer(model, bits=bits, block_size=block, is_symmetric=symmetric,
                             accuracy_level=INT4_ACCURACY_LEVEL)
    with _quiet_root_logger():
        q.process()
    del model
    gc.collect()
    q.model.save_model_to_file(str(dst), use_external_data_format=large)
    return untied
