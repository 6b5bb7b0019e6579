"""Where an int4 decode step goes: ONNX Runtime's per-operator profile of one target's decode
calls, against the memory-bandwidth floor (the weight bytes a token reads / the machine's measured
bandwidth).

Runs a 128-token prefill, then `--steps` decode calls shaped as the engine makes them (2 tokens: int4
targets pad 1-token calls), with ONNX Runtime's profiler on; prints the share of the decode time per
operator type and per MatMulNBits shape (which weights cost most), the measured copy bandwidth, and the
floor.

    .venv/bin/python bench/int4_profile.py models/default-int4 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402


def bandwidth_gbs(size_mb: int = 1024, repeats: int = 5) -> float:
    """Best-of-n copy bandwidth: bytes read + bytes written per second (GB/s), one thread."""
    src = np.ones(size_mb * 2**20 // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return 2 * src.nbytes / best / 1e9


def read_per_token(model: Path) -> tuple[int, int]:
    """Bytes of the initializers a decode step reads (every weight once), and of the tables it only
    gathers rows from (the token embedding), which it does not."""
    import onnx

    g = onnx.load(str(model), load_external_data=False).graph
    gathered = {n.input[0] for n in g.node if n.op_type == "Gather"}
    read = table = 0
    for t in g.initializer:
        size = int(np.prod(t.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        if t.name in gathered:
            table += size
        else:
            read += size
    return read, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    import onnxruntime as ort

    from spectr_edge.bundle import read_bundle
    from spectr_edge.onnx_model import OnnxLM

    spec = read_bundle(args.bundle).target
    prof_dir = tempfile.mkdtemp(prefix="int4-profile-")
    lm = OnnxLM(spec, provider="cpu", threads=args.threads)
    opts = ort.SessionOptions()
    opts.enable_profiling = True
    opts.profile_file_prefix = os.path.join(prof_dir, "decode")
    if args.threads:
        opts.intra_op_num_threads = args.threads
    lm.session = ort.InferenceSession(str(spec.file), opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    cache = lm.new_cache()
    lm.forward(rng.integers(0, 1000, (1, 128)).astype(np.int64), cache, last=1)      # the prefill
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        lm.forward(rng.integers(0, 1000, (1, 1)).astype(np.int64), cache)             # a decode (padded to 2)
        times.append(time.perf_counter() - started)
    profile = json.loads(Path(lm.session.end_profiling()).read_text())
    by_op, by_matmul, total = defaultdict(float), defaultdict(float), 0.0
    runs = [e for e in profile if e.get("cat") == "Session" and e.get("name") == "model_run"]
    decode_start = runs[1]["ts"] if len(runs) > 1 else 0          # skip the prefill's run
    for e in profile:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time") or e["ts"] < decode_start:
            continue
        op = e["args"].get("op_name", "?")
        by_op[op] += e["dur"]
        total += e["dur"]
        if op == "MatMulNBits":
            shape = e["args"].get("activation_size", "?")
            by_matmul[f"{e['args'].get('output_type_shape', '?')}"] += e["dur"]
    weights, table = read_per_token(spec.file)
    bw = bandwidth_gbs()
    step_ms = 1000 * float(np.median(times))
    floor_ms = 1000 * weights / (bw * 1e9)               # every weight read once at the copy's rate
    report = {"machine": harness.machine_info(), "bundle": str(args.bundle), "decode_ms_median": step_ms,
              "weight_bytes_per_token": weights, "embedding_table_bytes": table,
              "copy_bandwidth_gbs": bw, "bandwidth_floor_ms": floor_ms,
              "op_share": {k: v / total for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])},
              "matmulnbits_by_output_shape": {k: v / total for k, v in sorted(by_matmul.items(), key=lambda kv: -kv[1])[:8]}}
    print(f"decode step (2-token call) {step_ms:.1f} ms; weights read per token {weights / 2**20:.0f} MiB (the "
          f"{table / 2**20:.0f} MiB embedding table is gathered, one row); copy bandwidth "
          f"{bw:.1f} GB/s -> floor {floor_ms:.1f} ms ({floor_ms / step_ms:.0%} of the step)")
    for op, share in list(report["op_share"].items())[:10]:
        print(f"  {op:28s} {100 * share:5.1f}%")
    print("MatMulNBits by output shape:")
    for shape, share in report["matmulnbits_by_output_shape"].items():
        print(f"  {shape:40s} {100 * share:5.1f}%")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
