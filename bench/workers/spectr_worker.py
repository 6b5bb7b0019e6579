"""Benchmark worker for spectr-edge: loads one bundle, then serves generation requests.

Protocol (shared by every worker in bench/workers/, so peers run in their own environments):
the coordinator writes one JSON object per line on stdin and reads one per line from the
worker's protocol stream (the original stdout; everything else the process prints goes to
stderr). The worker first sends {"ready": true, "info": {...versions...}}. A request is
{"id", "prompt", "prompt_ids", "max_new_tokens", "seed", "config"}; the answer is
{"id", "result": {...measurements...}} or {"id", "error": "one line"}. An empty line or EOF ends it.

config keys for spectr-edge: temperature, k (0 = target-only; with drafter lookup: lookup_candidates),
branches (greedy side leaves), L, stop (draft_stop), top_k, top_p,
drafter (model | lookup | model+lookup), adaptive (bool), tree (tree_budget: a draft tree of that many nodes),
window (draft_window), table (false: lookup without the bundle's next-token table), unpadded (true: a
min_call_tokens-2 target decodes in 1-token calls (no padding at all), as plain ONNX Runtime would; other numerics, so
only for target-only reference rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback


def protocol_stream():
    """Keep the real stdout for protocol lines; send every other print (and C-level writes) to stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


def serve(proto, info: dict, handle) -> None:
    proto.write(json.dumps({"ready": True, "info": info}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            break
        req = json.loads(line)
        try:
            proto.write(json.dumps({"id": req["id"], "result": handle(req)}) + "\n")
        except Exception as err:  # a failed configuration is reported in the table, not fatal
            traceback.print_exc()
            proto.write(json.dumps({"id": req["id"], "error": f"{type(err).__name__}: {err}"[:300]}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--provider", default="cpu")
    pages = ap.add_mutually_exclusive_group()   # neither: load()'s default (huge pages for quantized targets)
    pages.add_argument("--huge-pages", dest="huge_pages", action="store_const", const=True, default=None,
                       help="load(huge_pages=True): weights in 2 MiB pages")
    pages.add_argument("--no-huge-pages", dest="huge_pages", action="store_const", const=False,
                       help="load(huge_pages=False): weights in 4 KiB pages")
    args = ap.parse_args()
    proto = protocol_stream()

    import numpy as np
    import onnxruntime

    import spectr_edge

    # every prompt from a cold cache, as the peers' workers run them (config "prefix_cache": true keeps them)
    gen = spectr_edge.load(args.bundle, provider=args.provider, threads=args.threads, prefix_cache=False,
                           huge_pages=args.huge_pages)
    info = {"tool": "spectr-edge", "onnxruntime": onnxruntime.__version__, "numpy": np.__version__,
            "bundle": args.bundle, "threads": args.threads or "onnxruntime default", "provider": gen.target.provider,
            "models": {r: {k: v for k, v in m.items() if k in ("source", "quant", "num_layers")}
                       for r, m in gen.bundle.manifest["models"].items()}}

    def handle(req: dict) -> dict:
        c = req["config"]
        kwargs = dict(max_new_tokens=req["max_new_tokens"], temperature=c.get("temperature", 0.0),
                      top_k=c.get("top_k", 0), top_p=c.get("top_p", 1.0), seed=req["seed"])
        if "k" in c:   # candidates: prompt lookup's copied ones, else SpecTr's k
            kwargs["lookup_candidates" if c.get("drafter") == "lookup" and c["k"] else "num_candidates"] = c["k"]
        if c.get("branches"):
            kwargs["branches"] = c["branches"]
        if c.get("L"):
            kwargs["draft_len"] = c["L"]
        if "stop" in c:
            kwargs["draft_stop"] = c["stop"]
        if c.get("drafter"):
            kwargs["drafter"] = c["drafter"]
        if "adaptive" in c:
            kwargs["adaptive"] = c["adaptive"]
        if c.get("tree"):
            kwargs["tree_budget"] = c["tree"]
        if "window" in c:
            kwargs["draft_window"] = c["window"]
        table, spec = gen.engine.lookup_table, gen.target.spec
        if c.get("table") is False:          # A/B: prompt lookup without the bundle's next-token table
            gen.engine.lookup_table = None
        if c.get("unpadded"):                # reference: what 1-token calls of this graph cost
            gen.target.spec = dataclasses.replace(spec, min_call_tokens=1, call_multiple=1)
        try:
            res = gen.generate_ids(req["prompt_ids"], **kwargs)
        finally:
            gen.engine.lookup_table, gen.target.spec = table, spec
        s = res.stats
        return {"new_tokens": s.new_tokens, "seconds": s.seconds_total, "ttft_s": s.seconds_first_token,
                "target_calls": s.target_calls, "draft_calls": s.draft_calls, "accepted": s.accepted,
                "drafted": s.drafted, "acceptance_per_position": s.acceptance_per_position,
                "seconds_target": s.seconds_target, "seconds_draft": s.seconds_draft,
                "seconds_select": s.seconds_select, "reached": s.reached, "accepted_at": s.accepted_at,
                "token_ids": res.token_ids, "stop_reason": s.stop_reason, "lookup_steps": s.lookup_steps,
                "lookup_drafted": s.lookup_drafted, "lookup_accepted": s.lookup_accepted, "undrafted": s.undrafted}

    serve(proto, info, handle)


if __name__ == "__main__":
    main()
