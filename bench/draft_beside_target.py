"""Where should the draft run on a small CPU? (docs/PERFORMANCE.md: what limits the speedup)

Times one bundle's decode calls after a 100-token past (1-token draft calls, 4-token target
calls, the engine's verification size) in four arrangements:

  sequential   the engine's way: the target on all cores, then the draft, alternating
               (3 draft calls, one 4-token verification), the draft with 1 or 2 threads,
               its pool spinning or not;
  beside       the target on `--cores - 1` threads while the draft decodes on a thread of its own
               in parallel (PEARL-style drafting during verification would need this);
  crowded      the target on every core with the draft decoding beside it.

    .venv/bin/python bench/draft_beside_target.py --bundle models/default
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from spectr_edge.bundle import read_bundle  # noqa: E402
from spectr_edge.onnx_model import OnnxLM  # noqa: E402

RNG = np.random.default_rng(0)


def prepared(spec, threads: int, spinning: bool = True):
    model = OnnxLM(spec, provider="cpu", threads=threads, spinning=spinning)
    cache = model.new_cache()
    model.forward(RNG.integers(100, 5000, size=(1, 100)), cache, last=1)
    return model, cache


def call(model, cache, new: int = 1) -> float:
    """One call scoring `new` tokens after the past; the cache is rolled back afterwards."""
    start = time.perf_counter()
    model.forward(RNG.integers(100, 5000, size=(1, new)), cache, last=new)
    cache.crop(cache.length - new)
    return time.perf_counter() - start


def ms(values) -> str:
    return f"{1000 * statistics.median(values):6.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default="models/default")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    bundle = read_bundle(args.bundle)
    rounds = args.rounds

    target, t_cache = prepared(bundle.target, args.cores)
    print(f"target, {args.cores} threads: 1 token {ms([call(target, t_cache, 1) for _ in range(rounds)])}, "
          f"4 tokens {ms([call(target, t_cache, 4) for _ in range(rounds)])}", flush=True)
    for threads, spinning in ((1, False), (2, False), (2, True)):
        draft, d_cache = prepared(bundle.draft, threads, spinning)
        alone = [call(draft, d_cache) for _ in range(2 * rounds)]
        drafts, verifies = [], []
        for _ in range(rounds):
            drafts += [call(draft, d_cache) for _ in range(3)]
            verifies.append(call(target, t_cache, 4))
        step = 3 * statistics.median(drafts) + statistics.median(verifies)
        print(f"sequential, draft {threads} thread(s), spinning {'on ' if spinning else 'off'}: draft alone "
              f"{ms(alone)}; alternating: draft {ms(drafts)}, target(4) {ms(verifies)}, "
              f"3 drafts + 1 verification {1000 * step:6.1f} ms", flush=True)
        if (threads, spinning) == (1, False):
            _beside("crowded", target, t_cache, draft, d_cache, rounds)
        del draft, d_cache
    del target, t_cache
    target, t_cache = prepared(bundle.target, max(args.cores - 1, 1))
    print(f"target, {max(args.cores - 1, 1)} thread(s): 4 tokens "
          f"{ms([call(target, t_cache, 4) for _ in range(rounds)])}", flush=True)
    draft, d_cache = prepared(bundle.draft, 1, spinning=False)
    _beside("beside", target, t_cache, draft, d_cache, rounds)


def _beside(name, target, t_cache, draft, d_cache, rounds) -> None:
    """The draft decodes in a loop on a thread of its own while the target verifies 4 tokens."""
    stop = threading.Event()
    drafts: list[float] = []

    def drafter():
        while not stop.is_set():
            drafts.append(call(draft, d_cache))

    worker = threading.Thread(target=drafter)
    worker.start()
    verifies = [call(target, t_cache, 4) for _ in range(rounds)]
    stop.set()
    worker.join()
    print(f"{name}: target(4) {ms(verifies)} while the draft decodes beside it at {ms(drafts)} per call "
          f"({len(drafts) / rounds:.1f} draft calls per verification)", flush=True)


if __name__ == "__main__":
    main()
