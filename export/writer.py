"""Atomic bundle directory and the spectr.json manifest (docs/BUNDLE.md, format version 1).

    staging(out, overwrite)      context manager: yields OUT.partial-<pid>; on success the bundle
                                 becomes OUT, on any exception (KeyboardInterrupt too) it is removed
    model_entry(...)             one "models" entry
    tokenizer_entry(info)        the "tokenizer" section

Order at the end of a successful export: the manifest is written as spectr.json.pending, the
partial dir is renamed to OUT, then spectr.json.pending is renamed to spectr.json. So a partial
dir never holds spectr.json, and a directory holding spectr.json is always complete.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from spectr_edge.errors import ExportError

from .onnx_export import GraphIO
from .tokenizer_fix import TokenizerInfo

MANIFEST = "spectr.json"
_PENDING = "spectr.json.pending"


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("spectr-edge")
    except Exception:
        return "0.1.0"


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@contextmanager
def staging(out: Path, overwrite: bool):
    """Yield a fresh OUT.partial-<pid> beside OUT; publish it as OUT on success, delete it on failure."""
    out = Path(out).expanduser().absolute()
    if out.exists() and not overwrite:
        raise ExportError(f"{out} already exists; pass --overwrite (overwrite=True) or choose another directory")
    if out.exists() and not replaceable(out):
        raise ExportError(f"--overwrite replaces only a spectr-edge bundle, and {out} is not one (it holds other "
                          "files and no bundle manifest); choose another --out, or move its files away yourself")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if not (tmp / _PENDING).exists():
            raise ExportError(f"internal error: {tmp} has no manifest; nothing was published")
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        if out.exists():  # overwrite: keep the old bundle until the new one is in place
            os.rename(out, old)
        try:
            os.rename(tmp, out)
        except OSError:
            if old.exists():
                os.rename(old, out)
            raise
        os.rename(out / _PENDING, out / MANIFEST)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replaceable(out: Path) -> bool:
    """Whether --overwrite may replace `out`: an empty directory, or a spectr-edge bundle (its
    spectr.json says so) that is not the current directory or one holding it."""
    if out.is_symlink() or not out.is_dir():
        return False
    if Path.cwd().resolve().is_relative_to(out.resolve()):
        return False
    if not any(out.iterdir()):
        return True
    try:
        manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == "spectr-edge-bundle"


def write_manifest(bundle: Path, manifest: dict) -> None:
    """Write the manifest as pending; staging() turns it into spectr.json after the final rename."""
    write_json(bundle / _PENDING, manifest)


def save_graph_beside(model, src: Path, dst: Path, what: str, weights: "WeightsFile | None" = None) -> None:
    """Save a rewritten graph proto to dst, atomically (a temporary file beside it, then os.replace);
    dst must sit beside src. Its weights stay in src's external data, or, when the rewrite made new
    ones, in `weights` (committed first, so the graph never points at a missing file)."""
    import onnx

    if src.parent.resolve() != dst.parent.resolve():
        raise ExportError(f"the {what} graph must sit beside its external data")
    tmp = dst.with_name(dst.name + f".partial-{os.getpid()}")
    try:
        if weights is not None:
            weights.commit()
        onnx.save(model, str(tmp))
        os.replace(tmp, dst)
    except BaseException:
        if weights is not None:
            weights.discard()
        raise
    finally:
        tmp.unlink(missing_ok=True)


def remove_unreferenced(files: list[Path], graph: Path) -> None:
    """Remove those of a replaced graph's files (the graph, its external data) that `graph` does not use."""
    from .onnx_export import model_files

    keep = {f.resolve() for f in model_files(graph)} if graph.exists() else set()
    for f in files:
        if f.resolve() not in keep:
            f.unlink(missing_ok=True)


class WeightsFile:
    """The external data of a rewritten graph that holds new weights: <graph>.data beside the graph.

    Tensors are appended as they are made (put), at 4 KiB-aligned offsets, and each then points at
    its bytes; take_rest copies the graph's remaining external tensors from the old file, one at a
    time, so the new file holds exactly the weights the graph reads and the old one can go. Written
    under a temporary name until commit (discard removes it)."""

    ALIGN = 4096
    INLINE_BELOW = 1024     # smaller new tensors stay in the graph proto

    def __init__(self, graph_path: Path):
        self.path = Path(graph_path).with_name(Path(graph_path).name + ".data")
        self._tmp = self.path.with_name(self.path.name + f".partial-{os.getpid()}")
        self._file = open(self._tmp, "wb")
        self._written: set[str] = set()      # names of the tensors whose bytes are in this file

    def put(self, tensor, data: bytes | None = None) -> None:
        """Append the tensor's bytes (its raw_data, or `data` for a tensor kept elsewhere) and point it here."""
        from onnx import TensorProto

        raw = tensor.raw_data if data is None else data
        if data is None and len(raw) < self.INLINE_BELOW:
            return
        self._file.write(b"\0" * (-self._file.tell() % self.ALIGN))
        offset = self._file.tell()
        self._file.write(raw)
        self._written.add(tensor.name)
        tensor.ClearField("raw_data")
        tensor.data_location = TensorProto.EXTERNAL
        del tensor.external_data[:]
        for key, value in (("location", self.path.name), ("offset", str(offset)), ("length", str(len(raw)))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value

    def take_rest(self, model, base_dir: Path) -> None:
        """Copy every tensor of the graph still kept in another external file into this one."""
        from onnx import TensorProto

        tensors = list(model.graph.initializer) + [a.t for n in model.graph.node for a in n.attribute
                                                   if a.HasField("t")]
        for t in tensors:
            if t.data_location == TensorProto.EXTERNAL and t.name not in self._written:
                self.put(t, external_bytes(t, base_dir))

    def commit(self) -> None:
        self._file.close()
        os.replace(self._tmp, self.path)

    def discard(self) -> None:
        """Remove what was written (committed or not): the graph that would read it was not saved."""
        self._file.close()
        self._tmp.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)


def external_bytes(tensor, base_dir: Path) -> bytes:
    """The bytes of a tensor kept in external data (its location is relative to base_dir), read
    without loading the graph's other weights."""
    info = {e.key: e.value for e in tensor.external_data}
    with open(Path(base_dir) / info["location"], "rb") as f:
        f.seek(int(info.get("offset", 0)))
        return f.read(int(info["length"]))


def existing_manifest(bundle: Path) -> dict:
    """The manifest of a bundle an upgrade rewrites in place; ExportError when it is not a bundle."""
    path = Path(bundle) / "spectr.json"
    if not path.is_file():
        raise ExportError(f"{bundle} is not a bundle (no spectr.json); export one first")
    return json.loads(path.read_text())


def tokenizer_entry(info: TokenizerInfo) -> dict:
    return {
        "file": "tokenizer.json",
        "vocab_size": info.vocab_size,
        "vocab_sha256": info.vocab_sha256,
        "bos_token_id": info.bos_token_id,
        "add_bos_token": info.add_bos_token,
        "eos_token_ids": info.eos_token_ids,
        "chat_template": info.chat_template,
        "special_tokens": {"bos_token": info.bos_token, "eos_token": info.eos_token, "pad_token": info.pad_token},
    }


def model_entry(role: str, files: list[Path], bundle: Path, io: GraphIO, config: dict, tok: TokenizerInfo,
                source: str, quant: str, parity: float | None) -> dict:
    """The manifest entry of models/<role>; files are model.onnx first, then its external data."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if io.head_dim != head_dim or io.num_kv_heads != config.get("num_key_value_heads", config["num_attention_heads"]):
        raise ExportError(f"{role}: graph cache is [kv_heads={io.num_kv_heads}, head_dim={io.head_dim}] but config.json "
                          f"says [{config.get('num_key_value_heads')}, {head_dim}]; the ONNX and config disagree")
    return {
        "file": files[0].relative_to(bundle).as_posix(),
        "tokenizer_file": f"{role}/tokenizer.json",
        "vocab_sha256": tok.vocab_sha256,
        "source": source,
        "architecture": config.get("model_type"),
        "quant": quant,
        "dtype": io.dtype,
        "num_layers": len(io.past),
        "num_kv_heads": io.num_kv_heads,
        "head_dim": io.head_dim,
        "logits_width": io.logits_width,
        "context_length": config.get("max_position_embeddings"),
        "inputs": {
            "input_ids": io.input_ids,
            "attention_mask": io.attention_mask,
            "position_ids": io.position_ids,
            "past": [list(kv) for kv in io.past],
        },
        "outputs": {"logits": io.logits, "present": [list(kv) for kv in io.present]},
        "tree_mask": False,
        "parity_max_abs_diff": parity,
        "size_bytes": sum(f.stat().st_size for f in files),
    }


def manifest(name: str, tokenizer: dict, models: dict) -> dict:
    return {
        "format": "spectr-edge-bundle",
        "format_version": 1,
        "created_by": f"spectr-edge {_version()}",
        "name": name,
        "tokenizer": tokenizer,
        "models": models,
    }
