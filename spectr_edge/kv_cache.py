"""The KV cache of one model, with the few explicit operations speculation needs.

Layout per layer: key and value, each # [batch, kv_heads, length, head_dim]
All rows of a batch always have the same length (the export's attention mask is all ones).
"""

from __future__ import annotations

import numpy as np


class KVCache:
    """Owns one model's past keys/values; the engine changes it only through these methods."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype=np.float32):
        empty = np.zeros((1, num_kv_heads, 0, head_dim), dtype=dtype)  # [1, kv_heads, 0, head_dim]
        self.layers: list[tuple[np.ndarray, np.ndarray]] = [(empty, empty) for _ in range(num_layers)]

    @property
    def length(self) -> int:
        """Number of cached positions (the `past` length fed to the next call)."""
        return self.layers[0][0].shape[2]

    @property
    def batch(self) -> int:
        return self.layers[0][0].shape[0]

    def replace(self, presents: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Take a call's `present` outputs as the new cache (no copy)."""
        self.layers = presents

    def crop(self, length: int) -> None:
        """Keep the first `length` positions of every row (rollback of rejected tokens)."""
        if length == self.length:
            return
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        # slicing the length axis is not contiguous; copy once here rather than inside every run
        self.layers = [(np.ascontiguousarray(k[:, :, :length]), np.ascontiguousarray(v[:, :, :length]))
                       for k, v in self.layers]

    def repeat_rows(self, num_rows: int) -> None:
        """Replicate a batch-1 cache to `num_rows` identical rows (one per candidate)."""
        if self.batch != 1:
            raise ValueError(f"repeat_rows needs a batch-1 cache, this one has {self.batch} rows")
        if num_rows == 1:
            return
        self.layers = [(np.repeat(k, num_rows, axis=0), np.repeat(v, num_rows, axis=0))
                       for k, v in self.layers]  # [num_rows, kv_heads, length, head_dim]

    def keep_row(self, row: int) -> None:
        """Keep one row (the surviving candidate) as a batch-1 cache."""
        if self.batch == 1 and row == 0:
            return
        self.layers = [(k[row:row + 1], v[row:row + 1]) for k, v in self.layers]  # contiguous views

    def gather(self, keep: int, positions: np.ndarray) -> None:
        """Keep the first `keep` positions followed by `positions` (ascending), made contiguous.

        After a tree call the cache holds past + every tree node; this keeps the past and the
        accepted path's nodes, in path order, so the cache reads as if the path had been decoded.
        """
        positions = np.asarray(positions, dtype=np.int64)
        if len(positions) and np.array_equal(positions, np.arange(keep, keep + len(positions))):
            self.crop(keep + len(positions))        # the path is already contiguous: a crop
            return
        index = np.concatenate([np.arange(keep, dtype=np.int64), positions])
        self.layers = [(np.take(k, index, axis=2), np.take(v, index, axis=2)) for k, v in self.layers]

