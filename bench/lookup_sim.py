"""Replay prompt-lookup drafting offline on greedy outputs a benchmark run already produced.

At temperature 0 the output is the target's greedy sequence whatever is drafted, so a deterministic
drafter's accepted length at every step follows from that sequence alone: propose from the prompt
and the tokens so far, accept the longest common prefix with the true continuation, move on by
accepted + 1. With the bundle's measured cost curve this predicts tokens per target call and the
speedup over target-only for a drafter variant in seconds instead of a benchmark run. It predicts
target time only (no selection or Python time), so confirm a winner with bench/run.py.

    .venv/bin/python bench/lookup_sim.py                      # every raw.json under bench/results
    .venv/bin/python bench/lookup_sim.py --bundle models/default-int4 --no-table
    .venv/bin/python bench/lookup_sim.py --table /tmp/other/lookup_table.npz   # try another table
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402
from spectr_edge.bundle import read_bundle  # noqa: E402
from spectr_edge.lookup import PromptLookup  # noqa: E402
from spectr_edge.ngram_table import NgramTable  # noqa: E402
from spectr_edge.policy import CostCurve  # noqa: E402
from spectr_edge.text import TextCodec  # noqa: E402


def greedy_sequences(paths) -> list[dict]:
    """One greedy output per (prompt, target precision) from spectr-edge rows of raw.json files."""
    seen = {}
    for path in paths:
        raw = json.loads(Path(path).read_text())
        for r in raw.get("rows") or []:
            if r.get("tool") != "spectr-edge" or float(r.get("temperature", 1)) != 0.0 or "token_ids" not in r:
                continue
            key = (str(r["prompt_id"]), next((q for q in ("int4", "int8") if q in r["method"]), "fp32"))
            if key not in seen:
                ids = r["token_ids"]
                seen[key] = {"prompt_id": key[0], "precision": key[1], "task": r["task"],
                             "out": json.loads(ids) if isinstance(ids, str) else ids}
    return list(seen.values())


def simulate(prompt: list[int], out: list[int], drafter: PromptLookup, cost: CostCurve) -> tuple[float, float]:
    """(tokens per target call, predicted speedup over target-only) of one generation."""
    t, calls, units = 1, 0, 0.0                      # the first token comes from the prefill
    while t < len(out):
        budget = len(out) - t - 1
        draft, n = drafter.propose(prompt + out[:t], budget) if budget >= 1 else ([], 0)
        accepted = 0
        while accepted < len(draft) and draft[accepted] == out[t + accepted]:
            accepted += 1
        if draft:
            drafter.update(n, len(draft), accepted)
        t += accepted + 1
        calls += 1
        units += cost(len(draft) + 1)
    return (len(out) - 1) / calls, (len(out) - 1) / units


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", nargs="*", help="raw.json files [default: every bench/results/*/raw.json]")
    ap.add_argument("--bundle", default=str(BENCH.parent / "models" / "default-int4"),
                    help="tokenizer, cost curve and lookup table from this bundle")
    ap.add_argument("--no-table", action="store_true", help="prompt lookup without the next-token table")
    ap.add_argument("--table", help="another lookup_table.npz instead of the bundle's (a table being tried)")
    ap.add_argument("--max-len", type=int, default=8)
    args = ap.parse_args(argv)
    bundle = read_bundle(args.bundle)
    codec = TextCodec(bundle.tokenizer)
    entry = bundle.manifest["models"]["target"]
    cost = CostCurve.for_quant(bundle.target.quant, entry.get("cost_curve")).floored(bundle.target.min_call_tokens,
                                                                                       bundle.target.call_multiple)
    table_file = args.table or bundle.lookup_table
    table = None if args.no_table or table_file is None else NgramTable.load(table_file)
    prompts = {str(q["id"]): q["prompt"] for q in harness.load_questions()}
    paths = args.raw or sorted(BENCH.glob("results/*/raw.json"))
    rows = []
    for s in greedy_sequences(paths):
        prompt = codec.encode_prompt(prompts[s["prompt_id"]])
        calls, speedup = simulate(prompt, s["out"], PromptLookup(cost, args.max_len, table=table), cost)
        rows.append((s["task"], calls, speedup))
    if not rows:
        raise SystemExit("no greedy spectr-edge outputs with token ids in those raw.json files")
    tasks = sorted({r[0] for r in rows})
    print(f"{len(rows)} generations, table {'on' if table else 'off'}, cost curve of {args.bundle}")
    print(f"tokens per target call {statistics.mean(r[1] for r in rows):.2f}; predicted speedup median "
          f"{statistics.median(r[2] for r in rows):.3f}, mean {statistics.mean(r[2] for r in rows):.3f}")
    for t in tasks:
        print(f"  {t:16s} {statistics.median(r[2] for r in rows if r[0] == t):.2f}x")


if __name__ == "__main__":
    main()
