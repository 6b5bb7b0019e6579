"""A static next-token table for prompt lookup when the text itself has no match.

Prompt lookup (lookup.py) finds nothing to copy on about a third of its steps: the last token
never occurred before in the prompt or the output. On a target whose calls score at least two
tokens (int4, `min_call_tokens` 2) such a step pays for a padding slot anyway, so a one-token
guess there is free. This table gives that guess: for the last one or two tokens, the token that
most often followed them in a corpus of two parts:
- the Python standard library's source (code, comments, docstrings), which every machine that
  runs spectr-edge has;
- conversation sampled from the bundle's own draft model (self_text.py, 65,536 tokens by default),
  each of its tokens counted CONVERSATION_WEIGHT times. It is the phrasing of the target's family,
  and it raised the share of the int4 target's greedy tokens the table predicts from 7.5% to 12.2%
  on the benchmark's outputs (bench/RESULTS.md).

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
CONVERSATION_WEIGHT = 10        # what a token of sampled conversation counts against one of library source
CONVERSATION_TOKENS = 65536     # sampled by export (self_text.py): ~7 min with the 0.5B int4 draft on 2 cores


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


def _most_common_next(prev: np.ndarray, nxt: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each distinct key in prev, the value in nxt that follows it with the largest total weight
    (smallest id on ties)."""
    base = int(nxt.max(initial=0)) + 1
    if int(prev.max(initial=0)) >= np.iinfo(np.int64).max // base:
        raise ValueError("n-gram keys too large to pair with the next token in one int64")
    # one int64 per (key, next): sorting it sorts by key, then next (np.unique over rows was 9-20x slower)
    pair_ids, inverse = np.unique(prev * base + nxt, return_inverse=True)
    counts = np.bincount(inverse.reshape(-1), weights=weights, minlength=len(pair_ids))
    keys, nexts = pair_ids // base, pair_ids % base
    order = np.lexsort((nexts, -counts, keys))                          # by key, then weight desc, then id
    keys, nexts = keys[order], nexts[order]
    first = np.ones(len(keys), dtype=bool)
    first[1:] = keys[1:] != keys[:-1]
    return keys[first], nexts[first]


def build_table(token_ids: np.ndarray, vocab_size: int, weights: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The table's arrays from a corpus's token ids # [T]; weights # [T]: what each occurrence of a
    token after its context counts (default 1)."""
    a = np.asarray(token_ids, dtype=np.int64)
    w = np.ones(len(a)) if weights is None else np.asarray(weights, dtype=np.float64)
    keys1, next1 = _most_common_next(a[:-1], a[1:], w[1:])
    keys2, next2 = _most_common_next(a[:-2] * vocab_size + a[1:-1], a[2:], w[2:])
    return {"keys1": keys1, "next1": next1, "keys2": keys2, "next2": next2,
            "vocab_size": np.asarray(vocab_size, dtype=np.int64)}


def write_table(bundle: Path, tokenizer_file: Path, vocab_size: int, limit_bytes: int | None = None,
                conversations: list[list[int]] = (), conversation_source: str = "") -> dict:
    """Tokenize the corpus, write the bundle's table file, and return its manifest entry.

    conversations: token lists sampled from the bundle's model (self_text.py), counted
    CONVERSATION_WEIGHT times each."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_file))
    files, source = stdlib_sources(limit_bytes)
    ids: list[int] = []
    texts = [f.read_text(encoding="utf-8", errors="ignore") for f in files]
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
    weights = [np.ones(len(ids))]
    corpus = [np.asarray(ids, dtype=np.int64)]
    for row in conversations:
        corpus.append(np.asarray(row, dtype=np.int64))
        weights.append(np.full(len(row), float(CONVERSATION_WEIGHT)))
    arrays = build_table(np.concatenate(corpus), vocab_size, np.concatenate(weights))
    tmp = bundle / (TABLE_FILE + ".partial.npz")
    np.savez(tmp, **arrays)
    tmp.replace(bundle / TABLE_FILE)
    entry = {"file": TABLE_FILE, "source": source, "corpus_tokens": len(ids),
             "entries": int(len(arrays["keys1"]) + len(arrays["keys2"]))}
    if conversations:
        entry["source"] += (f" + {sum(map(len, conversations))} tokens of conversation sampled from "
                            f"{conversation_source} (weight {CONVERSATION_WEIGHT})")
        entry["conversation_tokens"] = int(sum(map(len, conversations)))
    return entry


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


def sample_bundle_conversation(bundle: Path, manifest: dict, tokens: int, log=print,
                               threads: int | None = None, seed: int = 0) -> tuple[list[list[int]], str]:
    """(rows, their source) : `tokens` tokens of conversation sampled from the bundle's draft model,
    else its target (self_text.py); no rows when the tokenizer has no chat template."""
    from .bundle import bundle_from_manifest
    from .onnx_model import OnnxLM
    from .self_text import sample_conversations
    from .text import TextCodec
    b = bundle_from_manifest(bundle, manifest)
    spec = b.draft or b.target
    if tokens <= 0:
        return [], ""
    log(f"      sampling {tokens} tokens of conversation from the {spec.role} model")
    rows = sample_conversations(OnnxLM(spec, provider="cpu", threads=threads), TextCodec(b.tokenizer),
                                b.tokenizer.vocab_size, b.tokenizer.eos_token_ids, tokens, seed=seed, log=log)
    if not rows:
        log("      the tokenizer has no chat template: no conversation to sample")
    return rows, f"the {spec.role} model ({spec.source})"


def table_with_conversation(bundle: Path, manifest: dict, conversation_tokens: int, log=print,
                            threads: int | None = None, rows: list[list[int]] | None = None,
                            source: str = "") -> dict:
    """Write the table of a bundle (its manifest given) with `conversation_tokens` tokens of
    conversation sampled from its draft model, else its target (or the given rows and their
    source); returns the manifest entry."""
    if rows is None:
        rows, source = sample_bundle_conversation(bundle, manifest, conversation_tokens, log, threads)
    from .bundle import bundle_from_manifest
    tokenizer = bundle_from_manifest(bundle, manifest).tokenizer
    return write_table(bundle, tokenizer.file, tokenizer.vocab_size, conversations=rows,
                       conversation_source=source)


def add_lookup_table(bundle_path, log=print, conversation_tokens: int = CONVERSATION_TOKENS,
                     threads: int | None = None) -> dict:
    """Build the table for an existing bundle and record it in its manifest."""
    from .bundle import read_bundle, write_manifest
    bundle = Path(bundle_path)
    manifest = read_bundle(bundle).manifest
    entry = table_with_conversation(bundle, manifest, conversation_tokens, log, threads)
    manifest["lookup_table"] = entry
    write_manifest(bundle, manifest)
    log(f"{bundle}: lookup table from the {entry['source']}: {entry['corpus_tokens']} tokens of library "
        f"source, {entry['entries']} entries")
    return entry
