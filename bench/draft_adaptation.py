"""Adapting the draft to one domain: record a bundle's target on a training split of prompts (as a
deployment recording its traffic with --record would), then adapt the draft of a copy of the bundle
on it with `spectr-edge adapt`. The side-by-side comparison on new prompts of the same domain and on
other prompts is `bench/run.py --suite adaptation` (it reads the copy; its default prompts are
suites.ADAPTATION_PROMPTS, none of them recorded here).

    .venv/bin/python bench/draft_adaptation.py --bundle models/default --out models/default-adapted \
        --train SUBSET   (default TRAIN: 120 Spec-Bench questions answered in German)

German answers are where the default draft agrees least with the target among the domains tried:
first-position greedy acceptance 0.54 against 0.76 for the same six questions answered in English.

Prints and writes (--report) the recording's size and time, adapt's output, its wall time and peak
resident memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402

# mt_bench 81-130, qa 321-360, math_reasoning 401-430, each answered in German
TRAIN = "de:ids-" + ",".join(str(i) for i in [*range(81, 131), *range(321, 361), *range(401, 431)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default=str(harness.ROOT / "models" / "default"))
    ap.add_argument("--out", default=str(harness.ROOT / "models" / "default-adapted"))
    ap.add_argument("--train", default=TRAIN,
                    help="the prompts recorded (first-N, stratified-N, ids-A,B; de:SUBSET in German)")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=96)
    ap.add_argument("--recording", default=None, help="recording directory [default: OUT.recording]")
    ap.add_argument("--minutes", type=float, default=12.0, help="adapt's training budget")
    ap.add_argument("--layers", type=int, default=None, help="adapt's trained layers [default: adapt's]")
    ap.add_argument("--lr", type=float, default=None, help="adapt's learning rate [default: adapt's]")
    ap.add_argument("--greedy-weight", type=float, default=None, help="adapt's --greedy-weight [default: adapt's]")
    ap.add_argument("--report", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    import spectr_edge

    out, rec = Path(args.out), Path(args.recording or f"{args.out}.recording")
    prompts = harness.select_prompts(harness.load_questions(), args.train)
    if not (rec / "traffic.jsonl").exists():
        gen = spectr_edge.load(args.bundle, provider="cpu", record=rec)
        started = time.perf_counter()
        for i, q in enumerate(prompts):
            res = gen.generate(q["prompt"], max_new_tokens=args.max_new_tokens)
            print(f"recorded {i + 1}/{len(prompts)}: prompt {q['id']}, {res.stats.new_tokens} tokens, "
                  f"{res.stats.tokens_per_target_call:.2f} tokens per target call", flush=True)
        record_s = time.perf_counter() - started
        del gen
    else:
        record_s = None
        print(f"{rec}: recorded before; using it")
    size = (rec / "traffic.jsonl").stat().st_size

    if out.exists():
        shutil.rmtree(out)
    harness.link_or_copy(Path(args.bundle), out)      # adapt replaces files, never writes into them
    started = time.perf_counter()
    cmd = [str(Path(sys.executable).parent / "spectr-edge"), "adapt", "--bundle", str(out), "--from", str(rec),
           "--minutes", str(args.minutes)]
    cmd += ["--layers", str(args.layers)] if args.layers is not None else []
    cmd += ["--lr", str(args.lr)] if args.lr is not None else []
    cmd += ["--greedy-weight", str(args.greedy_weight)] if args.greedy_weight is not None else []
    done = subprocess.run(cmd, text=True, capture_output=True)
    adapt_s = time.perf_counter() - started
    print(done.stdout + done.stderr)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    report = {"machine": harness.machine_info(), "bundle": args.bundle, "out": str(out), "recording": str(rec),
              # a recording made before may hold other prompts than --train names
              "train": args.train if record_s is not None else None,
              "prompts": len(prompts) if record_s is not None else None,
              "recording_bytes": size, "recording_seconds": record_s,
              "adapt_seconds": round(adapt_s, 1), "adapt_peak_rss_bytes": peak, "adapt_exit": done.returncode,
              # adapt reports on stdout; stderr holds the GGUF reader's progress bars, and an error when it failed
              "adapt_output": (done.stdout + (done.stderr if done.returncode else "")).splitlines()[-12:],
              "command": " ".join(cmd)}
    print(f"recording {size / 2**20:.1f} MiB; adapt {adapt_s:.0f} s, peak resident memory {peak / 2**30:.1f} GiB, "
          f"exit {done.returncode}")
    if args.report:
        args.report.write_text(json.dumps(report, indent=1))
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
