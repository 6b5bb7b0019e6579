"""Greedy: target-only vs fixed draft length vs adaptive draft length (draft_stop), one run.

    .venv/bin/python bench/adaptive_check.py --prompts 10 -n 128 --out bench/results/DATE-adaptive
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import spectr_edge
from spec_sweep import PROMPTS_FILE, load_prompts

CONFIGS = {"target-only": dict(num_candidates=0), "k=1 L=3": dict(num_candidates=1, draft_len=3),
           "k=1 L=6 stop 0.5": dict(num_candidates=1, draft_len=6, draft_stop=0.5),
           "k=1 L=5 stop 0.6": dict(num_candidates=1, draft_len=5, draft_stop=0.6)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default="models/default")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    gen = spectr_edge.load(args.bundle, provider="cpu")
    for c in CONFIGS.values():
        gen.generate("Say hello.", max_new_tokens=8, **c)
    rows = []
    for p in load_prompts(PROMPTS_FILE, args.prompts):
        ref = None
        for name, c in CONFIGS.items():
            r = gen.generate(p["prompt"], max_new_tokens=args.max_new_tokens, temperature=0, **c)
            ref = ref or r.token_ids
            rows.append({"prompt_id": p["id"], "config": name, "equal_to_target": r.token_ids == ref,
                         "ms_per_token": r.stats.ms_per_token, "tokens_per_call": r.stats.tokens_per_target_call,
                         "drafted": r.stats.drafted, "accepted": r.stats.accepted})
        print(f"prompt {p['id']} done", file=sys.stderr, flush=True)
    base = {r["prompt_id"]: r["ms_per_token"] for r in rows if r["config"] == "target-only"}
    lines = ["| config | median ms/token | speedup (median of per-prompt ratios) | tokens per target call | equal to target-only |",
             "|---|---|---|---|---|"]
    for name in CONFIGS:
        mine = [r for r in rows if r["config"] == name]
        lines.append(f"| {name} | {statistics.median(r['ms_per_token'] for r in mine):.1f} | "
                     f"{statistics.median(base[r['prompt_id']] / r['ms_per_token'] for r in mine):.2f}x | "
                     f"{statistics.median(r['tokens_per_call'] for r in mine):.2f} | "
                     f"{sum(r['equal_to_target'] for r in mine)}/{len(mine)} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "raw.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
