"""Accuracy of quantized targets against a reference target, teacher-forced on real text.

    .venv/bin/python bench/quant_quality.py models/default models/default-int4 models/default-int4-b32

The first bundle is the reference (the float32 target). Every bundle's target scores the same
four 400-token chunks of text in one call each (this README, and three standard-library modules:
json, textwrap, string). Printed per bundle: greedy top-1 agreement with the reference's next-token
choice, perplexity of the text, and the mean KL divergence KL(reference || this). Loads one target
at a time (~7 GB for the float32 1.5B); minutes.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import string
import sys
import textwrap
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from spectr_edge.bundle import read_bundle  # noqa: E402
from spectr_edge.onnx_model import OnnxLM  # noqa: E402


def texts() -> list[str]:
    return [(ROOT / "README.md").read_text()[:3000], inspect.getsource(json)[:3000],
            inspect.getsource(textwrap)[2000:5000], inspect.getsource(string)[:3000]]


def log_probs(bundle: str, chunks: list[np.ndarray], width: int) -> list[np.ndarray]:
    """Per chunk: log-softmax over the tokenizer's ids, # [len(chunk), width]."""
    model = OnnxLM(read_bundle(bundle).target, provider="cpu")
    out = []
    for ids in chunks:
        logits = model.forward(ids[None], model.new_cache())[0, :, :width].astype(np.float64)
        logits -= logits.max(-1, keepdims=True)
        out.append(logits - np.log(np.exp(logits).sum(-1, keepdims=True)))
    del model
    gc.collect()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundles", nargs="+", help="reference bundle first")
    ap.add_argument("--tokens", type=int, default=400, help="tokens per chunk")
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer

    ref_bundle = read_bundle(args.bundles[0])
    tok = Tokenizer.from_file(str(ref_bundle.tokenizer.file))
    width = ref_bundle.tokenizer.vocab_size
    chunks = [np.array(tok.encode(t).ids[:args.tokens], dtype=np.int64) for t in texts()]
    ref = log_probs(args.bundles[0], chunks, width)
    print(f"{sum(len(c) for c in chunks)} tokens in {len(chunks)} chunks; reference {args.bundles[0]}")
    for bundle in args.bundles:
        lp = ref if bundle == args.bundles[0] else log_probs(bundle, chunks, width)
        agree = np.concatenate([a[:-1].argmax(-1) == r[:-1].argmax(-1) for a, r in zip(lp, ref)]).mean()
        nll = np.concatenate([-a[np.arange(len(c) - 1), c[1:]] for a, c in zip(lp, chunks)]).mean()
        kl = np.concatenate([(np.exp(r) * (r - a)).sum(-1) for a, r in zip(lp, ref)]).mean()
        print(f"{bundle}: top-1 agreement {agree:.4f}, perplexity {np.exp(nll):.3f}, KL(reference || this) {kl:.4f}",
              flush=True)


if __name__ == "__main__":
    main()
