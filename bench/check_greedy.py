"""Greedy equality on a real bundle, outside CI: every greedy speculative configuration must
produce exactly the target-only token ids, with tokens drafted and accepted.

Reads the raw.json of a bench/run.py run (which records every generation's token ids), or
runs its own small check when given --bundle:

    .venv/bin/python bench/check_greedy.py bench/results/DATE-NAME/raw.json
    .venv/bin/python bench/check_greedy.py --bundle models/default --prompts 3 -n 64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def check_rows(rows: list[dict]) -> tuple[int, int, list[str]]:
    """Compare greedy speculative rows with the target-only row of the same prompt.

    Returns (rows compared, rows that accepted draft tokens, descriptions of differences).
    Rows of run.py (config, accepted; spectr-edge rows only)."""
    rows = [_normal(r) for r in rows if r.get("tool", "spectr-edge") == "spectr-edge" and "error" not in r
            and not (isinstance(r.get("config"), dict) and r["config"].get("unpadded"))]   # other numerics: a
    # reference for speed (bench/run.py's "1-token calls" rows), not the target-only to compare with
    # a bundle tag ("... [int4 target]") means another bundle: compare with that bundle's target-only;
    # "[int4 target, no guess head]" is a variant of the "int4 target" bundle: compare with that one's
    # when it has none of its own; any other tag without a target-only of its own is another draft for
    # the same target: compare with the untagged target-only
    plain = {(r["prompt_id"], _tag(r)): r["token_ids"] for r in rows if r["temperature"] == 0 and r["k"] == 0}
    spec = [r for r in rows if r["temperature"] == 0 and r["k"] != 0]
    failures = []
    for r in spec:
        tag = _tag(r)
        bundle = "[" + tag[1:].split("]")[0].split(", ")[0] + "]" if tag else ""   # "[int4 target, x]" -> "[int4 target]"
        key = next((k for k in ((r["prompt_id"], tag), (r["prompt_id"], bundle), (r["prompt_id"], ""))
                    if k in plain), None)
        if key is None:
            failures.append(f"prompt {r['prompt_id']} {r['config']}: no target-only row to compare with")
            continue
        want = plain[key]
        if r["token_ids"] != want:
            at = next((i for i, (a, b) in enumerate(zip(r["token_ids"], want)) if a != b),
                      min(len(want), len(r["token_ids"])))
            failures.append(f"prompt {r['prompt_id']} {r['config']}: first difference at token {at}")
    return len(spec), sum(r["acceptance"] > 0 for r in spec), failures


def _tag(r: dict) -> str:
    """Everything in brackets after the method's name: "[int4 target] [other checkout]"."""
    name = r.get("method") or ""
    return name[name.index(" [") + 1:] if " [" in name else ""


def _normal(r: dict) -> dict:
    if "config" in r and isinstance(r["config"], dict):     # run.py row; k absent = the shipped default
        k = r["config"].get("k", -1)
        return {**r, "k": k, "acceptance": r.get("accepted") or 0, "config": r["method"], "method": r["method"]}
    return r


def from_run(path: Path) -> int:
    compared, accepting, failures = check_rows(json.loads(path.read_text())["rows"])
    print(f"{compared} greedy speculative generations compared token for token with target-only; "
          f"{accepting} of them accepted draft tokens; {len(failures)} differ")
    for f in failures:
        print("  " + f)
    return 1 if failures or compared == 0 or accepting == 0 else 0


def own_run(bundle: str, prompts: int, max_new_tokens: int) -> int:
    import harness
    import spectr_edge

    gen = spectr_edge.load(bundle, provider="cpu")
    bad = accepted = 0
    for p in harness.select_prompts(harness.load_questions(), f"first-{prompts}"):
        plain = gen.generate(p["prompt"], max_new_tokens=max_new_tokens, temperature=0, num_candidates=0)
        for L in (2, 4, 6):
            spec = gen.generate(p["prompt"], max_new_tokens=max_new_tokens, temperature=0, num_candidates=1, draft_len=L)
            same = spec.token_ids == plain.token_ids
            bad += not same
            accepted += spec.stats.accepted
            print(f"prompt {p['id']} L={L}: {'equal' if same else 'DIFFERENT'}, accepted "
                  f"{spec.stats.accepted}/{spec.stats.drafted}")
    return 1 if bad or accepted == 0 else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", nargs="?", help="raw.json of a bench/run.py run")
    ap.add_argument("--bundle")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    sys.exit(from_run(Path(args.raw)) if args.raw else own_run(args.bundle, args.prompts, args.max_new_tokens))


if __name__ == "__main__":
    main()
