"""The int4 target's speed levers, side by side: quantization layouts, MatMulNBits' compute type,
an 8-bit LM head or 8-bit weights, threads and spinning, OpenVINO's execution provider, each against
the bundle's int4 target as built.

    .venv/bin/python bench/int4_levers.py models/default models/default-int4 --name int4-levers

FLOAT32 is the bundle whose float32 target the layouts are quantized from (export/quantize.py, the
export's own quantizer); INT4 is its int4 twin (bench/quant_twin.py), the reference. Each variant's
graph is written under bench/results/<date>-<name>/graphs/ (removed at the end unless --keep), then:

- speed: every variant's session is loaded, and decode calls shaped as the engine makes them (after a
  --past-token prefill, n = 1, 2, 4, 8 new tokens, the cache cropped back after each) are timed
  round-robin across the variants, --rounds times, so machine drift hits all alike; medians.
  `1 raw` is a 1-row call without the padding that int4 targets get (their 1-row kernel rounds
  differently, see export/quantize.py), the others are what the engine sends.
- accuracy: every variant scores the same 4 x 256 tokens of text (standard-library source) in one
  call per chunk; against the float32 target: greedy top-1 agreement and KL(float32 || variant).

Quantizing a layout from the float32 1.5B target takes 1-2 minutes and about 22 GB: variants are made
one at a time, before any timing. Prints a table and writes levers.json and table.md.

The "OpenVINO EP" variant runs the same graph through ONNX Runtime's OpenVINO execution provider plugin
(`.venv/bin/pip install onnxruntime-ep-openvino`, 53 MB with its OpenVINO runtime) on the CPU; the
nodes it does not take stay on ONNX Runtime's CPU provider.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402

CALL_SIZES = ("1 raw", 2, 4, 8)
# name -> how it is made: from the float32 target (quantize options) or from INT4's graph (an edit), and
# the runtime settings it is timed with
VARIANTS = {
    "as built": {"from": "int4"},
    "compute float32 (accuracy 1)": {"from": "int4", "accuracy_level": 1},
    "LM head 8-bit": {"from": "float32", "lm_head_bits": 8},
    "8-bit weights": {"from": "float32", "quant": "int8"},         # the int8 precision's MatMulNBits
    "block 32": {"from": "float32", "block_size": 32},
    "block 64": {"from": "float32", "block_size": 64},
    "block 256": {"from": "float32", "block_size": 256},
    "block 32 symmetric": {"from": "float32", "block_size": 32, "symmetric": True},
    "1 thread": {"from": "int4", "threads": 1},
    "spinning off": {"from": "int4", "spinning": False},
    "rotary folded": {"from": "int4", "fold_rotary": True},      # export/fuse_rotary.py, on a bundle without it
    "projections merged": {"from": "int4", "merge": True},          # export/merge_ops.py, on a bundle without it
    "skip norms": {"from": "int4", "norms": True},
    "fewer ops": {"from": "int4", "merge": True, "norms": True},    # both: what an export now writes
    "OpenVINO EP": {"from": "int4", "openvino": True},
}


def openvino_session(path: Path):
    """A session of `path` on the OpenVINO execution provider plugin's CPU device."""
    import onnxruntime as ort
    try:
        import onnxruntime_ep_openvino as plugin
    except ImportError:
        raise SystemExit("error: the OpenVINO EP variant needs its plugin: .venv/bin/pip install "
                         "onnxruntime-ep-openvino") from None
    if not any(d.ep_name == plugin.get_ep_name() for d in ort.get_ep_devices()):
        ort.register_execution_provider_library("openvino", plugin.get_library_path())
    cpu = [d for d in ort.get_ep_devices()
           if d.ep_name == plugin.get_ep_name() and d.ep_metadata.get("ov_device") == "CPU"]
    if not cpu:
        raise SystemExit("error: the OpenVINO EP plugin found no CPU device on this machine")
    options = ort.SessionOptions()
    options.add_provider_for_devices(cpu[:1], {})
    return ort.InferenceSession(str(path), sess_options=options)


def set_accuracy(src: Path, dst: Path, level: int) -> None:
    """INT4's graph with every MatMulNBits' accuracy_level set to `level`; the weights hard-linked."""
    import onnx

    model = onnx.load(str(src), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            for a in node.attribute:
                if a.name == "accuracy_level":
                    a.i = level
    _link_weights(src, dst)
    onnx.save(model, str(dst))


def fold_rotary(spec, dst: Path) -> None:
    """INT4's graph with the rotary embedding folded into its attention (export/fuse_rotary.py)."""
    import onnx

    from spectr_edge_export.fuse_rotary import fold_rotary as fold

    if spec.rotary != "unfused":
        raise SystemExit(f"error: {spec.file} already has its rotary embedding inside the attention kernel; "
                         "the 'rotary folded' variant compares a bundle fused without it")
    model = onnx.load(str(spec.file), load_external_data=False)
    fold(model, spec.position_ids, spec.context_length, spec.file.parent)
    _link_weights(spec.file, dst)
    onnx.save(model, str(dst))


def fewer_ops(spec, dst: Path, merge: bool, norms: bool) -> None:
    """INT4's graph (rotary folded) with export/merge_ops.py's rewrites: each layer's Q, K, V and its MLP's
    gate and up projections in one MatMulNBits each (merge), the residual adds inside the norms (norms)."""
    import onnx

    from spectr_edge_export.merge_ops import fuse_skip_norms, merge_projections
    from spectr_edge_export.tree_mask import weights_reader
    from spectr_edge_export.writer import WeightsFile

    model = onnx.load(str(spec.file), load_external_data=False)
    dst.parent.mkdir(parents=True, exist_ok=True)
    weights = WeightsFile(dst)
    merged = merge_projections(model, weights_reader(spec.file.parent), weights.put) if merge else 0
    fused = fuse_skip_norms(model) if norms else 0
    weights.take_rest(model, spec.file.parent)
    weights.commit()
    print(f"  {merged} groups of projections merged, {fused} residual adds inside their norms", flush=True)
    onnx.save(model, str(dst))


def _link_weights(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    for extra in src.parent.iterdir():          # the external data file(s): every file beside but graphs
        if extra.suffix not in (".onnx", ".json") and not (dst.parent / extra.name).exists():
            os.link(extra, dst.parent / extra.name)


def make_variants(float32_spec, int4_spec, names: list[str], graphs: Path) -> dict[str, Path]:
    from spectr_edge_export import quantize

    files = {}
    for name in names:
        v = VARIANTS[name]
        if v["from"] == "int4" and not {"accuracy_level", "fold_rotary", "merge", "norms"} & set(v):
            files[name] = int4_spec.file
            continue
        out = graphs / name.replace(" ", "-").replace("(", "").replace(")", "") / "model.onnx"
        started = time.perf_counter()
        if v.get("fold_rotary"):
            fold_rotary(int4_spec, out)
        elif v.get("merge") or v.get("norms"):
            fewer_ops(int4_spec, out, v.get("merge", False), v.get("norms", False))
        elif v["from"] == "int4":
            set_accuracy(int4_spec.file, out, v["accuracy_level"])
        else:
            print(f"quantizing {name} from {float32_spec.file} ...", flush=True)
            quantize.quantize(float32_spec.file, out, v.get("quant", "int4"), v.get("block_size", quantize.INT4_BLOCK_SIZE),
                              symmetric=v.get("symmetric", quantize.INT4_SYMMETRIC),
                              lm_head_bits=v.get("lm_head_bits"))
            gc.collect()
        print(f"  {name}: {time.perf_counter() - started:.0f} s", flush=True)
        files[name] = out
    return files


def text_chunks(tokenizer_file: Path, tokens: int = 256) -> list[np.ndarray]:
    import difflib
    import json as json_module
    import textwrap

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    sources = [inspect.getsource(m) for m in (json_module.decoder, textwrap, difflib, argparse)]
    return [np.array(tok.encode(s[2000:12000]).ids[:tokens], dtype=np.int64) for s in sources]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def scores(lm, chunks: list[np.ndarray], width: int) -> list[np.ndarray]:
    """Log-probabilities of every position of every chunk # [len(chunk), width] each."""
    return [log_softmax(lm.forward(ids[None], lm.new_cache())[0, :, :width]) for ids in chunks]


def time_calls(lms: dict, past: int, rounds: int, calls: int) -> dict[str, dict[str, float]]:
    """Median ms of a call of each size per variant, round-robin over the variants."""
    rng = np.random.default_rng(0)
    caches = {}
    for name, lm in lms.items():
        caches[name] = lm.new_cache()
        lm.forward(rng.integers(0, 1000, (1, past)).astype(np.int64), caches[name], last=1)
    times: dict[str, dict[str, list[float]]] = {n: {str(s): [] for s in CALL_SIZES} for n in lms}
    for r in range(rounds):
        order = list(lms) if r % 2 == 0 else list(reversed(lms))
        for name in order:
            lm, cache = lms[name], caches[name]
            for size in CALL_SIZES:
                raw = size == "1 raw"
                n = 1 if raw else size
                spec = lm.spec
                if raw:
                    lm.spec = dataclasses.replace(spec, min_call_tokens=1, call_multiple=1)
                for _ in range(calls):
                    ids = rng.integers(0, 1000, (1, n)).astype(np.int64)
                    started = time.perf_counter()
                    lm.forward(ids, cache)
                    times[name][str(size)].append(time.perf_counter() - started)
                    cache.crop(past)
                lm.spec = spec
        print(f"  round {r + 1}/{rounds}", flush=True)
    return {n: {s: 1000 * float(np.median(v)) for s, v in per.items()} for n, per in times.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("float32_bundle", type=Path)
    ap.add_argument("int4_bundle", type=Path)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names, of: " + ", ".join(VARIANTS))
    ap.add_argument("--name", default="int4-levers")
    ap.add_argument("--past", type=int, default=256, help="tokens in the cache before each timed call")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=5, help="calls of each size per variant per round")
    ap.add_argument("--keep", action="store_true", help="keep the variants' graphs")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"error: unknown variant(s) {unknown}; choose from {list(VARIANTS)}")

    from spectr_edge.bundle import read_bundle
    from spectr_edge.onnx_model import OnnxLM
    from spectr_edge_export import quantize

    f32, q4 = read_bundle(args.float32_bundle), read_bundle(args.int4_bundle)
    out_dir = BENCH / "results" / f"{time.strftime('%Y-%m-%d')}-{args.name}"
    graphs = out_dir / "graphs"
    out_dir.mkdir(parents=True, exist_ok=True)
    files = make_variants(f32.target, q4.target, names, graphs)

    width = f32.tokenizer.vocab_size
    chunks = text_chunks(f32.tokenizer.file)
    print("float32 reference scores ...", flush=True)
    ref = OnnxLM(f32.target, provider="cpu")
    ref_lp = scores(ref, chunks, width)
    del ref
    gc.collect()

    lms, accuracy = {}, {}
    for name in names:
        v = VARIANTS[name]
        path = files[name]
        spec = dataclasses.replace(q4.target, file=path, size_bytes=None,
                                   min_call_tokens=quantize.min_call_tokens(path),
                                   call_multiple=quantize.call_token_multiple(path),
                                   guess=q4.target.guess if v["from"] == "int4" else None)   # made from float32: no guess head
        lm = OnnxLM(spec, provider="cpu", threads=v.get("threads"), spinning=v.get("spinning", True))
        if v.get("openvino"):          # the same graph and I/O, its session on the OpenVINO plugin
            lm.session = openvino_session(path)
            print(f"  {name}: providers {lm.session.get_providers()}", flush=True)
        lp = scores(lm, chunks, width)
        agree = np.mean(np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(ref_lp, lp)]))
        kl = np.mean(np.concatenate([(np.exp(a) * (a - b)).sum(-1) for a, b in zip(ref_lp, lp)]))
        weights = sum(f.stat().st_size for f in path.parent.iterdir() if f.suffix not in (".json", ".txt"))
        accuracy[name] = {"top1_agreement": float(agree), "kl": float(kl), "file_bytes": weights,
                          "min_call_tokens": spec.min_call_tokens, "call_multiple": spec.call_multiple}
        lms[name] = lm
        print(f"  {name}: top-1 agreement {agree:.3f}, KL {kl:.4f}", flush=True)

    print(f"timing {len(lms)} variants x {len(CALL_SIZES)} call sizes, {args.rounds} rounds ...", flush=True)
    ms = time_calls(lms, args.past, args.rounds, args.calls)
    base = ms[names[0]]["2"]
    machine = harness.machine_info()
    lines = [f"`{' '.join(['.venv/bin/python bench/int4_levers.py'] + [str(a) for a in (argv or sys.argv[1:])])}`",
             f"({machine.get('cpu', '?')}" + (f", hidden: {machine['hidden_cpu_features']}" if machine.get("hidden_cpu_features")
                                             else "") + f"; past {args.past} tokens, medians of "
             f"{args.rounds} x {args.calls} calls per size)", "",
             "| variant | ms: 1 row raw | 2 (a decode) | 4 | 8 | decode vs " + names[0] + " | top-1 vs float32 | KL | file MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        m, a = ms[name], accuracy[name]
        lines.append(f"| {name} | {m['1 raw']:.1f} | {m['2']:.1f} | {m['4']:.1f} | {m['8']:.1f} | "
                     f"{base / m['2']:.2f}x | {a['top1_agreement']:.3f} | {a['kl']:.4f} | {a['file_bytes'] / 2**20:.0f} |")
    table = "\n".join(lines)
    print(table)
    (out_dir / "table.md").write_text(table + "\n")
    (out_dir / "levers.json").write_text(json.dumps({"machine": machine, "args": vars(args) | {
        "float32_bundle": str(args.float32_bundle), "int4_bundle": str(args.int4_bundle)},
        "ms": ms, "accuracy": accuracy}, indent=1, default=str))
    if not args.keep:
        shutil.rmtree(graphs, ignore_errors=True)


if __name__ == "__main__":
    main()
