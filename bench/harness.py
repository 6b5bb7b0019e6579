"""Shared pieces of the benchmarks: Spec-Bench prompts, machine description, statistics.

Spec-Bench (bench/data/spec_bench_questions.jsonl) has 480 questions: MT-bench's 8
categories x 10 (ids 81-160) and 80 each of translation, summarization, qa, math_reasoning
and rag. Spec-Bench reports six tasks: the 8 MT-bench categories together as "mt_bench",
then the five others; `task()` maps a category to its task.
"""

from __future__ import annotations

import json
import os
import shutil
import platform
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS_FILE = ROOT / "bench" / "data" / "spec_bench_questions.jsonl"
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


def task(category: str) -> str:
    return "mt_bench" if category in MT_BENCH else category


def load_questions(path: Path = PROMPTS_FILE, more=()) -> list[dict]:
    """Spec-Bench's questions (or PATH's, in its format), then those of each file in MORE (e.g. written
    by bench/write_questions.py); every question_id once."""
    questions = []
    for p in [Path(path), *map(Path, more)]:
        if not p.is_file():
            raise SystemExit(f"error: no prompts file at {p}; name an existing JSONL file in Spec-Bench's format")
        rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        questions += [{"id": r["question_id"], "category": r["category"], "task": task(r["category"]),
                       "prompt": r["turns"][0]} for r in rows]
    ids = [q["id"] for q in questions]
    if len(set(ids)) != len(ids):
        raise SystemExit(f"error: the prompts files {[str(path), *map(str, more)]} share question ids; "
                         "give the extra questions other ids (write_questions.py --first-id)")
    return questions


def repo_path(path) -> str:
    """PATH relative to the checkout when it lies inside it (a run's raw.json then works in any clone)."""
    full = Path(path).resolve()
    return str(full.relative_to(ROOT)) if full.is_relative_to(ROOT) else str(full)


# a subset's "LANG:" prefix asks for every answer in another language, the traffic of a deployment
# whose users speak it (the shifted domain bench/draft_adaptation.py adapts the draft to)
ANSWER_IN = {"de": "Bitte antworte auf Deutsch.", "fr": "Réponds en français, s'il te plaît.",
             "es": "Responde en español, por favor.", "zh": "请用中文回答。"}


def select_prompts(questions: list[dict], subset: str) -> list[dict]:
    """`first-N`: the first N questions; `stratified-N`: N per Spec-Bench task, evenly spaced
    inside the task (for mt_bench, spread over its 8 categories); `ids-A,B,...`: those ids.
    `de:SUBSET` asks for the answers in German (a key of ANSWER_IN: the request ends the prompt, and
    the prompt's "language" says so); `A+B` joins subsets (`de:ids-381,391+ids-91`), each id once."""
    if "+" in subset:
        chosen = [q for part in subset.split("+") for q in select_prompts(questions, part)]
        ids = [q["id"] for q in chosen]
        if len(set(ids)) != len(ids):
            raise SystemExit(f"error: prompt subset {subset!r} names a question twice; each id may appear once")
        return chosen
    language, colon, rest = subset.partition(":")
    if colon:
        if language not in ANSWER_IN:
            raise SystemExit(f"error: unknown answer language {language!r} in {subset!r}; use one of "
                             f"{', '.join(ANSWER_IN)}")
        return [{**q, "prompt": f"{q['prompt']}\n\n{ANSWER_IN[language]}", "language": language}
                for q in select_prompts(questions, rest)]
    kind, _, arg = subset.partition("-")
    if kind == "first":
        return questions[:int(arg)]
    if kind == "ids":
        wanted = [int(x) for x in arg.split(",")]
        by_id = {q["id"]: q for q in questions}
        return [by_id[i] for i in wanted]
    if kind == "stratified":
        per_task = int(arg)
        chosen = []
        for t in TASKS:
            pool = [q for q in questions if q["task"] == t]
            if t == "mt_bench":   # round-robin over categories: writing#1, roleplay#1, ..., writing#2, ...
                by_cat = [[q for q in pool if q["category"] == c] for c in MT_BENCH]
                pool = [by_cat[c][i] for i in range(10) for c in range(len(MT_BENCH))]
                chosen += pool[:per_task]
            else:
                step = len(pool) / per_task
                chosen += [pool[int(i * step)] for i in range(per_task)]
        return chosen
    raise SystemExit(f"error: unknown prompt subset {subset!r}; use first-N, stratified-N or ids-A,B")


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        model = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
        info["cpu"] = model[0] if model else platform.processor()
        flags = [ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("flags")]
        wanted = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
                  "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
        info["cpu_flags"] = [f for f in wanted if flags and f in flags[0]]
        mem = [ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal")]
        info["memory_gib"] = round(int(mem[0].split()[1]) / 2**20, 1) if mem else None
    except OSError:
        info["cpu"] = platform.processor()
    import cpu_mask
    masked = cpu_mask.running_masked()
    if masked:                                                 # bench/cpu_mask.py runs this process
        info["hidden_cpu_features"] = f"{masked} (bench/cpu_mask.py)"
    try:
        info["git_commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                            capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["git_commit"] = None
    return info


def median(xs) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def p90(xs) -> float:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return float("nan")
    # nearest-rank on the sorted sample (with few prompts this is the largest or second largest)
    return xs[min(len(xs) - 1, int(0.9 * len(xs) + 0.5) - 1)] if len(xs) > 1 else xs[0]


LINK_ABOVE = 64 * 2**20   # files larger than this are linked, not copied


def new_twin(src: str, dst: str, skip=frozenset()) -> tuple[Path, Path]:
    """(SRC, DST) of a bundle twin: DST, which must not exist yet, gets SRC's files (link_or_copy)."""
    src_dir, dst_dir = Path(src).resolve(), Path(dst)
    if dst_dir.exists():
        raise SystemExit(f"error: {dst_dir} exists; remove it first")
    link_or_copy(src_dir, dst_dir, skip)
    return src_dir, dst_dir


def link_or_copy(src_dir: Path, dst_dir: Path, skip=frozenset()) -> None:
    """Recreate src_dir's files under dst_dir: large ones hard-linked (ONNX Runtime refuses external
    data outside the model's folder, symlinks included), small ones copied; `skip`: resolved paths."""
    for f in sorted(src_dir.rglob("*")):
        if f.is_dir() or f.resolve() in skip:
            continue
        target = dst_dir / f.relative_to(src_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        (os.link if f.stat().st_size > LINK_ABOVE else shutil.copy2)(f, target)
