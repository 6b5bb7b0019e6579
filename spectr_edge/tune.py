"""`spectr-edge tune`: measure this machine's costs for a bundle and store them in its manifest.

What is measured (ONNX Runtime sessions as `generate` opens them, same provider and threads):
  * the target's verification cost curve: one call scoring n new tokens in one row after a
    CONTEXT-token past, n in SIZES, median of `repeats` calls after a warm-up call per n, relative
    to n = 1 (a decode step);
  * the draft's decode step (one token after the same past), relative to the target's.
They go into spectr.json as models.target.cost_curve ([[n, relative cost], ...]) and
models.draft.decode_cost, plus a "tuning" record (date, provider, threads, milliseconds). The
per-step length rules (policy.AdaptiveLength for the draft model, lookup.PromptLookup for prompt
lookup) read them; acceptance is not calibrated here but learnt per generation from its own
verified steps, so no prompt set is needed and none of the benchmark prompts is used.

The manifest is rewritten atomically (a temporary file, then os.replace); models are untouched.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from .policy import CostCurve, default_draft_cost

SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
CONTEXT = 128          # past tokens before the timed calls: a short chat prompt


def _time_calls(model, cache_len: int, n: int, repeats: int, vocab: int, rng) -> float:
    """Median seconds of one forward of n tokens after a cache_len-token past."""
    cache = model.new_cache()
    model.forward(rng.integers(0, vocab, (1, cache_len)).astype(np.int64), cache)   # the past
    times = []
    for i in range(repeats + 1):
        ids = rng.integers(0, vocab, (1, n)).astype(np.int64)
        started = time.perf_counter()
        model.forward(ids, cache)
        elapsed = time.perf_counter() - started
        cache.crop(cache_len)
        if i:                      # the first call of each shape is a warm-up
            times.append(elapsed)
    return statistics.median(times)


def measure(gen, sizes=SIZES, repeats: int = 5, progress=print) -> dict:
    """Cost curve of the target and decode cost of the draft, in milliseconds and relative."""
    vocab = gen.bundle.tokenizer.vocab_size
    rng = np.random.default_rng(0)
    past = min(CONTEXT, gen.engine.context_length - max(sizes) - 1)   # tiny test models have tiny contexts
    if past < 1:
        raise ValueError(f"the context ({gen.engine.context_length} tokens) is too short to tune")
    ms = {}
    for n in sizes:
        ms[n] = 1000 * _time_calls(gen.target, past, n, repeats, vocab, rng)
        progress(f"target, {n:2d} tokens in one call: {ms[n]:8.1f} ms  ({ms[n] / ms[sizes[0]]:.2f}x a decode step)")
    # scoring more tokens never costs less: below-1 or falling ratios are timing noise (tiny models)
    ratios = np.maximum.accumulate(np.maximum([ms[n] / ms[sizes[0]] for n in sizes], 1.0))
    out = {"past": past, "target_ms": ms, "cost_curve": [[n, round(float(r), 4)] for n, r in zip(sizes, ratios)]}
    if gen.draft is not None:
        d = 1000 * _time_calls(gen.draft, past, 1, repeats, vocab, rng)
        out.update(draft_ms=d, decode_cost=round(d / ms[sizes[0]], 4))
        progress(f"draft decode step: {d:.1f} ms ({d / ms[sizes[0]]:.3f}x the target's)")
    return out


def explain(result: dict, bundle) -> list[str]:
    """What the length rules will do with these costs, at a few acceptance rates."""
    from .policy import best_length

    cost = CostCurve(result["cost_curve"])
    lines = []
    if "decode_cost" in result:
        guess = default_draft_cost(bundle.target.size_bytes, bundle.draft.size_bytes)
        lines.append(f"draft model (one drafted token = {result['decode_cost']:.3f} decode steps; "
                     f"the untuned default guessed {guess:.3f}):")
        for a in (0.5, 0.7, 0.9):
            length, gain = best_length(cost, result["decode_cost"], [a] * 8)
            lines.append(f"  acceptance {a:.1f}: draft {length} tokens per step, "
                         f"{gain:.2f}x the tokens per unit of time of plain decoding")
    lines.append("prompt lookup (drafting is free; verifying n tokens costs the curve above):")
    for a in (0.3, 0.6, 0.9):
        length, gain = best_length(cost, 0.0, [a] * 8)
        lines.append(f"  acceptance {a:.1f}: verify up to {length} copied tokens ({gain:.2f}x)")
    return lines


def write(bundle_path: Path, result: dict, provider: str, threads) -> None:
    """Store the measurements in the manifest, atomically."""
    manifest_path = Path(bundle_path) / "spectr.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["models"]["target"]["cost_curve"] = result["cost_curve"]
    if "decode_cost" in result and "draft" in manifest["models"]:
        manifest["models"]["draft"]["decode_cost"] = result["decode_cost"]
    manifest["tuning"] = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "provider": provider,
                          "threads": threads or "onnxruntime default", "past_tokens": result["past"],
                          "machine": f"{platform.machine()}, {os.cpu_count()} cpus, {platform.platform()}",
                          "target_ms": {str(n): round(v, 3) for n, v in result["target_ms"].items()},
                          **({"draft_ms": round(result["draft_ms"], 3)} if "draft_ms" in result else {})}
    tmp = manifest_path.with_name(f".spectr.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, manifest_path)
