"""Do two runs (or two code checkouts in one run) decode identically? Token for token and target call
for target call, per method and prompt.

    .venv/bin/python bench/same_outputs.py A/raw.json B/raw.json      # the same methods in two runs
    .venv/bin/python bench/same_outputs.py RUN/raw.json                # a run made with --checkout: each
                                                                       # method against its [other checkout] twin

Greedy generations and sampled ones with the run's fixed seeds must match exactly (the engine is
deterministic given the seed); the script prints one line per method and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

TAG = " [other checkout]"


def rows_by_method(raw: dict) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = defaultdict(dict)
    for row in raw["rows"]:
        if "error" not in row and row.get("tool") == "spectr-edge":
            out[row["method"]][row["prompt_id"]] = row
    return out


def pairs(a: dict, b: dict | None) -> list[tuple[str, dict, dict]]:
    """(method, its rows in A, the same method's rows in B); with one run, B is its checkout twins."""
    if b is not None:
        return [(m, a[m], b[m]) for m in a if m in b]
    return [(m, a[m], a[m + TAG]) for m in a if not m.endswith(TAG) and m + TAG in a]


def compare(left: dict[int, dict], right: dict[int, dict]) -> tuple[int, list[str]]:
    """(prompts compared, differences)."""
    problems = []
    shared = sorted(set(left) & set(right))
    for pid in shared:
        x, y = left[pid], right[pid]
        if x["token_ids"] != y["token_ids"]:
            at = next((i for i, (s, t) in enumerate(zip(x["token_ids"], y["token_ids"])) if s != t),
                      min(len(x["token_ids"]), len(y["token_ids"])))
            problems.append(f"prompt {pid}: tokens differ from position {at}")
        elif x.get("target_calls") != y.get("target_calls"):
            problems.append(f"prompt {pid}: {x.get('target_calls')} vs {y.get('target_calls')} target calls")
    return len(shared), problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", nargs="+", type=Path, help="one raw.json made with --checkout, or two raw.json files")
    args = ap.parse_args(argv)
    if len(args.raw) > 2:
        ap.error("give one or two raw.json files")
    runs = [rows_by_method(json.loads(p.read_text())) for p in args.raw]
    matched = pairs(runs[0], runs[1] if len(runs) == 2 else None)
    if not matched:
        print("no method appears in both", file=sys.stderr)
        return 1
    failed = 0
    for method, left, right in matched:
        n, problems = compare(left, right)
        calls = sum(r.get("target_calls") or 0 for r in left.values())
        print(f"{'same' if not problems and n else 'DIFFERENT'}: {method}: {n} prompts, {calls} target calls"
              + ("".join(f"\n    {p}" for p in problems)))
        failed += bool(problems) or not n
    print(f"{len(matched) - failed} of {len(matched)} methods decode identically")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
