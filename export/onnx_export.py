"""PyTorch -> ONNX through optimum, the exported graph's I/O, and logits from ORT and PyTorch.

    export_onnx(hf_dir, out_dir)      optimum main_export, task text-generation-with-past -> out_dir/model.onnx
    read_io(model_path, config)       GraphIO: real input/output names and KV layout, checked against config.json
    model_files(model_path)           model.onnx plus the external-data files it references
    ort_logits(model_path, io, ids)   [n, logits_width] float32, prompt run as two calls (second one uses the cache)
    torch_logits(hf_dir, ids)         [n, logits_width] float32 reference
    parity_tolerance(ref)             the float32 bound the ORT logits must meet (see below)

torch, transformers and optimum are imported inside the functions that need them, so an
already-exported ONNX directory is assembled without importing torch.
"""

from __future__ import annotations

import gc
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spectr_edge.errors import ExportError

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_PRESENT = re.compile(r"^present\.(\d+)\.(key|value)$")
_ONNX_FLOAT = {1: "float32", 10: "float16", 16: "bfloat16"}

# Parity bound: float32 kernels differ in summation order, so errors grow with the logits'
# magnitude; 1e-3 of the largest |logit| (at least 1e-3 absolute) is ~50x the usual fp32
# ORT-vs-PyTorch gap yet far below any real export bug (wrong cache, rope or mask: O(1)).
PARITY_REL_TOL = 1e-3


def parity_tolerance(ref: np.ndarray) -> float:
    return PARITY_REL_TOL * max(1.0, float(np.abs(ref).max()))


@dataclass
class GraphIO:
    input_ids: str
    attention_mask: str
    position_ids: str | None
    past: list[tuple[str, str]]  # per layer (key, value) inputs, [batch, kv_heads, past, head_dim]
    logits: str
    present: list[tuple[str, str]]  # per layer (key, value) outputs, [batch, kv_heads, past + new, head_dim]
    num_kv_heads: int
    head_dim: int
    logits_width: int
    dtype: str  # of logits and KV cache


def export_onnx(hf_dir: Path, out_dir: Path) -> Path:
    """Export hf_dir with optimum as one model.onnx with KV cache inputs; return its path."""
    import logging
    import warnings

    from optimum.exporters.onnx import main_export

    for name in ("optimum", "transformers", "torch.onnx"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main_export(str(hf_dir), str(out_dir), task="text-generation-with-past", device="cpu",
                    do_validation=False, library_name="transformers")
    gc.collect()
    path = Path(out_dir) / "model.onnx"
    if not path.exists():
        raise ExportError(f"optimum wrote no model.onnx into {out_dir}; check that {hf_dir} is a causal LM")
    return path


def _dims(value_info) -> list:
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in value_info.type.tensor_type.shape.dim]


def _pairs(names: list[str], pattern: re.Pattern, what: str) -> list[tuple[str, str]]:
    found: dict[int, dict[str, str]] = {}
    for n in names:
        if m := pattern.match(n):
            found.setdefault(int(m.group(1)), {})[m.group(2)] = n
    pairs = []
    for layer in range(len(found)):
        kv = found.get(layer, {})
        if set(kv) != {"key", "value"}:
            raise ExportError(f"the exported graph's {what} for layer {layer} is incomplete ({sorted(kv.values())}); "
                              "re-export with task text-generation-with-past")
        pairs.append((kv["key"], kv["value"]))
    return pairs


def read_io(model_path: Path, config: dict) -> GraphIO:
    """The graph's real I/O names and KV layout; ExportError if the KV cache inputs are missing."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    inits = {i.name for i in graph.initializer}
    inputs = {i.name: i for i in graph.input if i.name not in inits}
    outputs = {o.name: o for o in graph.output}
    for need in ("input_ids", "attention_mask"):
        if need not in inputs:
            raise ExportError(f"{model_path} has no '{need}' input (inputs: {sorted(inputs)}); "
                              "export a decoder with optimum task text-generation-with-past")
    past = _pairs(list(inputs), _PAST, "past_key_values inputs")
    present = _pairs(list(outputs), _PRESENT, "present outputs")
    if not past:
        raise ExportError(f"{model_path} has no past_key_values.N.key/value inputs (inputs: {sorted(inputs)}); "
                          "it was exported without a KV cache: use task text-generation-with-past")
    if "logits" not in outputs or len(present) != len(past):
        raise ExportError(f"{model_path} outputs {sorted(outputs)}: expected logits and present.0..{len(past) - 1}"
                          ".key/value; re-export with task text-generation-with-past")
    layers = config.get("num_hidden_layers")
    if layers is not None and layers != len(past):
        raise ExportError(f"{model_path} has a KV cache for {len(past)} layers but config.json says {layers}; "
                          "the ONNX file and config.json come from different models")
    kv_dims = _dims(inputs[past[0][0]])
    logit_dims = _dims(outputs["logits"])
    if len(kv_dims) != 4 or not isinstance(kv_dims[1], int) or not isinstance(kv_dims[3], int):
        raise ExportError(f"{model_path}: unsupported cache layout {kv_dims} for {past[0][0]}; "
                          "expected [batch, kv_heads, past, head_dim] with fixed kv_heads and head_dim")
    width = logit_dims[-1] if logit_dims and isinstance(logit_dims[-1], int) else config.get("vocab_size")
    if not isinstance(width, int):
        raise ExportError(f"{model_path}: cannot tell the logits width (shape {logit_dims}, no vocab_size in config.json)")
    elem = outputs["logits"].type.tensor_type.elem_type
    if elem not in _ONNX_FLOAT:
        raise ExportError(f"{model_path}: logits have ONNX element type {elem}, expected a float type")
    return GraphIO(
        input_ids="input_ids", attention_mask="attention_mask",
        position_ids="position_ids" if "position_ids" in inputs else None,
        past=past, logits="logits", present=present, num_kv_heads=kv_dims[1], head_dim=kv_dims[3],
        logits_width=width, dtype=_ONNX_FLOAT[elem],
    )


def model_files(model_path: Path) -> list[Path]:
    """model_path and every external-data file its initializers reference (same directory)."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    tensors = list(graph.initializer) + [a.t for node in graph.node for a in node.attribute if a.HasField("t")]
    names = {e.value for t in tensors if t.data_location == onnx.TensorProto.EXTERNAL
             for e in t.external_data if e.key == "location"}
    return [Path(model_path)] + [Path(model_path).parent / n for n in sorted(names)]


def ort_logits(model_path: Path, io: GraphIO, ids: np.ndarray, split: int | None = None) -> np.ndarray:
    """Logits [n, width] for ids [n]: ids[:split] with an empty cache, then the rest on its cache."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
    dtype = {"float32": np.float32, "float16": np.float16}.get(io.dtype, np.float32)
    n = len(ids)
    split = max(1, n - 2) if split is None else split
    cache = {name: np.zeros((1, io.num_kv_heads, 0, io.head_dim), dtype) for kv in io.past for name in kv}
    out_names = [io.logits] + [name for kv in io.present for name in kv]
    logits = []
    for lo, hi in ((0, split), (split, n)):
        if lo == hi:
            continue
        feed = {io.input_ids: ids[None, lo:hi].astype(np.int64),  # [1, new]
                io.attention_mask: np.ones((1, hi), np.int64), **cache}  # [1, past + new]
        if io.position_ids:
            feed[io.position_ids] = np.arange(lo, hi, dtype=np.int64)[None]  # [1, new]
        res = sess.run(out_names, feed)
        logits.append(res[0][0].astype(np.float32))  # [new, width]
        cache = {p: r for kv_in, kv_out in zip(io.past, io.present)
                 for p, r in zip(kv_in, (res[out_names.index(kv_out[0])], res[out_names.index(kv_out[1])]))}
    del sess
    return np.concatenate(logits, axis=0)  # [n, width]


def torch_logits(hf_dir: Path, ids: np.ndarray) -> np.ndarray:
    """PyTorch float32 logits [n, width] of the model in hf_dir on ids [n] (one forward, no cache)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.as_tensor(ids[None], dtype=torch.long)).logits[0].float().numpy()
    del model
    gc.collect()
    return out
