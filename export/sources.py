"""Where a model comes from, resolved to a local directory.

    resolve(spec, workdir, role, log) -> Source

spec may be:
  * a directory holding an optimum ONNX export (model.onnx + config.json + tokenizer files):
    kind "onnx", used as is; nothing here imports torch for it;
  * a local Hugging Face model directory (config.json + weights + tokenizer): kind "hf";
  * a GGUF file (recognised by its magic bytes, not its name): dequantized to float32 with
    transformers and saved as an HF directory under workdir: kind "hf";
  * a Hugging Face hub id: downloaded with huggingface_hub: kind "hf".
"""

from __future__ import annotations

import gc
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from spectr_edge.errors import ExportError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_ALTERNATIVES = "pass a local model directory, a .gguf file, an optimum ONNX export directory or a preset (qwen2.5-coder, smollm2)"


@dataclass
class Source:
    kind: str  # "hf" (PyTorch weights, exported here) or "onnx" (already exported)
    dir: Path  # model directory: config.json, tokenizer files, weights or model.onnx
    description: str  # free text for the manifest


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF (any llama.cpp quant) to a float32 HF directory with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the legacy-tokenizer notice is expected for GGUF
    hf_logging.disable_progress_bar()
    kw = dict(gguf_file=gguf.name)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
    except Exception as e:   # a corrupt header fails anywhere in gguf's reader (IndexError, struct.error...)
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ExportError(f"transformers cannot load {gguf} ({first}); use a GGUF of a supported architecture "
                          "(llama, qwen2, ...) or a Hugging Face model directory") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    del model
    gc.collect()
    return out_dir


def download_hub(repo_id: str) -> Path:
    """snapshot_download of a hub model (config, tokenizer, safetensors); one-line error when unreachable."""
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"],
                                 etag_timeout=10)
    except Exception as e:  # offline, auth, 404 ...: all end the export the same way
        kind = "no such model" if "NotFound" in type(e).__name__ and "Local" not in type(e).__name__ else "unreachable"
        raise ExportError(f"cannot fetch '{repo_id}' from the Hugging Face hub ({kind}: {type(e).__name__}); "
                          f"{_ALTERNATIVES}") from None
    return Path(path)


def resolve(spec: str | Path, workdir: Path, role: str, log: Callable[[str], None]) -> Source:
    """A local directory for spec (see module doc); GGUF conversions go to workdir/<role>-hf."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "model.onnx").exists() and (path / "config.json").exists():
            return Source("onnx", path.resolve(), f"ONNX export {path.resolve()}")
        if (path / "config.json").exists():
            return Source("hf", path.resolve(), f"Hugging Face model {path.resolve()}")
        raise ExportError(f"{path} has no config.json; {_ALTERNATIVES}")
    if path.is_file():
        if not is_gguf(path):
            raise ExportError(f"{path} is not a GGUF file (no GGUF magic bytes); {_ALTERNATIVES}")
        log(f"      converting {path.name} to float32 PyTorch weights")
        hf = convert_gguf(path.resolve(), workdir / f"{role}-hf")
        return Source("hf", hf, f"{path.name} (GGUF, {path.stat().st_size} bytes)")
    if isinstance(spec, str) and _HUB_ID.match(spec) and not spec.startswith((".", "~")):
        log(f"      downloading {spec} from the Hugging Face hub")
        return Source("hf", download_hub(spec), f"{spec} (Hugging Face hub)")
    raise ExportError(f"no such file or directory: {spec}; {_ALTERNATIVES}")
