"""Tables and plots of one benchmark run, from its raw.json (bench/run.py calls this).

    .venv/bin/python bench/report.py bench/results/<dir>

Speedup = median over prompts of (target-only ms/token / method ms/token) on the same
prompt, where target-only is spectr-edge's target-only method at the same temperature in
the same run. ms/token is the inter-token latency after the first token; its p90 is over
prompts. Acceptance = accepted / drafted draft tokens summed over prompts; acceptance at
draft position j = steps that accepted position j / steps that verified it.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ANSWER_IN, TASKS, median, p90  # noqa: E402


def _ok(rows):
    return [r for r in rows if "error" not in r]


def _baselines(rows, methods):
    base_name = {m["temperature"]: m["name"] for m in methods if m.get("baseline") and m["tool"] == "spectr-edge"}
    by = {(r["method"], r["prompt_id"], r.get("group")): r for r in _ok(rows)}
    return base_name, by


def unique_methods(methods) -> list[dict]:
    """Methods by name, first occurrence: a grouped run repeats its anchors in every group."""
    seen: dict[str, dict] = {}
    for m in methods:
        seen.setdefault(m["name"], m)
    return list(seen.values())


def speedups(rows, methods, method, prompts_of=None, against: str | None = None) -> list[float]:
    """Per-prompt ratios of a baseline's ms/token to the method's, pairing rows of the same prompt
    and group. The baseline is spectr-edge's target-only at the method's temperature, or `against`."""
    base_name, by = _baselines(rows, methods)
    t = next(m["temperature"] for m in methods if m["name"] == method)
    anchor = base_name.get(t)
    base = against or anchor
    groups_of = defaultdict(list)                       # (method, prompt) -> the groups it ran in
    for (m, pid, g) in by:
        groups_of[(m, pid)].append(g)
    ms = lambda m, pid, g: (by.get((m, pid, g)) or {}).get("ms_per_token")  # noqa: E731
    out = []
    for r in _ok(rows):
        if r["method"] != method or (prompts_of and r["prompt_id"] not in prompts_of):
            continue
        pid, g, mine = r["prompt_id"], r.get("group"), r.get("ms_per_token")
        if not mine:
            continue
        if ms(base, pid, g):
            out.append(ms(base, pid, g) / mine)
        elif against and groups_of.get((against, pid)):
            # the tool's own baseline ran in another group: compare each with its own group's anchor
            there = groups_of[(against, pid)][0]
            if ms(anchor, pid, g) and ms(anchor, pid, there):
                out.append((ms(anchor, pid, g) / mine) / (ms(anchor, pid, there) / ms(against, pid, there)))
    return out


def specbench_overall(rows, methods, method, against: str | None = None) -> float | None:
    """Spec-Bench's overall speedup (its evaluation/speed.py): the mean over prompts of the method's
    tokens/s (new tokens / wall time, prefill included) over the same mean for the baseline, on the
    prompts both ran (same group). Reported beside the median of per-prompt ratios, the headline here."""
    base_name, by = _baselines(rows, methods)
    t = next(m["temperature"] for m in methods if m["name"] == method)
    base = against or base_name.get(t)
    pairs = []
    for r in _ok(rows):
        other = by.get((base, r["prompt_id"], r.get("group"))) or {}
        if r["method"] == method and r.get("tokens_per_s") and other.get("tokens_per_s"):
            pairs.append((other["tokens_per_s"], r["tokens_per_s"]))
    if not pairs or base == method:
        return None
    return sum(m for _, m in pairs) / sum(b for b, _ in pairs)


def acceptance_by_position(mine) -> list[float]:
    reached, accepted = defaultdict(int), defaultdict(int)
    for r in mine:
        for j, (n, a) in enumerate(zip(r.get("reached") or [], r.get("accepted_at") or [])):
            reached[j] += n
            accepted[j] += a
    return [accepted[j] / reached[j] for j in sorted(reached) if reached[j]]


def summary(raw: dict) -> list[dict]:
    rows, methods = raw["rows"], raw["meta"]["methods"]
    table = []
    for m in unique_methods(methods):
        mine = [r for r in rows if r["method"] == m["name"]]
        ok = _ok(mine)
        drafted = sum(r.get("drafted") or 0 for r in ok)
        table.append({
            "method": m["name"], "tool": m["tool"], "temperature": m["temperature"], "config": m["config"],
            "prompts": len(ok), "errors": sorted({r["error"] for r in mine if "error" in r}),
            "ttft_ms": 1000 * median(r["ttft_s"] for r in ok),
            "ms_per_token": median(r["ms_per_token"] for r in ok), "ms_per_token_p90": p90(r["ms_per_token"] for r in ok),
            "tokens_per_s": median(r["tokens_per_s"] for r in ok),
            "speedup": median(speedups(rows, methods, m["name"])),
            "vs_own": median(speedups(rows, methods, m["name"], against=m["own_baseline"]))
                      if m.get("own_baseline") else None,
            "specbench_overall": specbench_overall(rows, methods, m["name"], m.get("own_baseline")),
            "tokens_per_call": median(r.get("tokens_per_call") for r in ok),
            "acceptance": sum(r.get("accepted") or 0 for r in ok) / drafted if drafted else None,
            "acceptance_by_position": acceptance_by_position(ok),
            "peak_rss_gib": max((r["peak_rss"] for r in mine), default=0) / 2**30,
            "outside_ort": median(r.get("outside_ort") for r in ok),
        })
    return table


def per_task(raw: dict, own: bool = False) -> dict[str, dict[str, float]]:
    """Median speedup per Spec-Bench task; with own=True against each method's own target-only
    (methods that have one)."""
    rows, methods = raw["rows"], raw["meta"]["methods"]
    tasks = [t for t in TASKS if any(p["task"] == t for p in raw["meta"]["prompts"])]
    out = {}
    for m in unique_methods(methods):
        if own and not m.get("own_baseline"):
            continue
        out[m["name"]] = {}
        for t in tasks:
            ids = {p["id"] for p in raw["meta"]["prompts"] if p["task"] == t}
            out[m["name"]][t] = median(speedups(rows, methods, m["name"], ids,
                                                against=m["own_baseline"] if own else None))
    return out


def _f(x, fmt):
    return "-" if x is None or x != x else format(x, fmt)


def _x(ratio) -> str:
    return "-" if ratio is None or ratio != ratio else f"{ratio:.2f}x"


def _languages(prompts: list[dict]) -> str:
    """Which prompts asked for their answer in another language (the `de:` subsets), if any."""
    asked = defaultdict(list)
    for p in prompts:
        if p.get("language"):
            asked[p["language"]].append(str(p["id"]))
    return "".join(f" Prompts {', '.join(ids)} end with \"{ANSWER_IN[lang]}\" (answers in {lang})."
                   for lang, ids in asked.items())


def by_language(raw: dict) -> list[str]:
    """Markdown lines: each method on the prompts of each answer language, when the run asked for more
    than one (a `de:` subset beside plain prompts); nothing otherwise. Speedups pair prompts as above."""
    langs = defaultdict(set)
    for p in raw["meta"]["prompts"]:
        langs[p.get("language") or "as asked"].add(p["id"])
    if len(langs) < 2:
        return []
    lines = ["", "Per answer language (speedup: median of per-prompt ratios; first position and acceptance: pooled "
             "over steps):", "", "| method | answers | prompts | ms/token median | speedup vs target-only | "
             "tokens per target call | first-position acceptance | acceptance |", "|---|---|---|---|---|---|---|---|"]
    for lang, ids in langs.items():
        part = {"meta": raw["meta"], "rows": [r for r in raw["rows"] if r["prompt_id"] in ids]}
        for t in summary(part):
            first = t["acceptance_by_position"][0] if t["acceptance_by_position"] else None
            lines.append(f"| {t['method']} | {lang} | {t['prompts']} | {_f(t['ms_per_token'], '.1f')} | "
                         f"{_x(t['speedup'])} | {_f(t['tokens_per_call'], '.2f')} | {_f(first, '.3f')} | "
                         f"{_f(t['acceptance'], '.3f')} |")
    return lines


def markdown(raw: dict) -> str:
    meta, table = raw["meta"], summary(raw)
    own = any(m.get("own_baseline") for m in meta["methods"])
    lines = [f"Command: `{meta['command']}`", "",
             f"Prompts: {meta['subset']} of Spec-Bench ({len(meta['prompts'])}: ids "
             f"{', '.join(str(p['id']) for p in meta['prompts'])}), {meta['max_new_tokens']} new tokens, "
             f"{meta['date']}, git {meta['machine'].get('git_commit')}."
             + _languages(meta["prompts"])
             + (f" Hidden from every worker's libraries: {meta['machine']['hidden_cpu_features']}."
                if meta["machine"].get("hidden_cpu_features") else ""), "",
             "| method | prompts | TTFT ms | ms/token median | ms/token p90 | tokens/s | speedup vs target-only | "
             "tokens per target call | acceptance | peak RSS GiB | time outside ORT |" + (" vs its own target-only |" if own else "")
             + " Spec-Bench overall |",
             "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if own else "") + "---|"]
    for t in table:
        err = f" (failed: {'; '.join(t['errors'])})" if t["errors"] else ""
        lines.append(f"| {t['method']}{err} | {t['prompts']} | {_f(t['ttft_ms'], '.0f')} | "
                     f"{_f(t['ms_per_token'], '.1f')} | {_f(t['ms_per_token_p90'], '.1f')} | "
                     f"{_f(t['tokens_per_s'], '.2f')} | {_f(t['speedup'], '.2f')}x | "
                     f"{_f(t['tokens_per_call'], '.2f')} | {_f(t['acceptance'], '.2f')} | "
                     f"{t['peak_rss_gib']:.2f} | "
                     f"{'-' if t['outside_ort'] is None else _f(100 * t['outside_ort'], '.1f') + '%'} |"
                     + (f" {_x(t['vs_own'])} |" if own else "") + f" {_x(t['specbench_overall'])} |")
    lines += ["", "Spec-Bench overall: the mean over prompts of tokens/s (prefill included) over the same mean for the "
              "method's own target-only (its evaluation/speed.py), beside the median of per-prompt ratios."]
    if meta.get("groups") and len(meta["groups"]) > 1:
        lines += ["", f"Run in groups, one after the other: {', '.join(meta['groups'])}. spectr-edge's target-only "
                  "methods run in every group as its anchor (hence their larger prompt count); every speedup pairs a "
                  "row with the anchor of the same prompt and group. 'vs its own target-only' pairs a peer's "
                  "speculative row with that tool's own target-only row."]
    tasks = per_task(raw)
    names = list(next(iter(tasks.values())).keys()) if tasks else []
    # methods without a ratio anywhere (a run with no float32 target-only has no anchor): left out
    tasks = {m: by for m, by in tasks.items() if any(v is not None and v == v for v in by.values())}
    if len(names) > 1 and tasks:
        lines += ["", "Speedup vs target-only per Spec-Bench task (median over the task's prompts):", "",
                  "| method | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for m, by in tasks.items():
            lines.append(f"| {m} | " + " | ".join(_f(by[t], '.2f') for t in names) + " |")
    own_tasks = per_task(raw, own=True)
    if own_tasks and len(names) > 1:
        lines += ["", "Speedup vs the method's own target-only per task (never-slower check; peers: the tool's "
                  "own target-only; spectr-edge on another bundle: that bundle's target-only):", "",
                  "| method | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for m, by in own_tasks.items():
            lines.append(f"| {m} | " + " | ".join(_f(by[t], '.2f') for t in names) + " |")
    lines += by_language(raw)
    lines += ["", "Acceptance at each draft position (steps that accepted it / steps that verified it):", ""]
    for t in table:
        if t["acceptance_by_position"]:
            lines.append(f"- {t['method']}: " + " ".join(f"{a:.2f}" for a in t["acceptance_by_position"]))
    return "\n".join(lines) + "\n"


# -- plots ------------------------------------------------------------------------------------------
_KL = re.compile(r"k=(\d+) L=(\d+)$")


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path: Path) -> None:
    fig.tight_layout(rect=(0, 0.1, 1, 1) if getattr(fig, "captioned", False) else None)
    fig.savefig(path, dpi=120)
    _plt().close(fig)


def caption(fig, raw: dict, baseline: str) -> None:
    """What every plot says at its foot: its baseline, its run (command, date, commit) and its machine."""
    fig.captioned = True
    meta, machine = raw["meta"], raw["meta"].get("machine", {})
    flags = ", ".join(machine.get("cpu_flags") or []) or "flags not recorded"
    if machine.get("hidden_cpu_features"):
        flags += "; AVX-512 hidden from the libraries: AVX2 kernels"
    fig.text(0.01, 0.005, f"baseline: {baseline}\nrun: {meta.get('command', '?')} ({meta.get('date', '?')[:10]}, git "
             f"{machine.get('git_commit', '?')}); {len(meta.get('prompts', []))} Spec-Bench prompts, "
             f"{meta.get('max_new_tokens', '?')} tokens\nmachine: {machine.get('cpu', '?')}, {machine.get('cpus', '?')} "
             f"CPUs ({flags})", fontsize=6, va="bottom", ha="left", color="dimgray")


def plot_speedup_by_task(raw: dict, path: Path, limit: int = 8) -> None:
    """Bars: each method's speedup over its own target-only (the same bundle's, or the same peer's)
    per task; target-only rows are the baselines and not drawn. With many methods, the best L per
    (temperature, k) is shown."""
    plt = _plt()
    table = {t["method"]: t for t in summary(raw)}
    main, own = per_task(raw), per_task(raw, own=True)
    tasks = {**main, **own}
    baselines = {m["name"] for m in raw["meta"]["methods"] if m.get("baseline")} | \
        {m.get("own_baseline") for m in raw["meta"]["methods"] if m.get("own_baseline")}
    candidates = [m for m in raw["meta"]["methods"] if m["name"] not in baselines and
                  (m.get("own_baseline") or "[" not in m["name"])]
    overall = lambda m: table[m["name"]]["vs_own"] if m.get("own_baseline") else table[m["name"]]["speedup"]  # noqa: E731
    if len(candidates) > limit:   # keep the best (by overall speedup) per family
        best = {}
        for m in candidates:
            fam = (m["tool"], m["temperature"], m["config"].get("k"), "default" in m["name"], m.get("bundle"))
            s = overall(m)
            if fam not in best or (s == s and s is not None and s > (overall(best[fam]) or 0)):
                best[fam] = m
        candidates = list(best.values())
    names = [m["name"] for m in candidates]
    if not names:
        return
    cols = list(next(iter(tasks.values())).keys()) + ["all"]
    fig, ax = plt.subplots(figsize=(min(14, max(7, 0.22 * len(cols) * len(names) + 2)), 5.6))
    width = 0.8 / max(1, len(names))
    for i, m in enumerate(candidates):
        per = own[m["name"]] if m.get("own_baseline") else main[m["name"]]
        vals = [per[c] for c in cols[:-1]] + [overall(m)]
        xs = [j + i * width for j in range(len(cols))]
        ax.bar(xs, [0 if v is None or v != v else v for v in vals], width, label=m["name"].replace("spectr-edge ", ""))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(cols))], cols)
    ax.set_ylabel("speedup over its own target-only (median over prompts)")
    ax.set_title("Speedup per Spec-Bench task, each method against its own target-only")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    caption(fig, raw, "each method's own target-only: the same bundle's (a bracketed tag names the bundle), "
                      "or the same peer tool's")
    save(fig, path)


def plot_kl_grid(raw: dict, path: Path) -> bool:
    """Heat map of tokens/s (and speedup) over (k, L), one panel per temperature."""
    table = [t for t in summary(raw) if t["tool"] == "spectr-edge" and _KL.search(t["method"])]
    if not table:
        return False
    plt = _plt()
    temps = sorted({t["temperature"] for t in table})
    fig, axes = plt.subplots(1, len(temps), figsize=(4.6 * len(temps), 3.6), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        mine = [t for t in table if t["temperature"] == temp]
        ks = sorted({int(_KL.search(t["method"]).group(1)) for t in mine})
        Ls = sorted({int(_KL.search(t["method"]).group(2)) for t in mine})
        grid = [[float("nan")] * len(Ls) for _ in ks]
        spd = [[float("nan")] * len(Ls) for _ in ks]
        for t in mine:
            k, L = map(int, _KL.search(t["method"]).groups())
            grid[ks.index(k)][Ls.index(L)] = t["tokens_per_s"]
            spd[ks.index(k)][Ls.index(L)] = t["speedup"]
        im = ax.imshow(grid, cmap="viridis", aspect="auto")
        for i in range(len(ks)):
            for j in range(len(Ls)):
                if grid[i][j] == grid[i][j]:
                    ax.text(j, i, f"{grid[i][j]:.2f}\n{spd[i][j]:.2f}x", ha="center", va="center",
                            color="white", fontsize=8)
        ax.set_xticks(range(len(Ls)), [f"L={L}" for L in Ls])
        ax.set_yticks(range(len(ks)), [f"k={k}" for k in ks])
        ax.set_title(f"tokens/s (speedup over target-only), T={temp:g}")
        fig.colorbar(im, ax=ax, shrink=0.8)
    caption(fig, raw, "spectr-edge target-only at the same temperature, same bundle")
    save(fig, path)
    return True


def plot_acceptance(raw: dict, path: Path, limit: int = 10) -> bool:
    table = [t for t in summary(raw) if t["acceptance_by_position"]]
    if not table:
        return False
    plt = _plt()
    table = sorted(table, key=lambda t: -(t["speedup"] if t["speedup"] == t["speedup"] else 0))[:limit]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for t in table:
        acc = t["acceptance_by_position"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=t["method"].replace("spectr-edge ", ""))
    ax.set_xlabel("draft position j")
    ax.set_ylabel("P(accept j | position j verified)")
    ax.set_ylim(0, 1)
    ax.set_title("Acceptance per draft position")
    caption(fig, raw, "none (the share of drafted tokens the target accepted)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, path)
    return True


TOOL_COLORS = {"spectr-edge": "tab:blue", "ortgenai": "tab:orange", "llama.cpp": "tab:green",
               "transformers": "tab:red"}


def plot_tools(raw: dict, path: Path) -> bool:
    """Horizontal bars of median ms/token per method, one panel per temperature, coloured by tool
    (runs with peers only); each bar is labelled with its speedup over spectr-edge target-only."""
    table = [t for t in summary(raw) if t["prompts"] and t["ms_per_token"] == t["ms_per_token"]]
    if len({t["tool"] for t in table}) < 2:
        return False
    plt = _plt()
    temps = sorted({t["temperature"] for t in table})
    rows = max(sum(t["temperature"] == temp for t in table) for temp in temps)
    fig, axes = plt.subplots(1, len(temps), figsize=(7.5 * len(temps), 0.34 * rows + 1.6), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        mine = sorted((t for t in table if t["temperature"] == temp), key=lambda t: -t["ms_per_token"])
        ys = range(len(mine))
        ax.barh(ys, [t["ms_per_token"] for t in mine], color=[TOOL_COLORS.get(t["tool"], "tab:gray") for t in mine])
        for y, t in zip(ys, mine):
            ax.text(t["ms_per_token"], y, f" {t['ms_per_token']:.0f} ms, {_x(t['speedup'])}", va="center", fontsize=7)
        ax.set_yticks(list(ys), [re.sub(r" T=\S+", "", t["method"]) for t in mine], fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("ms per token after the first (median over prompts; log scale)")
        ax.set_title(f"T={temp:g}: lower is faster; x = speedup over spectr-edge target-only")
        ax.grid(axis="x", alpha=0.3, which="both")
        ax.set_xlim(right=ax.get_xlim()[1] * 3)
    caption(fig, raw, "spectr-edge target-only on the run's main bundle (the x factors)")
    save(fig, path)
    return True


def write(out: Path) -> None:
    raw = json.loads((out / "raw.json").read_text())
    (out / "table.md").write_text(markdown(raw))
    try:
        plot_speedup_by_task(raw, out / "speedup_by_task.png")
        plot_kl_grid(raw, out / "tokens_per_s_kL.png")
        plot_acceptance(raw, out / "acceptance_by_position.png")
        plot_tools(raw, out / "ms_per_token_by_tool.png")
    except ImportError:
        print("note: matplotlib is not installed; tables written, plots skipped (pip install matplotlib)",
              file=sys.stderr)


if __name__ == "__main__":
    write(Path(sys.argv[1]))
    print((Path(sys.argv[1]) / "table.md").read_text())
