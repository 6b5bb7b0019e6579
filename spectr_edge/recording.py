"""Recording the target's teacher signal from real traffic (opt-in: `--record DIR`, `load(record=DIR)`).

Every generation already has the target's logits at each position it kept: the distribution that
predicted each emitted token (the prefill's last row for the first token, the verified rows after).
A Recorder appends, per generation, the prompt's and the output's token ids and the target's top-k
log-probabilities (temperature 1; with penalties, of the penalized logits the output was drawn
from) at those positions, as one JSON line of `DIR/traffic.jsonl`:

    {"format": 1, "vocab_sha256": "...", "top_k": 16, "prompt": [ids], "tokens": [ids],
     "top_ids": base64 int32 [n, top_k], "top_logprobs": base64 float16 [n, top_k]}

`n` = len(tokens): row i is the target's distribution over tokens[i] given prompt + tokens[:i].
One line is written in one append when the generation ends, so an interrupted process loses at
most the generation in flight, and a torn last line is skipped by `read`. The file stops growing
at `max_bytes` (the recorder says so once). Nothing is recorded without the option.
"""

from __future__ import annotations

import base64
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import InputError

RECORD_FILE = "traffic.jsonl"
FORMAT = 1
DEFAULT_TOP_K = 16
MAX_TOP_K = 64
DEFAULT_MAX_BYTES = 1 << 30           # 1 GiB: about 40,000 generations of 128 tokens at top-16


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")


def top_logprobs(logits: np.ndarray, vocab_size: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely tokens of each row of logits # [n, W] and their log-probabilities, best
    first: ids # [n, k] int32, log-probabilities # [n, k] float32."""
    x = np.asarray(logits[:, :vocab_size], dtype=np.float64)                  # [n, V]
    top = np.argpartition(-x, k - 1, axis=1)[:, :k]                           # [n, k] unordered
    vals = np.take_along_axis(x, top, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    top, vals = np.take_along_axis(top, order, axis=1), np.take_along_axis(vals, order, axis=1)
    m = x.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(x - m).sum(axis=1, keepdims=True))               # [n, 1]
    return top.astype(np.int32), (vals - lse).astype(np.float32)


class Recorder:
    """Appends the target's top-k log-probabilities of each generation to DIR/traffic.jsonl."""

    def __init__(self, directory: str | os.PathLike, vocab_size: int, vocab_sha256: str | None = None,
                 top_k: int = DEFAULT_TOP_K, max_bytes: int = DEFAULT_MAX_BYTES):
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or not 1 <= top_k <= MAX_TOP_K:
            raise InputError(f"the recording's top_k must be an integer in [1, {MAX_TOP_K}], got {top_k!r}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, np.integer)) or max_bytes < 1:
            raise InputError(f"the recording's size cap must be a positive number of bytes, got {max_bytes!r}")
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise InputError(f"cannot record into {self.directory}: it is a file, not a directory; "
                             "name a directory (it is created if missing)")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise InputError(f"cannot create the recording directory {self.directory} ({err.strerror}); "
                             "name a writable directory") from None
        self.path = self.directory / RECORD_FILE
        self.vocab_size, self.vocab_sha256 = int(vocab_size), vocab_sha256
        self.top_k, self.max_bytes = int(min(top_k, vocab_size)), int(max_bytes)
        self.full = False                     # the cap was reached (said once)
        self.written = 0                      # generations appended by this recorder

    def request(self, prompt_ids: list[int]) -> Recording:
        return Recording(self, list(map(int, prompt_ids)))

    def _append(self, rec: Recording) -> None:
        if not rec.tokens:
            return
        ids, logp = np.concatenate(rec.top_ids), np.concatenate(rec.top_logprobs)
        line = json.dumps({"format": FORMAT, "vocab_sha256": self.vocab_sha256, "top_k": self.top_k,
                           "prompt": rec.prompt, "tokens": rec.tokens, "top_ids": _b64(ids.astype("<i4")),
                           "top_logprobs": _b64(logp.astype("<f2"))}, separators=(",", ":")) + "\n"
        data = line.encode("ascii")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size + len(data) > self.max_bytes:
                if not self.full:
                    self.full = True
                    print(f"spectr-edge: recording stopped: {self.path} reached its cap of "
                          f"{self.max_bytes / 2**20:.0f} MiB; move it away or raise the cap", file=sys.stderr)
                return
            os.write(fd, data)                # one append: a line is whole or torn at the very end
        finally:
            os.close(fd)
        self.written += 1


@dataclass
class Recording:
    """One generation being recorded: rows are added as tokens are kept, written by close()."""
    recorder: Recorder
    prompt: list[int]

    def __post_init__(self):
        self.tokens: list[int] = []
        self.top_ids: list[np.ndarray] = []
        self.top_logprobs: list[np.ndarray] = []

    def add(self, logits: np.ndarray, tokens: list[int]) -> None:
        """logits # [len(tokens), W]: row i predicted tokens[i]."""
        ids, logp = top_logprobs(logits, self.recorder.vocab_size, self.recorder.top_k)
        self.tokens += list(map(int, tokens))
        self.top_ids.append(ids)
        self.top_logprobs.append(logp)

    def close(self) -> None:
        self.recorder._append(self)


@dataclass(frozen=True)
class Record:
    """One recorded generation, decoded."""
    prompt: list[int]
    tokens: list[int]
    top_ids: np.ndarray              # [n, top_k] int32
    top_logprobs: np.ndarray         # [n, top_k] float32
    vocab_sha256: str | None


def read(directory: str | os.PathLike) -> Iterator[Record]:
    """The records of DIR/traffic.jsonl (or of that file given directly), oldest first; lines that are
    not whole records (an interrupted write) are skipped."""
    path = Path(directory)
    path = path / RECORD_FILE if path.is_dir() else path
    if not path.is_file():
        raise InputError(f"no recording at {path}; record with `spectr-edge generate --record DIR ...` first")
    with open(path, "rb") as f:
        for raw in f:
            try:
                r = json.loads(raw)
                if r.get("format") != FORMAT:
                    continue
                k, n = int(r["top_k"]), len(r["tokens"])
                ids = np.frombuffer(base64.b64decode(r["top_ids"]), dtype="<i4").reshape(n, k)
                logp = np.frombuffer(base64.b64decode(r["top_logprobs"]), dtype="<f2").reshape(n, k)
            except (ValueError, KeyError, TypeError):
                continue
            yield Record(list(r["prompt"]), list(r["tokens"]), ids.astype(np.int32),
                         logp.astype(np.float32), r.get("vocab_sha256"))
