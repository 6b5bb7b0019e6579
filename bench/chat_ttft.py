"""Time to first token of a conversation's second turn, with and without prefix reuse, side by side.

The first turn is a long user message (a Spec-Bench summarization article, about 700 tokens with
the chat template) and the model's answer; the second turn adds a short question. With prefix
reuse (the default) the second turn prefills only what it adds; without it (prefix_cache=False)
it prefills the whole conversation again. Both generators live in one process and take turns, N
rounds, medians reported; the answers must be equal token for token (greedy).

    .venv/bin/python bench/chat_ttft.py --bundle models/default --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default=str(BENCH.parent / "models" / "default"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import spectr_edge

    article = next(q for q in harness.load_questions() if q["task"] == "summarization")["prompt"]
    reuse = spectr_edge.load(args.bundle, provider="cpu")
    fresh = spectr_edge.load(args.bundle, provider="cpu", prefix_cache=False)
    turn1 = [{"role": "user", "content": article}]
    rows = []
    for r in range(args.rounds):
        reuse.engine.prefixes.clear()
        first = reuse.chat(turn1, max_new_tokens=args.max_new_tokens)          # leaves its cache
        turn2 = turn1 + [{"role": "assistant", "content": first.text},
                         {"role": "user", "content": f"Now say it in one sentence ({r})."}]
        order = [("reuse", reuse), ("fresh", fresh)] if r % 2 == 0 else [("fresh", fresh), ("reuse", reuse)]
        got = {}
        for name, gen in order:
            got[name] = gen.chat(turn2, max_new_tokens=args.max_new_tokens)
        if got["reuse"].token_ids != got["fresh"].token_ids:
            raise SystemExit(f"error: round {r}: the answers differ with and without reuse")
        rows.append({"prompt_tokens": got["reuse"].stats.prompt_tokens, "cached_tokens": got["reuse"].stats.cached_tokens,
                     "ttft_reuse_ms": 1000 * got["reuse"].stats.seconds_first_token,
                     "ttft_fresh_ms": 1000 * got["fresh"].stats.seconds_first_token})
        print(json.dumps(rows[-1]), flush=True)
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    report = {"machine": harness.machine_info(), "bundle": args.bundle, "rounds": rows,
              "median_ttft_reuse_ms": med("ttft_reuse_ms"), "median_ttft_fresh_ms": med("ttft_fresh_ms"),
              "median_prompt_tokens": med("prompt_tokens"), "median_cached_tokens": med("cached_tokens")}
    report["speedup"] = report["median_ttft_fresh_ms"] / report["median_ttft_reuse_ms"]
    print(f"second turn of {report['median_prompt_tokens']:.0f} tokens ({report['median_cached_tokens']:.0f} cached): "
          f"time to first token {report['median_ttft_fresh_ms']:.0f} ms without reuse, "
          f"{report['median_ttft_reuse_ms']:.0f} ms with it: {report['speedup']:.1f}x lower")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
