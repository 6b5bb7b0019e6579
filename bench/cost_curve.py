"""Verification cost curve: time of one call scoring n tokens in one row, and b rows x m tokens.

For each model of a bundle (target and draft), after a real prefix of `--past` cached
positions, times one `session.run` that scores n new tokens in one row (n = 1..32) and b
rows of m tokens each (the replicated verification of k candidates of L tokens has
b = k, m = L + 1). Every point is the median of `--repeats` calls, points interleaved
round by round so machine drift hits all alike; the cache is restored before every call.

    .venv/bin/python bench/cost_curve.py --bundle models/default --out bench/results/DATE-cost-curve

Writes raw.json (every timing), table.md and cost_curve.png into --out. The ratios to
n = 1 are what tuning needs (spectr_edge does not read this file; `tune` will measure its own).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine_info  # noqa: E402

import spectr_edge  # noqa: E402
from spectr_edge.kv_cache import KVCache  # noqa: E402

NS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)
ROWS = ((2, 3), (2, 4), (2, 5), (4, 3), (4, 4), (4, 5), (8, 4))   # (b rows, m tokens each)


def _prefix_cache(model, ids: np.ndarray) -> list:
    cache = model.new_cache()
    model.forward(ids[None, :], cache)
    return cache.layers


def _time_call(model, saved: list, rows: int, new: int, rng: np.random.Generator) -> float:
    cache = KVCache.__new__(KVCache)
    cache.layers = saved
    if rows > 1:
        cache.repeat_rows(rows)
    ids = rng.integers(0, 1000, size=(rows, new))   # token ids do not change the cost
    started = time.perf_counter()
    model.forward(ids, cache)
    return time.perf_counter() - started


def measure(model, past: int, repeats: int, rng: np.random.Generator) -> dict[str, float]:
    prefix = rng.integers(0, 1000, size=past)
    saved = _prefix_cache(model, prefix)
    points = [("1x%d" % n, 1, n) for n in NS] + [("%dx%d" % (b, m), b, m) for b, m in ROWS]
    for _, b, m in points:   # warm-up: first call of a shape selects kernels and allocates
        _time_call(model, saved, b, m, rng)
    times: dict[str, list[float]] = {name: [] for name, _, _ in points}
    for _ in range(repeats):
        for name, b, m in points:
            times[name].append(_time_call(model, saved, b, m, rng))
    return {name: 1000 * statistics.median(t) for name, t in times.items()}, times


def markdown(result: dict) -> str:
    lines = []
    for role, ms in result.items():
        base = ms["1x1"]
        lines.append(f"**{role}** (ms per call, and the ratio to scoring 1 token)\n")
        lines.append("| n tokens, 1 row | " + " | ".join(str(n) for n in NS) + " |")
        lines.append("|---" * (len(NS) + 1) + "|")
        lines.append("| ms | " + " | ".join(f"{ms['1x%d' % n]:.1f}" for n in NS) + " |")
        lines.append("| ratio | " + " | ".join(f"{ms['1x%d' % n] / base:.2f}" for n in NS) + " |")
        lines.append("")
        lines.append("| b rows x m tokens | " + " | ".join(f"{b}x{m}" for b, m in ROWS) + " |")
        lines.append("|---" * (len(ROWS) + 1) + "|")
        lines.append("| ms | " + " | ".join(f"{ms['%dx%d' % (b, m)]:.1f}" for b, m in ROWS) + " |")
        lines.append("| ratio | " + " | ".join(f"{ms['%dx%d' % (b, m)] / base:.2f}" for b, m in ROWS)
                     + " |")
        lines.append("| same tokens in 1 row | " + " | ".join(
            f"{ms['1x%d' % (b * m)] / base:.2f}" if b * m in NS else "-" for b, m in ROWS) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    from report import _plt, save
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for role, ms in result.items():
        base = ms["1x1"]
        ax.plot(NS, [ms["1x%d" % n] / base for n in NS], marker="o", label=f"{role}: n tokens in 1 row")
        tokens = [b * m for b, m in ROWS]
        ax.scatter(tokens, [ms["%dx%d" % (b, m)] / base for b, m in ROWS], marker="x", s=60,
                   label=f"{role}: b rows x m tokens (replicated)")
        for (b, m), t in zip(ROWS, tokens):
            ax.annotate(f"{b}x{m}", (t, ms["%dx%d" % (b, m)] / base), fontsize=7,
                        textcoords="offset points", xytext=(4, -8))
    ax.set_xlabel("tokens scored in one call")
    ax.set_ylabel("call time / time of a 1-token call")
    ax.set_title("Verification cost curve (one ONNX Runtime call)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default="models/default")
    ap.add_argument("--past", type=int, default=256, help="cached positions before the timed call")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gen = spectr_edge.load(args.bundle, provider="cpu", threads=args.threads)
    rng = np.random.default_rng(0)
    result, raw = {}, {}
    for role, model in (("target", gen.target), ("draft", gen.draft)):
        if model is None:
            continue
        print(f"measuring {role} ...", file=sys.stderr, flush=True)
        result[role], raw[role] = measure(model, args.past, args.repeats, rng)
    meta = {"command": " ".join(sys.argv), "bundle": args.bundle, "past": args.past, "repeats": args.repeats,
            "threads": args.threads or "ORT default", **machine_info()}
    (out / "raw.json").write_text(json.dumps({"meta": meta, "median_ms": result, "ms": raw}, indent=1))
    (out / "table.md").write_text(markdown(result) + "\n")
    plot(result, out / "cost_curve.png")
    print(markdown(result))


if __name__ == "__main__":
    main()
