"""How much a spectr-edge worker's speed depends on its process: the same bundle's greedy default, timed
the two ways a benchmark suite could make two rows of it differ.

--in-process: one process generates the prompts with the default alone, then with a target-only
  generation of each prompt beside it (before it on even prompts, after it on odd ones, as bench/run.py
  orders methods), then alone again. If target-only generations slowed the default sharing their
  process, the middle pass would be the slowest. The middle pass also gives target-only's ms/token over
  the default's per prompt; --repeat N goes through the prompts N times (one prompt, many alternations:
  `--prompts ids-321 --repeat 8`).
--pairs N: N times, two fresh workers of the same bundle (bench/run.py's, bench/workers/spectr_worker.py)
  are started one after the other and
  the default alternates between them prompt by prompt (ABBA). Reports the first-started process's
  ms/token over the second's (median of per-prompt ratios): how far two processes of one bundle differ,
  and whether start order matters. --huge-pages off,on loads the first without spectr_edge.load's
  huge_pages (the weights in 4 KiB pages) and the second with it.

    .venv/bin/python bench/worker_variation.py models/default-int4 --in-process --pairs 3
    .venv/bin/python bench/cpu_mask.py --keep-avx-vnni -- .venv/bin/python bench/worker_variation.py ...

Under bench/cpu_mask.py the pairs' workers inherit the mask. Prints a line per pass or pair and writes
--out as JSON. Greedy: every pass and process must produce the same tokens (checked).
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


def in_process(bundle: str, prompts: str, tokens: int, repeat: int = 1) -> dict:
    import spectr_edge
    from spectr_edge.text import TextCodec

    gen = spectr_edge.load(bundle, provider="cpu", prefix_cache=False)   # as bench/workers/spectr_worker.py
    codec = TextCodec(gen.bundle.tokenizer)
    ids = [codec.encode_prompt(p["prompt"]) for p in harness.select_prompts(harness.load_questions(), prompts)] * repeat
    gen.generate_ids(ids[0], max_new_tokens=8)                             # warm-up

    def timed(p, **options) -> tuple[float, list[int]]:
        r = gen.generate_ids(p, max_new_tokens=tokens, **options)
        return r.stats.ms_per_token, list(r.token_ids)

    passes, reference = {}, None
    for name in ("default alone", "beside target-only", "default alone again"):
        ms, toks, plain = [], [], []
        for i, p in enumerate(ids):
            if name == "beside target-only" and i % 2 == 0:
                plain.append(timed(p, num_candidates=0)[0])
            m, t = timed(p)
            if name == "beside target-only" and i % 2 == 1:
                plain.append(timed(p, num_candidates=0)[0])
            ms.append(m)
            toks.append(t)
        reference = reference or toks
        passes[name] = {"ms": ms, "same_tokens": sum(a == b for a, b in zip(toks, reference))}
        print(f"in one process, {name}: {statistics.median(ms):.1f} ms/token (median over {len(ids)} prompts; "
              f"same tokens as the first pass on {passes[name]['same_tokens']} of {len(ids)})", flush=True)
        if plain:
            ratios = [a / b for a, b in zip(plain, ms)]
            passes[name].update(target_only_ms=plain, target_only_over_default=ratios)
            print(f"  target-only beside it: {statistics.median(plain):.1f} ms/token; target-only over the default "
                  f"{statistics.median(ratios):.3f} (median of per-generation ratios, {min(ratios):.3f}-"
                  f"{max(ratios):.3f}; the default faster on {sum(r > 1 for r in ratios)} of {len(ratios)})",
                  flush=True)
    return passes


def pairs(bundle: str, prompts: str, tokens: int, n: int, huge_pages: tuple[str, str]) -> list[dict]:
    """bench/run.py's workers (bench/workers/spectr_worker.py), two at a time, the default greedy."""
    import run

    chosen = harness.select_prompts(harness.load_questions(), prompts)
    run.encode_prompts(bundle, chosen)
    count = len(chosen)
    out = []
    for k in range(n):
        workers = []
        try:
            for setting in huge_pages:
                cmd = [run.PY, str(BENCH / "workers" / "spectr_worker.py"), "--bundle", bundle, "--provider", "cpu"]
                workers.append(run.Worker("spectr", cmd + ["--no-huge-pages" if setting == "off" else "--huge-pages"],
                                          sys.stderr))
            request = lambda p, max_new: {"id": str(p["id"]), "prompt": p["prompt"], "prompt_ids": p["prompt_ids"],  # noqa: E731
                                          "max_new_tokens": max_new, "seed": 0, "config": {"temperature": 0.0}}
            for w in workers:                                              # warm-up
                w.request(request(chosen[0], 8))
            ms, same = ([], []), 0
            for i, p in enumerate(chosen):
                answers = []
                for w in ((0, 1) if i % 2 == 0 else (1, 0)):
                    row = run.measurement(workers[w].request(request(p, tokens))[0])
                    ms[w].append(row["ms_per_token"])
                    answers.append(row["token_ids"])
                same += answers[0] == answers[1]
        finally:
            for w in workers:
                w.close()
        ratios = [a / b for a, b in zip(*ms)]
        out.append({"first": ms[0], "second": ms[1], "ratios": ratios, "same_tokens": same})
        print(f"pair {k + 1} (huge pages {huge_pages[0]}, {huge_pages[1]}): first-started {statistics.median(ms[0]):.1f}, "
              f"second {statistics.median(ms[1]):.1f} ms/token; first over second {statistics.median(ratios):.3f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}, first slower on {sum(r > 1 for r in ratios)} of {count}); "
              f"same tokens on {same} of {count}", flush=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--prompts", default="stratified-2", help="Spec-Bench subset (bench/data/README.md)")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--in-process", action="store_true", help="the default alone, beside target-only, alone")
    ap.add_argument("--repeat", type=int, default=1, help="--in-process: go through the prompts this many times")
    ap.add_argument("--pairs", type=int, default=0, help="fresh pairs of worker processes to compare")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    ap.add_argument("--huge-pages", default="on,on",
                    help="the pair's load option huge_pages, first-started and second: on,on (default), off,on, ...")
    args = ap.parse_args(argv)
    settings = tuple(args.huge_pages.split(","))
    if len(settings) != 2 or set(settings) - {"on", "off"}:
        raise SystemExit(f"error: --huge-pages takes two of on/off, e.g. off,on (got {args.huge_pages!r})")
    if not args.in_process and not args.pairs:
        raise SystemExit("error: nothing to measure; pass --in-process and/or --pairs N")
    if args.repeat < 1:
        raise SystemExit(f"error: --repeat must be >= 1, not {args.repeat}")
    result = {"machine": harness.machine_info(), "args": {k: str(v) for k, v in vars(args).items()}}
    if args.in_process:
        result["in_process"] = in_process(args.bundle, args.prompts, args.max_new_tokens, args.repeat)
    if args.pairs:
        result["pairs"] = pairs(args.bundle, args.prompts, args.max_new_tokens, args.pairs, settings)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
