"""Speculative sweep on one bundle: target-only vs SpecTr for k candidates x L draft tokens.

Runs every configuration on every prompt in one process, prompt by prompt (configurations
interleaved, so machine drift hits all alike), after a warm-up. Writes raw per-prompt
measurements (JSON) and a Markdown table of medians into --out.

    .venv/bin/python bench/spec_sweep.py --bundle models/default --prompts 20 -n 128 \
        --temperatures 0,1 --ks 1,2,4 --Ls 2,3,4,6 --out bench/results/DATE-spec-sweep

At temperature 0 the draft is deterministic, so only k = 1 is run there.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime

import spectr_edge

PROMPTS_FILE = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "spec_bench_questions.jsonl"


def load_prompts(path: Path, count: int, offset: int = 0) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"id": r["question_id"], "category": r["category"], "prompt": r["turns"][0]}
            for r in rows[offset:offset + count]]


def configs(temperatures, ks, Ls) -> list[dict]:
    out = []
    for t in temperatures:
        out.append({"temperature": t, "k": 0, "L": 0})
        for k in ([1] if t == 0 else ks):
            out += [{"temperature": t, "k": k, "L": L} for L in Ls]
    return out


def name(c: dict) -> str:
    return f"T={c['temperature']:g} " + ("target-only" if c["k"] == 0 else f"k={c['k']} L={c['L']}")


def run_one(gen, prompt: str, c: dict, max_new_tokens: int, seed: int) -> dict:
    res = gen.generate(prompt, max_new_tokens=max_new_tokens, temperature=c["temperature"], seed=seed,
                       num_candidates=c["k"], draft_len=max(c["L"], 1))
    s = res.stats
    return {"new_tokens": s.new_tokens, "ms_per_token": s.ms_per_token, "ttft_ms": 1000 * s.seconds_first_token,
            "tokens_per_s": s.tokens_per_second, "tokens_per_call": s.tokens_per_target_call,
            "acceptance": s.acceptance_rate, "accepted": s.accepted, "drafted": s.drafted,
            "acceptance_per_position": s.acceptance_per_position,
            "seconds": s.seconds_total, "seconds_target": s.seconds_target, "seconds_draft": s.seconds_draft,
            "seconds_select": s.seconds_select, "seconds_other": s.seconds_other, "token_ids": res.token_ids}


def summarize(rows: list[dict], cfgs: list[dict]) -> list[dict]:
    table = []
    for c in cfgs:
        mine = [r for r in rows if r["config"] == name(c)]
        base = {r["prompt_id"]: r for r in rows if r["config"] == name({**c, "k": 0, "L": 0})}
        ratios = [base[r["prompt_id"]]["ms_per_token"] / r["ms_per_token"] for r in mine if r["ms_per_token"] > 0]
        med = lambda key: statistics.median(r[key] for r in mine)
        outside = [1 - (r["seconds_target"] + r["seconds_draft"]) / r["seconds"] for r in mine]
        table.append({"config": name(c), **c, "prompts": len(mine), "ms_per_token": med("ms_per_token"),
                      "ttft_ms": med("ttft_ms"), "tokens_per_s": med("tokens_per_s"),
                      "speedup": statistics.median(ratios) if ratios else float("nan"),
                      "tokens_per_call": med("tokens_per_call"), "acceptance": med("acceptance"),
                      "outside_ort": statistics.median(outside)})
    return table


def markdown(table: list[dict]) -> str:
    lines = ["| config | median ms/token | speedup vs target-only (median of per-prompt ratios) | "
             "tokens/s | TTFT ms | tokens per target call | acceptance | time outside ORT |",
             "|---|---|---|---|---|---|---|---|"]
    for t in table:
        lines.append(f"| {t['config']} | {t['ms_per_token']:.1f} | {t['speedup']:.2f}x | {t['tokens_per_s']:.2f} | "
                     f"{t['ttft_ms']:.0f} | {t['tokens_per_call']:.2f} | {t['acceptance']:.2f} | "
                     f"{100 * t['outside_ort']:.1f}% |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default="models/default")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--ks", default="1,2,4")
    ap.add_argument("--Ls", default="2,3,4,6")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfgs = configs([float(t) for t in args.temperatures.split(",")], [int(k) for k in args.ks.split(",")],
                   [int(L) for L in args.Ls.split(",")])
    prompts = load_prompts(PROMPTS_FILE, args.prompts, args.offset)
    gen = spectr_edge.load(args.bundle, provider="cpu", threads=args.threads)
    for c in cfgs:   # warm-up: allocations, first-run kernel selection
        run_one(gen, "Say hello.", c, 8, seed=0)
    rows, started = [], time.time()
    for i, p in enumerate(prompts):
        for c in cfgs:
            r = run_one(gen, p["prompt"], c, args.max_new_tokens, seed=1000 + i)
            rows.append({"prompt_id": p["id"], "category": p["category"], "config": name(c), **c, **r})
        done = (i + 1) / len(prompts)
        eta = (time.time() - started) * (1 - done) / done
        print(f"[{i + 1}/{len(prompts)}] {time.time() - started:.0f} s, ETA {eta:.0f} s", file=sys.stderr, flush=True)
    table = summarize(rows, cfgs)
    meta = {"command": " ".join(sys.argv), "bundle": args.bundle, "manifest_models": {
                r: {k: v for k, v in m.items() if k in ("source", "quant", "num_layers")}
                for r, m in gen.bundle.manifest["models"].items()},
            "machine": platform.platform(), "processor": platform.processor(), "python": platform.python_version(),
            "onnxruntime": onnxruntime.__version__, "numpy": np.__version__, "threads": args.threads or "ORT default",
            "max_new_tokens": args.max_new_tokens, "prompts": [p["id"] for p in prompts]}
    (out / "raw.json").write_text(json.dumps({"meta": meta, "rows": rows, "table": table}, indent=1))
    (out / "table.md").write_text(markdown(table) + "\n")
    print(markdown(table))


if __name__ == "__main__":
    main()
