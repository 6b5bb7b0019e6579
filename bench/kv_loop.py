"""Micro-benchmark: one target graph decoding 20 tokens after a long past, cache handled two ways.

    .venv/bin/python bench/kv_loop.py models/default-int4 target/model.gqa.onnx --past 64 700

`plain`: the cache goes in and out of every call as NumPy arrays (present = concat(past, new),
what an optimum graph needs and what `KVCache` does). `in-place` (fused-attention graphs only,
`"attention": "gqa"`): preallocated buffers bound as both past input and present output
(`BufferKVCache`), nothing copied per call. Medians of 18 calls after 2 warm-up calls; one
token per call, so every call is a single-token decode (for an int4 target the runtime would
pad it to 2 tokens: this measures the graph, not the runtime).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from spectr_edge_export.tree_mask import _run  # noqa: E402


def decode_ms(session, entry: dict, past_len: int, in_place: bool, steps: int = 20) -> float:
    inp, out = entry["inputs"], entry["outputs"]
    ids = (np.arange(past_len) * 7919 + 13) % 150000
    _, past = _run(session, entry, ids, None)
    names = [out["logits"]] + [x for kv in out["present"] for x in kv]
    times, length = [], past_len
    if not in_place:
        for _ in range(steps):
            feed = {inp["input_ids"]: np.array([[5]]), inp["position_ids"]: np.array([[length]]),
                    entry["tree_mask"]: np.ones((1, 1, 1, length + 1), bool)}
            for layer, (k, v) in enumerate(inp["past"]):
                feed[k], feed[v] = past[2 * layer], past[2 * layer + 1]
            t = time.perf_counter()
            past = session.run(names, feed)[1:]
            times.append(time.perf_counter() - t)
            length += 1
    else:
        capacity = past_len + steps + 8
        buffers = []
        for a in past:
            b = np.zeros((1, a.shape[1], capacity, a.shape[3]), np.float32)
            b[:, :, :past_len] = a
            buffers.append(b)
        values = [ort.OrtValue.ortvalue_from_numpy(b) for b in buffers]
        binding = session.io_binding()
        binding.bind_output(out["logits"], "cpu")
        for layer, ((pk, pv), (ck, cv)) in enumerate(zip(inp["past"], out["present"])):
            binding.bind_ortvalue_input(pk, values[2 * layer])
            binding.bind_ortvalue_input(pv, values[2 * layer + 1])
            binding.bind_ortvalue_output(ck, values[2 * layer])
            binding.bind_ortvalue_output(cv, values[2 * layer + 1])
        for _ in range(steps):
            binding.bind_cpu_input(inp["input_ids"], np.array([[5]]))
            binding.bind_cpu_input(inp["position_ids"], np.array([[length]]))
            binding.bind_cpu_input(entry["tree_mask"], np.ones((1, 1, 1, length + 1), bool))
            t = time.perf_counter()
            session.run_with_iobinding(binding)
            binding.get_outputs()[0].numpy()
            times.append(time.perf_counter() - t)
            length += 1
    return 1000 * float(np.median(times[2:]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("graph", help="graph file relative to the bundle (its target entry gives the I/O names)")
    ap.add_argument("--past", type=int, nargs="+", default=[64, 700])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    bundle = Path(args.bundle)
    entry = json.loads((bundle / "spectr.json").read_text())["models"]["target"]
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.log_severity_level = args.threads, 3
    session = ort.InferenceSession(str(bundle / args.graph), opts, providers=["CPUExecutionProvider"])
    fused = entry.get("attention") == "gqa" and args.graph == entry["file"]
    for past in args.past:
        row = {"plain": round(decode_ms(session, entry, past, False), 1)}
        if fused:
            row["in-place"] = round(decode_ms(session, entry, past, True), 1)
        print(f"{args.graph}, past {past}: ms per decode call {row}", flush=True)


if __name__ == "__main__":
    main()
