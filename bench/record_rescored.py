"""Recording a domain's traffic faster: a quick bundle (the int4 twin) writes the text, the bundle being
adapted scores it. Each prompt is answered by FAST with `record=` (its own records go to a temporary
directory beside OUT, removed once scored; an interrupted run leaves it, named OUT.fast-*), then
every recorded generation is scored again by BUNDLE's target in one teacher-forced call, and the record
BUNDLE's `--record` would have written for that text is appended to OUT/traffic.jsonl. The text is
FAST's (its greedy tokens agree with the float32 target's at about 88% of positions), the teacher
distributions are BUNDLE's target's, exactly. `spectr-edge adapt --bundle B --from OUT` then reads it.

    .venv/bin/python bench/record_rescored.py --fast models/default-int4 --bundle models/default \
        --train SUBSET --out DIR [--prompts-file FILE --temperature T --seed S]

Prints per generation its tokens and time, and at the end both stages' times.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402


def rescore(bundle: Path, source: Path, out: Path, top_k: int) -> tuple[int, int]:
    """Append to OUT the records of SOURCE's generations as BUNDLE's target scores them; returns
    (generations, tokens) written."""
    from spectr_edge import recording
    from spectr_edge.bundle import read_bundle
    from spectr_edge.onnx_model import OnnxLM

    b = read_bundle(bundle)
    lm = OnnxLM(b.target, provider="cpu")
    rec = recording.Recorder(out, b.tokenizer.vocab_size, b.tokenizer.vocab_sha256, top_k=top_k)
    n = tokens = 0
    for r in recording.read(source):
        if r.vocab_sha256 not in (None, b.tokenizer.vocab_sha256):
            raise SystemExit(f"error: {source} was recorded with another vocabulary than {bundle}'s")
        ids = np.asarray([r.prompt + r.tokens[:-1]], dtype=np.int64)             # [1, prompt + n - 1]
        logits = lm.forward(ids, lm.new_cache(), last=len(r.tokens))[0, -len(r.tokens):]   # [n, W]
        one = rec.request(r.prompt)
        one.add(logits, r.tokens)
        one.close()
        n, tokens = n + 1, tokens + len(r.tokens)
    return n, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fast", required=True, help="the bundle that writes the text (e.g. models/default-int4)")
    ap.add_argument("--bundle", default=str(harness.ROOT / "models" / "default"),
                    help="the bundle whose target scores it (the one to adapt)")
    ap.add_argument("--train", required=True, help="the prompts (first-N, stratified-N, ids-A,B; de:SUBSET)")
    ap.add_argument("--prompts-file", type=Path, default=harness.PROMPTS_FILE,
                    help="questions in Spec-Bench's format (default: Spec-Bench; bench/write_questions.py writes more)")
    ap.add_argument("--out", required=True, type=Path, help="recording directory to append to")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top-k", type=int, default=16, help="log-probabilities kept per position")
    args = ap.parse_args()

    import spectr_edge

    prompts = harness.select_prompts(harness.load_questions(args.prompts_file), args.train)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # FAST's own records, scored again below: a new directory per run, so that runs append parts to one OUT
    fast_dir = Path(tempfile.mkdtemp(prefix=args.out.name + ".fast-", dir=args.out.parent))
    gen = spectr_edge.load(args.fast, provider="cpu", record=fast_dir)
    started = time.perf_counter()
    for i, q in enumerate(prompts):
        res = gen.generate(q["prompt"], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           seed=args.seed + q["id"])
        print(f"written {i + 1}/{len(prompts)}: prompt {q['id']}, {res.stats.new_tokens} tokens", flush=True)
    write_s = time.perf_counter() - started
    del gen
    started = time.perf_counter()
    n, tokens = rescore(Path(args.bundle), fast_dir, args.out, args.top_k)
    score_s = time.perf_counter() - started
    shutil.rmtree(fast_dir)
    print(f"{len(prompts)} prompts: text written by {args.fast} in {write_s:.0f} s; {n} generations "
          f"({tokens} tokens) scored by {args.bundle}'s target in {score_s:.0f} s, appended to "
          f"{args.out / 'traffic.jsonl'}")


if __name__ == "__main__":
    main()
