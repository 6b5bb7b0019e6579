"""What a target call costs by its size inside generation, against the isolated calls `spectr-edge tune` times.

`tune` times calls of 1-16 tokens back to back after a 128-token past and stores their cost relative
to a decode step; prompt lookup's and the draft model's length rules read that curve. Generation meets
the same calls between drafting and selection, after a growing past. This script

1. generates Spec-Bench prompts with the bundle's greedy default and times every target call by its
   size (ONNX Runtime's run and the copy of its outputs, what OnnxLM.seconds counts; padded sizes),
2. times isolated calls of the sizes generation used, as tune does (tune._time_calls, same past),
   optionally with --gap-ms of idle time before each (generation's host work between calls), and
3. with --race, generates the prompts again with each cost curve in turn (the built-in one of the
   bundle's precision, the isolated one, the one timed inside generation), interleaved prompt by prompt,
   and compares ms/token and tokens (greedy: the tokens must not change).

    .venv/bin/python bench/call_costs.py models/default-int4 --prompts stratified-2 --race
    .venv/bin/python bench/cpu_mask.py --keep-avx-vnni -- .venv/bin/python bench/call_costs.py models/default-int4
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402
import spectr_edge  # noqa: E402
from spectr_edge.policy import CostCurve  # noqa: E402
from spectr_edge.text import TextCodec  # noqa: E402
from spectr_edge.tune import CONTEXT, _time_calls  # noqa: E402


class CallTimer:
    """Seconds of every target call by its padded size, read from the model's own counters."""

    def __init__(self, model):
        self.model, self.times = model, collections.defaultdict(list)
        run = model._run

        def timed(feeds, cache, new):
            before = model.seconds
            out = run(feeds, cache, new)
            self.times[new].append(model.seconds - before)
            return out
        model._run = timed


def generate(gen, prompts, codec, options=None) -> dict:
    out = {}
    for p in prompts:
        r = gen.generate_ids(codec.encode_prompt(p["prompt"]), max_new_tokens=128, **(options or {}))
        s = r.stats
        out[str(p["id"])] = {"ms": s.ms_per_token,
                             "tokens_per_call": s.new_tokens / s.target_calls, "ids": list(r.token_ids)}
    return out


def isolated(gen, sizes, repeats: int, gap_ms: float) -> dict[int, float]:
    """tune's timing of single calls (tune._time_calls), each after gap_ms of idle time."""
    rng = np.random.default_rng(0)
    vocab = gen.bundle.tokenizer.vocab_size
    return {n: 1000 * t for n, t in _time_calls(gen.target, CONTEXT, tuple(sizes), repeats, vocab, rng,
                                                 gap_ms / 1000).items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--prompts", default="stratified-2")
    ap.add_argument("--repeats", type=int, default=5, help="isolated calls per size (median)")
    ap.add_argument("--gap-ms", type=float, default=0.0, help="idle time before each isolated call")
    ap.add_argument("--race", action="store_true", help="also generate with each cost curve in turn")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    gen = spectr_edge.load(args.bundle, provider="cpu", prefix_cache=False)
    codec = TextCodec(gen.bundle.tokenizer)
    prompts = harness.select_prompts(harness.load_questions(), args.prompts)
    gen.generate("Hello", max_new_tokens=8)                                   # warm-up
    timer = CallTimer(gen.target)
    timer.times.clear()
    generate(gen, prompts, codec)
    inside = {n: (len(t), 1000 * statistics.median(t)) for n, t in sorted(timer.times.items()) if n <= 16}
    sizes = [n for n, (count, _) in inside.items() if count >= 3]
    alone = isolated(gen, sizes, args.repeats, args.gap_ms)
    base = sizes[0]
    print(f"{args.bundle}: {len(prompts)} prompts, greedy default, 128 tokens; isolated calls after a "
          f"{CONTEXT}-token past" + (f", {args.gap_ms:g} ms idle before each" if args.gap_ms else ""))
    print("| tokens in the call | calls in generation | ms, in generation | relative | ms, isolated | relative |")
    print("|---|---|---|---|---|---|")
    for n in sizes:
        count, ms = inside[n]
        print(f"| {n} | {count} | {ms:.1f} | {ms / inside[base][1]:.2f} | {alone[n]:.1f} | {alone[n] / alone[base]:.2f} |")
    result = {"inside": inside, "isolated": alone, "gap_ms": args.gap_ms}
    if args.race:
        spec = gen.target.spec
        curve = lambda pts: CostCurve(pts).floored(spec.min_call_tokens, spec.call_multiple)  # noqa: E731
        rel = lambda d: [(1, 1.0)] + [(n, d[n] / d[base]) for n in sizes if n > 1]  # noqa: E731
        curves = {"built-in": CostCurve.for_quant(spec.quant).floored(spec.min_call_tokens, spec.call_multiple),
                  "isolated": curve(rel(alone)), "in generation": curve(rel({n: v[1] for n, v in inside.items()}))}
        runs = {name: {} for name in curves}
        for i, p in enumerate(prompts):
            for name in (list(curves) if i % 2 == 0 else list(curves)[::-1]):
                gen.engine.cost = curves[name]
                runs[name].update(generate(gen, [p], codec))
        ref = runs["built-in"]
        print("\n| length rules' curve | ms/token median | vs built-in, median of per-prompt ratios | faster on "
              "| tokens per call | same tokens |")
        print("|---|---|---|---|---|---|")
        for name, r in runs.items():
            ratios = [ref[k]["ms"] / r[k]["ms"] for k in r]
            print(f"| {name} | {statistics.median(v['ms'] for v in r.values()):.1f} | {statistics.median(ratios):.3f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f}) | {sum(x > 1 for x in ratios)} of {len(ratios)} | "
                  f"{statistics.mean(v['tokens_per_call'] for v in r.values()):.2f} | "
                  f"{sum(r[k]['ids'] == ref[k]['ids'] for k in r)} of {len(r)} |")
        result["race"] = {name: {k: {"ms": v["ms"], "tokens_per_call": v["tokens_per_call"]} for k, v in r.items()}
                          for name, r in runs.items()}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
