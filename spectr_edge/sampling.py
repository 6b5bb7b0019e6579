"""Logits processing and sampling: the one pipeline that plain and speculative decoding share.

Pure NumPy; randomness is passed in as a numpy.random.Generator. Shapes:
  logits  [..., W]   W = the model's output width, which may exceed vocab_size
                     (Qwen pads 151665 real ids to 151936); ids >= vocab_size are padding
  probs   [..., W]   float32, zero on padding and on everything top-k / top-p removed

Pipeline (HF order and semantics; docs/ALGORITHMS.md):
  penalties (TokenHistory, from each position's own prefix) -> mask padding -> temperature ->
  top-k -> top-p -> softmax.
Greedy decoding (temperature 0) never divides by the temperature: it takes `greedy_token`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOP_P_CANDIDATES = 1024   # top-p sorts only this many largest weights unless they hold < top_p
SAMPLE_BLOCK = 1024       # sample() cumsums block totals, then one block


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0   # 0 => greedy
    top_k: int = 0             # 0 => off
    top_p: float = 1.0         # 1.0 => off
    presence_penalty: float = 0.0      # OpenAI: minus this for every token the output already holds
    frequency_penalty: float = 0.0     # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0    # HF / ORT GenAI: logits of tokens in the prompt or output / this (> 0: / ; < 0: *)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class TokenHistory:
    """The tokens before a position, as penalties read them: every token of the prompt and the output
    (HF's repetition penalty) and the output's counts (OpenAI's presence and frequency penalties).

    penalize(logits, params, path) applies the penalties for a position reached by the committed
    tokens followed by `path` (drafted tokens before it): each drafted position is processed from
    its own hypothetical prefix, exactly as plain decoding would have processed it there."""

    def __init__(self, prompt_ids):
        self._seen = set(int(t) for t in prompt_ids)
        self._output: dict[int, int] = {}
        self._arrays = None

    def extend(self, tokens) -> None:
        for t in tokens:
            t = int(t)
            self._seen.add(t)
            self._output[t] = self._output.get(t, 0) + 1
        self._arrays = None

    def _base(self):
        if self._arrays is None:
            out_ids = np.fromiter(self._output, dtype=np.int64, count=len(self._output))
            out_counts = np.fromiter(self._output.values(), dtype=np.float32, count=len(self._output))
            self._arrays = (np.fromiter(self._seen, dtype=np.int64, count=len(self._seen)), out_ids, out_counts)
        return self._arrays

    def penalize(self, logits: np.ndarray, params: SamplingParams, path=()) -> np.ndarray:
        """[W] logits -> [W] penalized copy (repetition first, as HF's processor, then presence and
        frequency), for the position after the committed tokens and `path`."""
        seen, out_ids, out_counts = self._base()
        path = [int(t) for t in path]
        if path:
            extra = dict(zip(out_ids.tolist(), out_counts.tolist()))
            for t in path:
                extra[t] = extra.get(t, 0.0) + 1.0
            seen = np.union1d(seen, np.asarray(path, dtype=np.int64))
            out_ids = np.fromiter(extra, dtype=np.int64, count=len(extra))
            out_counts = np.fromiter(extra.values(), dtype=np.float32, count=len(extra))
        out = np.array(logits, dtype=np.float32, copy=True)          # [W]
        rp = params.repetition_penalty
        if rp != 1.0 and seen.size:
            chosen = out[seen]
            out[seen] = np.where(chosen > 0, chosen / np.float32(rp), chosen * np.float32(rp))
        if (params.presence_penalty or params.frequency_penalty) and out_ids.size:
            out[out_ids] -= np.float32(params.presence_penalty) + np.float32(params.frequency_penalty) * out_counts
        return out


def mask_padding(logits: np.ndarray, vocab_size: int) -> np.ndarray:
    """[..., W] -> [..., W] copy with every padding id (>= vocab_size) set to -inf."""
    masked = np.array(logits, copy=True)   # [..., W]; never touch the caller's array
    masked[..., vocab_size:] = -np.inf
    return masked


def greedy_token(logits: np.ndarray, vocab_size: int):
    """Argmax over real ids, the FIRST max on ties. [W] -> int; [n, W] -> [n] int64."""
    best = np.argmax(np.asarray(logits)[..., :vocab_size], axis=-1)   # [...]
    return int(best) if np.ndim(best) == 0 else best.astype(np.int64)


def logits_to_probs(logits: np.ndarray, params: SamplingParams, vocab_size: int) -> np.ndarray:
    """[..., W] logits -> [..., W] float32 probs: mask padding, temperature, top-k, top-p, softmax."""
    if not params.temperature > 0:
        raise ValueError(f"logits_to_probs needs temperature > 0 (got {params.temperature}); "
                         "use greedy_token for temperature 0")
    logits = np.asarray(logits)
    rows = logits.reshape(-1, logits.shape[-1])           # [n, W]
    probs = np.zeros(rows.shape, dtype=np.float32)        # [n, W]; padding keeps 0
    for row, out in zip(rows, probs):
        _row_probs(row[:vocab_size], params, out[:vocab_size])
    return probs.reshape(logits.shape)


def _row_probs(logits: np.ndarray, params: SamplingParams, out: np.ndarray) -> None:
    """[V] logits of real ids -> [V] float32 probs, written into out (in place: no temporaries)."""
    with np.errstate(over="ignore", divide="ignore"):
        np.divide(logits, np.float32(params.temperature), out=out)        # out: scaled logits
    if not np.isfinite(out.max()):
        # a temperature so small that logits / T overflows float32 (or T underflows to 0): the same
        # weights from the shifted logits in float64, which is exp(0) = 1 at the largest logit and
        # 0 elsewhere for any such T: the limit T -> 0+, a draw among the argmax ties
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            shifted = (logits.astype(np.float64) - float(np.max(logits))) / params.temperature
            np.copyto(out, np.maximum(shifted, -np.inf), casting="unsafe")
    top_k_on = 0 < params.top_k < out.size
    if top_k_on:
        np.putmask(out, out < _largest(out, params.top_k).min(), -np.inf)   # ties with the k-th kept
    np.subtract(out, out.max(), out=out)
    np.exp(out, out=out)                                                   # out: unnormalised weights
    if params.top_p < 1.0:
        live = out[out > 0] if top_k_on else out                            # [n_live] weights with mass
        np.putmask(out, out < _top_p_floor(live, out.sum(dtype=np.float64), params.top_p), 0.0)
    out /= np.float32(out.sum(dtype=np.float64))                            # a float32 scalar: stays fast


def _largest(values: np.ndarray, count: int) -> np.ndarray:
    """[n] -> [count] the largest values, in no order. A strided sample guesses a floor
    that about count + 256 values clear; only those are partitioned (all, if too few clear)."""
    if count >= values.size:
        return values
    sample = values[::16]                                   # [n / 16]
    rank = min(sample.size, count // 16 + 16)
    floor = np.partition(sample, sample.size - rank)[sample.size - rank]
    pool = values[values >= floor]                          # [>= count] when the guess holds
    if pool.size < count:
        pool = values
    return np.partition(pool, pool.size - count)[pool.size - count:]


def _top_p_floor(weights: np.ndarray, total: float, top_p: float) -> np.float32:
    """Smallest weight HF's TopPLogitsWarper keeps; tokens with weight >= it survive.

    weights: [n] softmax numerators (those with mass), total: their sum. HF sorts ascending
    and removes tokens whose cumulative prob <= 1 - top_p, always keeping the largest.
    Equivalently, walking down from the largest, a token is kept while the mass strictly
    above it is < top_p. Ties with the last kept token are kept too (HF's order among ties
    is unspecified). Only the largest are sorted: TOP_P_CANDIDATES of them, then 16x more,
    then all, until they hold >= top_p.
    """
    num_top = min(TOP_P_CANDIDATES, weights.size)
    while True:
        top = np.sort(_largest(weights, num_top))[::-1]    # [num_top] largest weights, descending
        mass = np.cumsum(top, dtype=np.float64)             # [num_top] mass down to and including each
        if mass[-1] >= top_p * total or num_top == weights.size:
            break
        num_top = min(16 * num_top, weights.size)          # they hold < top_p: look further down
    mass_above = (mass - top) / total                       # [num_top] mass strictly above each
    num_keep = max(1, int(np.count_nonzero(mass_above < top_p)))
    return top[num_keep - 1]


def sample(probs: np.ndarray, rng: np.random.Generator):
    """Inverse-CDF draw. [V] -> int; [n, V] -> [n] int64, one independent draw per row.

    Rows need not sum exactly to 1 (the draw follows probs / probs.sum()); a
    zero-probability id is never returned.
    """
    probs = np.asarray(probs)
    rows = probs.reshape(-1, probs.shape[-1])             # [n, V]
    ids = np.array([_sample_row(row, u) for row, u in zip(rows, rng.random(rows.shape[0]))],
                   dtype=np.int64)                        # [n]
    return int(ids[0]) if probs.ndim == 1 else ids.reshape(probs.shape[:-1])


def _sample_row(row: np.ndarray, uniform: float) -> int:
    """[V] probs, u in [0, 1) -> the first id whose cdf exceeds u * total.

    Two levels (blocks of SAMPLE_BLOCK ids, then ids inside the block) so that only one
    block needs a sequential cumsum. Right-sided search never stops on a zero-probability
    id; when rounding runs past the end, the last positive id is taken instead.
    """
    block_sums = np.add.reduceat(row, np.arange(0, row.size, SAMPLE_BLOCK), dtype=np.float64)
    block_cdf = np.cumsum(block_sums)                                         # [n_blocks]
    if not (np.isfinite(block_cdf[-1]) and block_cdf[-1] > 0):
        raise ValueError("sample() needs rows with positive, finite probability mass")
    target = uniform * block_cdf[-1]
    block = _right_search(block_cdf, target)
    start = block * SAMPLE_BLOCK
    if block > 0:
        target -= block_cdf[block - 1]
    return start + _right_search(np.cumsum(row[start:start + SAMPLE_BLOCK], dtype=np.float64), target)


def _right_search(cdf: np.ndarray, target: float) -> int:
    """[m] non-decreasing cdf -> first index with cdf > target, else the last index that adds mass."""
    index = int(np.searchsorted(cdf, target, side="right"))
    if index < cdf.size:
        return index
    steps = np.flatnonzero(np.diff(cdf, prepend=0.0) > 0)                   # indices that add mass
    return int(steps[-1])
