"""`spectr-edge tune`: measure this machine's costs for a bundle and store them in its manifest.

What is measured (ONNX Runtime sessions as `generate` opens them, same provider and threads):
  * the target's verification cost curve: one call scoring n new tokens in one row after a
    CONTEXT-token past, n in SIZES, median of `repeats` calls after a warm-up call per n (the
    sizes take turns, round by round, so a slow spell hits all alike), relative to n = 1 (a
    decode step);
  * the draft's decode step (one token after the same past), relative to the target's.
They go into spectr.json as models.target.cost_curve ([[n, relative cost], ...]) and
models.draft.decode_cost, plus a "tuning" record (date, provider, threads, milliseconds). The
per-step length rules (policy.AdaptiveLength for the draft model, lookup.PromptLookup for prompt
lookup) read them; acceptance is not calibrated here but learnt per generation from its own
verified steps, so no prompt set is needed and none of the benchmark prompts is used.

Then it chooses the decoding defaults (`choose`): every candidate policy of the bundle (target
only; the draft model at k = 1 with a few lengths, the adaptive length, the greedy tree with side
leaves, SpecTr k > 1 at temperature 1; prompt lookup alone and before the model) generates the
calibration prompts (spectr_edge/calibration.py, written for this, not benchmark prompts) with
fixed seeds. Each gets two scores: its measured speedup and its predicted speedup (tokens per unit of
predicted time: the measured cost curve for every target call and the draft's cost by rows for
every draft call, GenerationStats.cost_units; repeatable, and the explanation). The measured
one decides: on the 2-core CPU the prediction ranked draft trees first (2.09x) that then ran at
1.27x against 1.65x for k = 1 (bench/RESULTS.md, 2026-11-30: the cost curve, measured on single
calls after a random 128-token past, is flatter than what generation meets). The best of each
regime (greedy, temperature > 0) goes into the manifest's "defaults"; `generate` uses it when
the user sets none of its options. Target-only is a candidate, so a policy measured slower on
the calibration prompts is never chosen. Run it on an otherwise idle machine.

Measured speedup: the geometric mean over the calibration prompts of each prompt's speedup,
wall-clock seconds per token after the first against target-only on the same prompt, measured
in the same sweep: per prompt, target-only runs before and after the candidates and its mean is
the baseline, so machine drift (10-20% over minutes on a shared 2-core VM) hits both alike.
One pass of 48 tokens per prompt cannot tell policies a few percent apart (the int4 bundle's
choice had to be pinned from the benchmark twice), so a race settles near-ties: the candidates
within RACE_MARGIN of the best after the first pass run a second interleaved pass and are
ranked on both.

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

from .bundle import write_manifest
from .policy import CostCurve, default_draft_cost

SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
DRAFT_ROWS = (1, 2, 4)  # candidate rows of one draft step (SpecTr k > 1 drafts k rows at once)
CALIBRATION_TOKENS = 48
RACE_MARGIN = 0.10     # candidates this close to the best after one pass are measured again
RACE_FINALISTS = 4
CONTEXT = 128          # past tokens before the timed calls: a short chat prompt


def _time_calls(model, cache_len: int, sizes, repeats: int, vocab: int, rng, gap_s: float = 0.0) -> dict[int, float]:
    """Median seconds of one forward of n tokens after a cache_len-token past, for each n in sizes.

    The sizes take turns: round r times one call of every size (reversed order on odd rounds), so
    a slow spell of the machine (another job, the disk writing back) lands on a round of every
    size alike, where the median over rounds drops it, instead of on every call of one size (the
    size-by-size schedule once measured a 1-token int4 call at 167 ms against 45 ms for 2 tokens,
    which made every longer call look free). Round 0 is the warm-up of every shape. gap_s: idle
    seconds before each call (not timed), as generation's host work leaves between its calls."""
    cache = model.new_cache()
    model.forward(rng.integers(0, vocab, (1, cache_len)).astype(np.int64), cache)   # the past
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(repeats + 1):
        for n in (sizes if r % 2 == 0 else sizes[::-1]):
            ids = rng.integers(0, vocab, (1, n)).astype(np.int64)
            if gap_s:
                time.sleep(gap_s)
            started = time.perf_counter()
            model.forward(ids, cache)
            elapsed = time.perf_counter() - started
            cache.crop(cache_len)
            if r:
                times[n].append(elapsed)
    return {n: statistics.median(t) for n, t in times.items()}


def monotone_fit(values) -> np.ndarray:
    """The non-decreasing sequence closest to `values` in least squares (pool adjacent violators):
    one slow timing is averaged with its neighbours instead of lifting every later point, as a
    running maximum would."""
    blocks: list[list[float]] = []                       # [mean, count]
    for v in np.asarray(values, dtype=np.float64):
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return np.concatenate([np.full(int(c), m) for m, c in blocks])


def measure(gen, sizes=SIZES, repeats: int = 5, progress=print) -> dict:
    """Cost curve of the target and decode cost of the draft, in milliseconds and relative."""
    vocab = gen.bundle.tokenizer.vocab_size
    rng = np.random.default_rng(0)
    past = min(CONTEXT, gen.engine.context_length - max(sizes) - 1)   # tiny test models have tiny contexts
    if past < 1:
        raise ValueError(f"the context ({gen.engine.context_length} tokens) is too short to tune")
    ms = {n: 1000 * t for n, t in _time_calls(gen.target, past, tuple(sizes), repeats, vocab, rng).items()}
    for n in sizes:
        progress(f"target, {n:2d} tokens in one call: {ms[n]:8.1f} ms  ({ms[n] / ms[sizes[0]]:.2f}x a decode step)")
    # scoring more tokens never costs less: below-1 or falling ratios are timing noise (tiny models)
    ratios = monotone_fit(np.maximum([ms[n] / ms[sizes[0]] for n in sizes], 1.0))
    out = {"past": past, "target_ms": ms, "cost_curve": [[n, round(float(r), 4)] for n, r in zip(sizes, ratios)]}
    if gen.draft is not None:
        d = 1000 * _time_calls(gen.draft, past, (1,), repeats, vocab, rng)[1]
        out.update(draft_ms=d, decode_cost=round(d / ms[sizes[0]], 4))
        progress(f"draft decode step: {d:.1f} ms ({d / ms[sizes[0]]:.3f}x the target's)")
        rows = {1: d}
        for k in DRAFT_ROWS[1:]:
            rows[k] = 1000 * _time_rows(gen.draft, past, k, repeats, vocab, rng)
            progress(f"draft decode step, {k} candidate rows: {rows[k]:.1f} ms ({rows[k] / d:.2f}x one row)")
        ratios = monotone_fit(np.maximum([rows[k] / d for k in DRAFT_ROWS], 1.0))
        out["decode_rows_curve"] = [[k, round(float(r), 4)] for k, r in zip(DRAFT_ROWS, ratios)]
    return out


def _time_rows(model, cache_len: int, rows: int, repeats: int, vocab: int, rng) -> float:
    """Median seconds of one draft step over `rows` candidate rows (one token each) after a past."""
    times = []
    for i in range(repeats + 1):
        cache = model.new_cache()
        model.forward(rng.integers(0, vocab, (1, cache_len)).astype(np.int64), cache)
        cache.repeat_rows(rows)
        ids = rng.integers(0, vocab, (rows, 1)).astype(np.int64)
        started = time.perf_counter()
        model.forward(ids, cache)
        if i:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def candidates(gen) -> dict[str, list[dict]]:
    """The policies `choose` compares, per regime; options as `generate` takes them."""
    greedy: list[dict] = [{"num_candidates": 0}, {"drafter": "lookup"}]
    sampling: list[dict] = [{"num_candidates": 0}, {"drafter": "lookup"}]
    if gen.target.takes_tree and gen.target.spec.min_call_tokens == 1:   # copied candidates in one trie
        greedy.append({"drafter": "lookup", "lookup_candidates": 4})
        sampling.append({"drafter": "lookup", "lookup_candidates": 4})
    if gen.draft is not None:
        model = lambda **kw: {"drafter": "model", "draft_stop": 0.0, "adaptive": False, **kw}  # noqa: E731
        greedy += [model(num_candidates=1, draft_len=3), model(num_candidates=1, draft_len=6, draft_stop=0.5),
                   model(num_candidates=1, draft_len=6, adaptive=True),
                   {"drafter": "model+lookup", "num_candidates": 1, "draft_len": 6, "draft_stop": 0.5,
                    "adaptive": False},
                   {"drafter": "model+lookup", "num_candidates": 1, "draft_len": 6, "draft_stop": 0.0,
                    "adaptive": True}]
        # several candidates or a tree only where tree numerics are exact (no quantized activations)
        exact = gen.target.spec.min_call_tokens == 1
        if gen.target.takes_tree and exact:
            greedy += [model(branches=2, draft_len=4), model(branches=3, draft_len=4)]
            if gen.draft.takes_tree:
                greedy += [model(num_candidates=1, draft_len=6, tree_budget=b) for b in (4, 8, 12)]
        sampling += [model(num_candidates=1, draft_len=L) for L in (2, 3, 4)]
        if exact:
            sampling += [model(num_candidates=k, draft_len=L) for k, L in ((2, 2), (2, 3), (4, 2))]
        if gen.target.takes_tree and gen.draft.takes_tree and exact:      # Sequoia trees
            sampling += [model(num_candidates=1, draft_len=4, tree_budget=b) for b in (4, 8, 12)]
    return {"greedy": greedy, "sampling": sampling}


def describe(options: dict) -> str:
    if not options.get("num_candidates", 1):
        return "target only"
    drafter = options.get("drafter", "model")
    if drafter == "lookup":
        k = options.get("lookup_candidates") or 1
        return "prompt lookup" + (f", {k} candidates in one trie" if k > 1 else "")
    if options.get("tree_budget"):
        return f"{drafter} tree of {options['tree_budget']} nodes, depth <= {options.get('draft_len')}"
    width = f"branches={options['branches']}" if options.get("branches", 1) > 1 else \
        f"k={options.get('num_candidates', 1)}"
    text = f"{drafter} {width} L={options.get('draft_len')}"
    if options.get("draft_stop"):
        text += f" stop {options['draft_stop']:g}"
    if options.get("adaptive"):
        text += " adaptive"
    return text


def choose(gen, tokens: int = CALIBRATION_TOKENS, prompts=None, progress=print) -> dict:
    """Run every candidate on the calibration prompts; the best predicted speedup per regime.

    Returns {"greedy": {"options", "predicted", "candidates": [...]}, "sampling": {...}}.
    """
    from .calibration import CALIBRATION_PROMPTS

    prompts = prompts or CALIBRATION_PROMPTS
    saved = gen.bundle.manifest.pop("defaults", None)      # candidates run with their own options only
    try:
        return _choose(gen, tokens, prompts, progress)
    finally:
        if saved is not None:
            gen.bundle.manifest["defaults"] = saved


def apply(gen, result: dict) -> None:
    """Make the loaded generator predict costs with the just-measured curve and draft costs."""
    gen.engine.cost = CostCurve(result["cost_curve"]).floored(gen.target.spec.min_call_tokens,
                                                              gen.target.spec.call_multiple)
    if "decode_cost" in result:
        gen.engine.draft_cost = result["decode_cost"]
        gen.engine.draft_rows = CostCurve(result["decode_rows_curve"])


def _run_prompt(gen, prompt, options, tokens, temperature, seed) -> dict | None:
    """One calibration generation: its decode-phase counts and seconds (None if it made < 2 tokens)."""
    st = gen.generate_ids(prompt, max_new_tokens=tokens, temperature=temperature, seed=seed, **options).stats
    if st.new_tokens < 2:
        return None
    new = st.new_tokens - 1
    return {"new": new, "cost": st.cost_units if options.get("num_candidates", 1) else new,
            "seconds": st.seconds_total - st.seconds_first_token, "calls": st.target_calls - 1}


def _sweep(gen, prompts, options_list, tokens, temperature, runs: dict, ratios: dict,
           progress=lambda _: None, title: str = "") -> None:
    """One pass: per prompt, target-only, then every candidate, then target-only again (drift over
    the sweep hits the baseline as it hits the candidates); appends each candidate's per-prompt
    speedup (mean baseline seconds per token over its own) to ratios[i] and its counts to runs[i]."""
    base = {"num_candidates": 0}
    started = time.perf_counter()
    for p, prompt in enumerate(prompts):
        if p:
            progress(f"  {title}: prompt {p + 1} of {len(prompts)} ({time.perf_counter() - started:.0f} s so far)")
        seed = 1234 + p
        before = _run_prompt(gen, prompt, base, tokens, temperature, seed)
        got = {i: _run_prompt(gen, prompt, options_list[i], tokens, temperature, seed)
               for i in runs if options_list[i].get("num_candidates", 1)}
        after = _run_prompt(gen, prompt, base, tokens, temperature, seed)
        if before is None or after is None:
            continue
        base_spt = (before["seconds"] + after["seconds"]) / (before["new"] + after["new"])
        for i in runs:
            if i not in got:                       # target-only itself: 1.00x by definition
                runs[i].append(before)
                ratios[i].append(1.0)
            elif got[i] is not None:
                runs[i].append(got[i])
                ratios[i].append(base_spt / (got[i]["seconds"] / got[i]["new"]))


def _geomean(values) -> float:
    return statistics.geometric_mean(values) if values else 0.0


def _choose(gen, tokens, prompts, progress) -> dict:
    ids = [list(p) if not isinstance(p, str) else gen.codec.encode_prompt(p, None) for p in prompts]
    fits = [p for p in ids if len(p) + tokens < gen.engine.context_length]
    if not fits:
        raise ValueError(f"no calibration prompt fits the context ({gen.engine.context_length} tokens) "
                         f"with {tokens} new tokens")
    out = {}
    for regime, temperature in (("greedy", 0.0), ("sampling", 1.0)):
        options_list = candidates(gen)[regime]                   # [0] is target-only
        runs = {i: [] for i in range(len(options_list))}
        ratios = {i: [] for i in range(len(options_list))}
        _sweep(gen, fits, options_list, tokens, temperature, runs, ratios, progress,
               f"{regime}, {len(options_list)} candidates")
        scores = {i: _geomean(ratios[i]) for i in runs}
        # the race: the candidates within RACE_MARGIN of the best are measured once more, interleaved
        # again, and decided on both passes (a one-pass near-tie is within this machine's noise)
        top = max(scores.values())
        finalists = sorted((i for i in scores if i and scores[i] >= top / (1 + RACE_MARGIN)),
                           key=lambda i: -scores[i])[:RACE_FINALISTS]
        if len(finalists) > 1:
            progress(f"  {regime}: {len(finalists)} candidates within {RACE_MARGIN:.0%} of the best after one pass "
                     f"({', '.join(describe(options_list[i]) for i in finalists)}): measuring them again")
            _sweep(gen, fits, options_list, tokens, temperature, {i: runs[i] for i in finalists},
                   {i: ratios[i] for i in finalists}, progress, f"{regime}, second pass")
            scores.update({i: _geomean(ratios[i]) for i in finalists})
        rows = []
        for i, options in enumerate(options_list):
            rs = runs[i]
            new, cost = sum(r["new"] for r in rs), sum(r["cost"] for r in rs)
            seconds, calls = sum(r["seconds"] for r in rs), sum(r["calls"] for r in rs)
            row = {"options": options, "policy": describe(options),
                   "predicted": round(new / cost, 3) if cost else 1.0,
                   "measured": round(scores[i], 3), "passes": 1 + (i in finalists and len(finalists) > 1),
                   "per_prompt": [round(x, 2) for x in ratios[i]],
                   "tokens_per_call": round(new / calls, 2) if calls else 1.0,
                   "ms_per_token": round(1000 * seconds / new, 1) if new else None}
            rows.append(row)
            spread = f"{min(ratios[i]):.2f}-{max(ratios[i]):.2f}" if ratios[i] else "-"
            progress(f"  {regime:8s} {row['policy']:34s} measured {row['measured']:.2f}x (per prompt {spread}, "
                     f"{row['passes']} pass{'es' if row['passes'] > 1 else ''}), predicted {row['predicted']:.2f}x, "
                     f"{row['tokens_per_call']:.2f} tokens/call, {row['ms_per_token']} ms/token")
        best = max(rows, key=lambda r: r["measured"])
        out[regime] = {"options": best["options"], "policy": best["policy"], "predicted": best["predicted"],
                       "measured": best["measured"], "candidates": rows}
        progress(f"{regime}: chose {best['policy']} (measured {best['measured']:.2f}x target-only decoding: the "
                 f"geometric mean of its per-prompt speedups on the calibration prompts; predicted "
                 f"{best['predicted']:.2f}x)")
        favourite = max(rows, key=lambda r: r["predicted"])
        if favourite is not best:
            progress(f"  note: the cost model preferred {favourite['policy']} (predicted {favourite['predicted']:.2f}x,"
                     f" measured {favourite['measured']:.2f}x); the measurement decides")
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


def write(bundle_path: Path, result: dict, provider: str, threads, choice: dict | None = None) -> None:
    """Store the measurements (and the chosen defaults) in the manifest, atomically."""
    manifest_path = Path(bundle_path) / "spectr.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["models"]["target"]["cost_curve"] = result["cost_curve"]
    if "decode_cost" in result and "draft" in manifest["models"]:
        manifest["models"]["draft"]["decode_cost"] = result["decode_cost"]
        manifest["models"]["draft"]["decode_rows_curve"] = result["decode_rows_curve"]
    if choice:
        manifest["defaults"] = {regime: c["options"] for regime, c in choice.items()}
    manifest["tuning"] = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "provider": provider,
                          "threads": threads or "onnxruntime default", "past_tokens": result["past"],
                          "machine": f"{platform.machine()}, {os.cpu_count()} cpus, {platform.platform()}",
                          "target_ms": {str(n): round(v, 3) for n, v in result["target_ms"].items()},
                          **({"draft_ms": round(result["draft_ms"], 3)} if "draft_ms" in result else {}),
                          **({"choice": {regime: {"policy": c["policy"], "predicted_speedup": c["predicted"],
                                                  "measured_speedup": c["measured"],
                                                  "candidates": [{k: r[k] for k in ("policy", "predicted", "measured",
                                                                                    "tokens_per_call", "ms_per_token")}
                                                                 for r in c["candidates"]]}
                                         for regime, c in choice.items()},
                              "calibration": f"{CALIBRATION_TOKENS} tokens x spectr_edge/calibration.py prompts"}
                             if choice else {})}
    write_manifest(bundle_path, manifest)
