"""How fast could speculation get on this machine? Upper bounds for chains and draft trees
(docs/PERFORMANCE.md uses them to say what limits the speedup on a small CPU).

Three views, all seconds to run:

1. `--raw bench/results/<run>/raw.json` (a `--suite trees` run): per method, the per-prompt
   median speedup over target-only measured, the same with the draft model's time removed
   (drafting free, everything else as measured), and tokens per target call against the
   k = 1 / chain default of the same temperature.
2. `--bundle DIR` (a bundle `spectr-edge tune` measured): expected tokens per step of k = 1
   chains and of Sequoia trees of N nodes under the engine's per-rank acceptances
   (trees.SEQUOIA_RANK_ACCEPTANCE, first draw 0.70 = sum min(p, q) of the default bundle),
   and their speedups predicted from the bundle's measured cost curve and draft cost, with
   drafting as measured and with drafting free.

    .venv/bin/python bench/speedup_bound.py --bundle models/default \
        --raw bench/results/2026-12-02-trees-zen3/raw.json --flat

3. `--bundle DIR --guess-chain` (a quantized target with a guess head, its cost curve measured by
   `spectr-edge tune --no-choose`): tokens per unit of target time if the head guessed m tokens
   ahead, and the first-guess agreement m guesses would need to beat one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from spectr_edge.trees import SEQUOIA_RANK_ACCEPTANCE, SequoiaShape  # noqa: E402
from spectr_edge.policy import CostCurve  # noqa: E402


def decode_ms(row: dict) -> float:
    """ms per token after the first (the project's ms/token)."""
    return 1000 * (row["seconds"] - row["ttft_s"]) / max(row["new_tokens"] - 1, 1)


def from_raw(path: Path) -> None:
    rows = json.loads(path.read_text())["rows"]
    by_prompt: dict[int, dict[str, dict]] = defaultdict(dict)
    for row in rows:
        by_prompt[row["prompt_id"]][row["method"]] = row
    methods = sorted({row["method"] for row in rows})
    print(f"{path}: {len(by_prompt)} prompts")
    print("| method | speedup (median) | drafting free | tokens/call | vs the same T's default |")
    print("|---|---|---|---|---|")
    tpc_default = {}
    for method in methods:
        temp = method.split()[1]                       # "T=0" / "T=1"
        if method.endswith(" default"):
            tpc_default[temp] = statistics.median(r["tokens_per_call"] for p in by_prompt.values()
                                                  for m, r in p.items() if m == method)
    for method in methods:
        temp = method.split()[1]
        measured, free, tpc = [], [], []
        for runs in by_prompt.values():
            base = runs.get(f"spectr-edge {temp} target-only")
            row = runs.get(method)
            if base is None or row is None:
                continue
            tokens = max(row["new_tokens"] - 1, 1)
            decode = row["seconds"] - row["ttft_s"]
            measured.append(decode_ms(base) / (1000 * decode / tokens))
            free.append(decode_ms(base) / (1000 * (decode - row["seconds_draft"]) / tokens))
            tpc.append(row["tokens_per_call"])
        ratio = statistics.median(tpc) / tpc_default[temp] if temp in tpc_default else float("nan")
        print(f"| {method} | {statistics.median(measured):.2f}x | {statistics.median(free):.2f}x | "
              f"{statistics.median(tpc):.2f} | {ratio:.2f} |")


def from_bundle(bundle: Path, flat: bool = False) -> None:
    tuning = json.loads((bundle / "spectr.json").read_text()).get("tuning")
    if not tuning or "target_ms" not in tuning:
        sys.exit(f"error: {bundle} holds no measured cost curve; run spectr-edge tune --no-choose --bundle {bundle}")
    measured = CostCurve(tuning["target_ms"].items())            # decode = 1, linear beyond the last size
    one_token_ms, last = tuning["target_ms"]["1"], int(measured.n[-1])

    def cost(n: int) -> float:                                     # one call scoring n tokens, decode = 1
        return 1.0 if flat else measured(n)

    draft = tuning["draft_ms"] / one_token_ms

    def rows(r: int) -> float:     # a draft call over r rows, in single-row calls (measured 2: 1.09, 4: 1.6-1.9)
        return 1.0 if r <= 1 or flat else 1 + 0.2 * (r - 1)

    accept = SEQUOIA_RANK_ACCEPTANCE
    if flat:
        print(f"{bundle}: a flat cost curve (any call = one decode, draft rows free: a GPU's regime); "
              f"draft call {draft:.3f}")
    else:
        print(f"{bundle}: cost curve (decode = 1, {one_token_ms:.1f} ms) "
              + ", ".join(f"{n}: {cost(n):.2f}" for n in (2, 4, 8, 12, 16, 32, 64))
              + f" (beyond {last}: extrapolated); draft call {draft:.3f}")
    print("| policy | E tokens/step | predicted speedup | drafting free | vs the best chain |")
    print("|---|---|---|---|---|")
    chains = []
    for length in range(1, 9):
        tokens = sum(accept[0] ** i for i in range(length + 1))
        chains.append((tokens / (cost(length + 1) + length * draft), length, tokens, tokens / cost(length + 1)))
    best_chain = max(chains)[0]
    for speed, length, tokens, free in chains:
        print(f"| chain L={length} | {tokens:.2f} | {speed:.2f}x | {free:.2f}x | {speed / best_chain:.2f} |")
    for budget in (4, 8, 12, 16, 24, 32, 48, 64, 128):
        best = None
        for depth in range(2, 11):
            shape = SequoiaShape(budget, depth, accept)
            tokens = sum(shape.value)
            calls = sum(rows(sum(1 for i, d in enumerate(shape.depth) if d == level and shape.children[i]))
                        for level in range(depth))
            speed = tokens / (cost(budget + 1) + calls * draft)
            if best is None or speed > best[0]:
                best = (speed, depth, tokens, tokens / cost(budget + 1))
        speed, depth, tokens, free = best
        print(f"| Sequoia {budget} (depth {depth}) | {tokens:.2f} | {speed:.2f}x | {free:.2f}x | "
              f"{speed / best_chain:.2f} |")


def guess_chains(bundle: Path) -> None:
    """Tokens per unit of target time if the target's guess head guessed m tokens ahead instead of
    one (an EAGLE-style head fed its own guesses), from the bundle's measured cost curve (padded as its
    calls are) and its head's held-out agreement a1; later guesses agree with probability `later`
    given the earlier ones. Also the a1 a chain of m would need to match one guess."""
    manifest = json.loads((bundle / "spectr.json").read_text())
    tuning, head = manifest.get("tuning") or {}, manifest.get("guess_head")
    if "target_ms" not in tuning:
        sys.exit(f"error: {bundle} holds no measured cost curve; run spectr-edge tune --no-choose --bundle {bundle}")
    if not head:
        sys.exit(f"error: {bundle} has no guess head; spectr-edge export --add-guess-head --out {bundle}")
    target = manifest["models"]["target"]
    cost = CostCurve(tuning["target_ms"].items()).floored(int(target.get("min_call_tokens", 1)),
                                                         int(target.get("call_token_multiple", 1)))
    a1 = float(head["heldout_agreement"])
    print(f"{bundle}: calls as the runtime pads them, decode = 1: "
          + ", ".join(f"{n} tokens {cost(n):.2f}" for n in range(1, 6))
          + f"; guess head's held-out agreement a1 = {a1:.3f}")
    print("| later guesses agree | guesses m | tokens per call | tokens per unit of time | vs one guess | "
          "a1 that m guesses need to match one |")
    print("|---|---|---|---|---|---|")
    one = (1 + a1) / cost(2)
    for later in (0.5, 0.7, 0.9, 1.0):
        for m in range(1, 5):
            chain = sum(later ** i for i in range(m))            # E = 1 + a1 (1 + later + ... + later^(m-1))
            tokens = 1 + a1 * chain
            below = chain * cost(2) - cost(m + 1)
            need = (cost(m + 1) - cost(2)) / below if below > 0 else float("inf")
            print(f"| {later:.1f} | {m} | {tokens:.2f} | {tokens / cost(m + 1):.2f} | {tokens / cost(m + 1) / one:.2f} | "
                  f"{'-' if m == 1 else ('never' if need > 1 else f'{need:.2f}')} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, help="a bundle with a measured cost curve (spectr-edge tune)")
    ap.add_argument("--flat", action="store_true",
                    help="also predict with a flat cost curve and free draft rows (how a GPU behaves)")
    ap.add_argument("--raw", type=Path, help="raw.json of a bench/run.py --suite trees run")
    ap.add_argument("--guess-chain", action="store_true",
                    help="with --bundle (a quantized target with a guess head): what guessing several tokens "
                         "ahead could yield")
    args = ap.parse_args()
    if not args.bundle and not args.raw:
        ap.error("give --bundle DIR and/or --raw RAW_JSON")
    if args.raw:
        from_raw(args.raw)
    if args.bundle and args.guess_chain:
        guess_chains(args.bundle)
    elif args.bundle:
        from_bundle(args.bundle)
        if args.flat:
            from_bundle(args.bundle, flat=True)


if __name__ == "__main__":
    main()
