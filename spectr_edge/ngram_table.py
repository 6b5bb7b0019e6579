"""A static next-token table for prompt lookup when the text itself has no match.

Prompt lookup (lookup.py) finds nothing to copy on about a third of its steps: the last token
never occurred before in the prompt or the output. On a target whose calls score at least two
tokens (int4, `min_call_tokens` 2) such a step pays for a padding slot anyway, so a one-token
guess there is free. This table gives that guess: for the last one or two tokens, the token that
most often followed them in a text corpus. The corpus is the Python standard library's source
(code, comments, docstrings: English and code, the registers a coder model answers in), which
every machine that runs spectr-edge has, so a bundle's table can always be rebuilt the same way.

The table only proposes tokens; the target verifies them like any prompt-lookup draft, so the
output law is unchanged whatever the table says.

File (`lookup_table.npz` in the bundle, manifest key "lookup_table"): keys1/next1 (one previous
token) and keys2/next2 (two previous tokens, key = a * V + b), keys sorted, int64.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

TABLE_FILE = "lookup_table.npz"


def stdlib_sources(limit_bytes: int | None = None) -> tuple[list[Path], str]:
    """The top-level Python standard-library modules (sorted, so the corpus is reproducible) and a
    description of them for the manifest."""
    import platform
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for f in sorted(root.glob("*.py")):
        size = f.stat().st_size
        if limit_bytes is not None and total + size > limit_bytes:
            break
        files.append(f)
        total += size
    return files, f"Python {platform.python_version()} standard library ({len(files)} modules, {total} bytes)"


def _most_common_next(prev: np.ndarray, nxt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each distinct key in prev, the value in nxt that follows it most often (smallest id on ties)."""
    pairs = np.stack([prev, nxt], axis=1)
    uniq, counts = np.unique(pairs, axis=0, return_counts=True)        # sorted by (key, next)
    order = np.lexsort((uniq[:, 1], -counts, uniq[:, 0]))               # by key, then count desc, then id
    uniq = uniq[order]
    first = np.ones(len(uniq), dtype=bool)
    first[1:] = uniq[1:, 0] != uniq[:-1, 0]
    return uniq[first, 0], uniq[first, 1]


def build_table(token_ids: np.ndarray, vocab_size: int) -> dict[str, np.ndarray]:
    """The table's arrays from a corpus's token ids # [T]."""
    a = np.asarray(token_ids, dtype=np.int64)
    keys1, next1 = _most_common_next(a[:-1], a[1:])
    keys2, next2 = _most_common_next(a[:-2] * vocab_size + a[1:-1], a[2:])
    return {"keys1": keys1, "next1": next1, "keys2": keys2, "next2": next2,
            "vocab_size": np.asarray(vocab_size, dtype=np.int64)}


def write_table(bundle: Path, tokenizer_file: Path, vocab_size: int, limit_bytes: int | None = None) -> dict:
    """Tokenize the corpus, write the bundle's table file, and return its manifest entry."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_file))
    files, source = stdlib_sources(limit_bytes)
    ids: list[int] = []
    texts = [f.read_text(encoding="utf-8", errors="ignore") for f in files]
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
    arrays = build_table(np.asarray(ids, dtype=np.int64), vocab_size)
    tmp = bundle / (TABLE_FILE + ".partial.npz")
    np.savez(tmp, **arrays)
    tmp.replace(bundle / TABLE_FILE)
    return {"file": TABLE_FILE, "source": source, "corpus_tokens": len(ids),
            "entries": int(len(arrays["keys1"]) + len(arrays["keys2"]))}


class NgramTable:
    """Read side: the guess for the token after `ids`, from two previous tokens, else one."""

    def __init__(self, arrays):
        self.vocab = int(arrays["vocab_size"])
        self.keys1, self.next1 = arrays["keys1"], arrays["next1"]
        self.keys2, self.next2 = arrays["keys2"], arrays["next2"]

    @classmethod
    def load(cls, path: Path) -> "NgramTable":
        with np.load(path) as f:
            return cls({k: f[k] for k in f.files})

    @staticmethod
    def _find(keys: np.ndarray, values: np.ndarray, key: int) -> int | None:
        i = int(np.searchsorted(keys, key))
        return int(values[i]) if i < len(keys) and keys[i] == key else None

    def guess(self, ids) -> tuple[int, int] | None:
        """(token, n): the most common follower of the last n = 2 (else 1) tokens; None if unseen."""
        if len(ids) >= 2:
            tok = self._find(self.keys2, self.next2, int(ids[-2]) * self.vocab + int(ids[-1]))
            if tok is not None:
                return tok, 2
        if ids:
            tok = self._find(self.keys1, self.next1, int(ids[-1]))
            if tok is not None:
                return tok, 1
        return None


def add_lookup_table(bundle_path, log=print) -> dict:
    """Build the table for an existing bundle and record it in its manifest."""
    import json

    from .bundle import write_manifest
    bundle = Path(bundle_path)
    manifest = json.loads((bundle / "spectr.json").read_text(encoding="utf-8"))
    tok = manifest["tokenizer"]
    entry = write_table(bundle, bundle / tok["file"], int(tok["vocab_size"]))
    manifest["lookup_table"] = entry
    write_manifest(bundle, manifest)
    log(f"{bundle}: lookup table from the {entry['source']}: {entry['corpus_tokens']} tokens, "
        f"{entry['entries']} entries")
    return entry
