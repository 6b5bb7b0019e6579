"""Resident memory over many generations in one process: does anything grow per request?

Builds the toy bundle of the tests (tests/toy_lm.py: two tiny ONNX graphs, vocabulary 5) unless
--bundle names one, then runs N short generations in one process, alternating greedy and sampled,
speculative and target-only, prompt lookup, and stop strings, and prints resident memory (RSS)
every --every generations. Memory is flat when the RSS after warm-up (the first tenth) and at the
end differ by a few percent at most.

    .venv/bin/python bench/memory_soak.py                     # 1,000 generations on the toy bundle
    .venv/bin/python bench/memory_soak.py --bundle models/default -n 200 --tokens 16
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, default=None, help="bundle directory [default: the tests' toy bundle]")
    ap.add_argument("-n", "--generations", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=12, help="new tokens per generation")
    ap.add_argument("--every", type=int, default=100, help="print RSS every this many generations")
    args = ap.parse_args()

    import spectr_edge

    tmp = None
    bundle = args.bundle
    if bundle is None:
        from toy_lm import build_toy_bundle

        tmp = tempfile.TemporaryDirectory()
        bundle = build_toy_bundle(Path(tmp.name) / "toy", seed_target=81, seed_draft=82)
    gen = spectr_edge.load(bundle, provider="cpu", threads=1)
    words = gen.codec.decode(list(range(min(5, gen.bundle.tokenizer.vocab_size))))
    prompt = " ".join(words.split()[:3]) or "Hello"
    variants = [dict(temperature=0.0), dict(temperature=1.0, seed=1), dict(num_candidates=0),
                dict(drafter="lookup"), dict(temperature=0.7, top_k=3, top_p=0.9, seed=2), dict(stop=[" b "])]
    print(f"# {cpu_name()}, {os.cpu_count()} CPUs, python {platform.python_version()}, "
          f"bundle {bundle}, {args.generations} generations of {args.tokens} tokens")
    print("generation  rss_mib  seconds")
    started, marks = time.perf_counter(), {}
    for i in range(1, args.generations + 1):
        gen.generate(prompt, max_new_tokens=args.tokens, chat=False, **variants[i % len(variants)])
        if i % args.every == 0 or i == 1:
            marks[i] = rss_mib()
            print(f"{i:10d}  {marks[i]:7.1f}  {time.perf_counter() - started:7.1f}", flush=True)
    warm = marks.get(max(args.every, args.generations // 10), marks[min(marks)])
    end = marks[max(marks)]
    print(f"RSS after warm-up {warm:.1f} MiB, at the end {end:.1f} MiB: {100 * (end - warm) / warm:+.1f}%")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
