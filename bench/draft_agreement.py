"""How often two bundles' drafts agree with the target on the text a benchmark run's target-only
decoded, teacher-forced: greedy acceptance by chain position (as `spectr-edge adapt` measures on its
held-out records), per group of prompts. A live run's acceptance also depends on where drafting steps
start; this view has every position of the target's own greedy text, the same for both drafts.

    .venv/bin/python bench/draft_agreement.py bench/results/2026-12-05-draft-adaptation-german-rounded/raw.json \
        models/default models/default-adapted --by language,task

The run must hold a greedy target-only row per prompt (its token ids); prompts are rebuilt from the
run's subset with the first bundle's tokenizer, as bench/run.py built them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", type=Path, help="raw.json of a bench/run.py run")
    ap.add_argument("bundles", nargs="+", help="bundles whose drafts to compare (same tokenizer)")
    ap.add_argument("--by", default="language", help="prompt fields to group by, comma-separated "
                                                     "(language, task, category) [default: language]")
    args = ap.parse_args()

    import harness
    from export import adapt
    from spectr_edge.bundle import read_bundle
    from spectr_edge.onnx_model import OnnxLM
    from spectr_edge.text import TextCodec

    raw = json.loads(args.raw.read_text())
    decoded = {r["prompt_id"]: r["token_ids"] for r in raw["rows"]
               if r["method"].endswith("target-only") and r.get("temperature", 0) == 0 and r.get("token_ids")}
    bundles = [read_bundle(b) for b in args.bundles]
    codec, vocab = TextCodec(bundles[0].tokenizer), bundles[0].tokenizer.vocab_size
    groups: dict[tuple, list] = {}
    more = [harness.ROOT / f for f in raw["meta"].get("more_prompts", ())]     # run.py --more-prompts
    for p in harness.select_prompts(harness.load_questions(more=more), raw["meta"]["subset"]):
        if p["id"] not in decoded:
            continue
        ids, tokens = list(codec.encode_prompt(p["prompt"])), [int(t) for t in decoded[p["id"]]]
        ones = np.ones((len(tokens), 1), np.float32)
        seq = adapt.Sequence(ids + tokens, len(ids), np.asarray(tokens, np.int64)[:, None], ones, ones)
        groups.setdefault(tuple(p.get(f) or "-" for f in args.by.split(",")), []).append(seq)
    if not groups:
        sys.exit(f"error: {args.raw} has no greedy target-only rows with token ids")
    drafts = [(b, OnnxLM(b.draft, provider="cpu")) for b in bundles]
    print(f"{args.raw}: greedy acceptance by chain position, teacher-forced on target-only's text")
    print(f"| {' / '.join(args.by.split(','))} | prompts | positions | draft | positions 1-6 | tokens per 6-token chain |")
    print("|---|---|---|---|---|---|")
    for key in sorted(groups):
        for b, lm in drafts:
            a = adapt.acceptance(lm, groups[key], vocab)
            print(f"| {' / '.join(key)} | {len(groups[key])} | {a['positions']} | {b.path.name} | "
                  f"{' '.join(f'{x:.3f}' for x in a['greedy_per_position'])} | {a['greedy_tokens_per_chain']:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
