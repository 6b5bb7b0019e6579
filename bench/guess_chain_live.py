"""The guess head's chain in generation: how often each chain position is accepted, and what it does
to tokens per target call and to ms/token, under the bundle's cost curve and under a flat one.

    .venv/bin/python bench/guess_chain_live.py models/default-int4 --prompts stratified-2

Per Spec-Bench prompt (greedy, 128 tokens, one process, the three taking turns prompt by prompt):
target-only; the default drafter with the bundle's cost curve (what `generate` does on this
machine); the same with a flat curve, calls of up to 8 tokens priced as one decode, as on a target
where verification is memory-bound (a GPU, a float32 or w8a8 target): there the length rule drafts
the chain as far as its acceptance goes, so its per-position acceptance in generation is measured
even where, as on an int4 target on 2 cores, it would not pay. Greedy output is compared with
target-only token for token under both curves.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402
import spectr_edge  # noqa: E402
from spectr_edge import lookup  # noqa: E402
from spectr_edge.policy import CostCurve  # noqa: E402
from spectr_edge.text import TextCodec  # noqa: E402

FLAT = CostCurve([(1, 1.0), (8, 1.0), (16, 2.0)])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--prompts", default="stratified-2")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", help="write the per-prompt figures as JSON here")
    args = ap.parse_args(argv)
    gen = spectr_edge.load(args.bundle, provider="cpu", prefix_cache=False, load_draft=False)
    if gen.target.chain is None:
        raise SystemExit(f"error: {args.bundle} has no guess chain (spectr-edge export --add-guess-head --out ...)")
    codec = TextCodec(gen.bundle.tokenizer)
    prompts = harness.select_prompts(harness.load_questions(), args.prompts)
    own = gen.engine.cost
    reached, accepted = collections.Counter(), collections.Counter()
    update = lookup.PromptLookup.update

    def counting(self, n, draft_len, acc):          # chain positions verified and accepted, guess steps only
        if n == lookup.GUESS:
            for j in range(min(acc + 1, draft_len)):
                reached[(curve_name[0], j)] += 1
                accepted[(curve_name[0], j)] += j < acc
        return update(self, n, draft_len, acc)

    lookup.PromptLookup.update = counting
    curve_name = ["warm-up"]                                     # its steps are counted apart
    gen.generate("Hello", max_new_tokens=8)
    runs = {"target-only": {}, "own": {}, "flat": {}}
    for i, p in enumerate(prompts):
        ids = codec.encode_prompt(p["prompt"])
        for name in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            curve_name[0] = name
            gen.engine.cost = FLAT if name == "flat" else own
            opts = {"num_candidates": 0} if name == "target-only" else {}
            r = gen.generate_ids(ids, max_new_tokens=args.max_new_tokens, **opts)
            s = r.stats
            runs[name][str(p["id"])] = {"ms": s.ms_per_token, "tokens_per_call": s.new_tokens / s.target_calls,
                                       "guess_steps": s.guess_steps, "guess_drafted": s.guess_drafted,
                                       "guess_accepted": s.guess_accepted, "ids": list(r.token_ids)}
    ref = runs["target-only"]
    print(f"{args.bundle}: {len(prompts)} prompts ({args.prompts}), greedy, {args.max_new_tokens} tokens")
    print("| cost curve | ms/token median | vs target-only (median of per-prompt ratios) | tokens per call | "
          "guess steps | guesses drafted | accepted | chain acceptance by position | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        ratios = [ref[k]["ms"] / r[k]["ms"] for k in r]
        total = lambda key: sum(v[key] for v in r.values())  # noqa: E731
        by_pos = " ".join(f"{accepted[(name, j)] / reached[(name, j)]:.2f} ({reached[(name, j)]})"
                          for j in range(8) if reached[(name, j)])
        print(f"| {name} | {statistics.median(v['ms'] for v in r.values()):.1f} | {statistics.median(ratios):.3f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}) | {statistics.mean(v['tokens_per_call'] for v in r.values()):.2f} "
              f"| {total('guess_steps')} | {total('guess_drafted')} | {total('guess_accepted')} | {by_pos or '-'} | "
              f"{sum(r[k]['ids'] == ref[k]['ids'] for k in r)} of {len(r)} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs, "chain": {f"{n} {j}": [accepted[(n, j)], reached[(n, j)]]
                                                                      for n, j in reached}}, indent=1))


if __name__ == "__main__":
    main()
