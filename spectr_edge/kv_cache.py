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
        self.offset = 0   # leading ids the cache never saw (a draft's context window); positions start after them

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



class BufferKVCache:
    """A cache in preallocated buffers that the fused attention kernel updates in place.

    For graphs exported with `"attention": "gqa"` (export/fuse_attention.py) on the CPU: every
    call reads the past from, and writes its new positions into, the same buffers # [batch,
    kv_heads, capacity, head_dim], so nothing is concatenated, copied out or reallocated per
    call. Rolling back rejected tokens is just a smaller `length` (the kernel reads positions
    below `seqlens_k` only); a tree path is moved to contiguous positions in place.
    Same operations as KVCache; `layers` gives views of the valid positions.
    """

    GROW = 256

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype=np.float32, capacity: int = 512):
        self._geometry = (num_layers, num_kv_heads, head_dim, dtype)
        self.buffers = self._allocate(1, capacity)
        self.length = 0
        self.offset = 0   # leading ids the cache never saw (a draft's context window); positions start after them
        self._values = None

    def _allocate(self, rows: int, capacity: int) -> list[np.ndarray]:
        layers, heads, dim, dtype = self._geometry
        return [np.zeros((rows, heads, capacity, dim), dtype=dtype) for _ in range(2 * layers)]

    def _replace(self, buffers: list[np.ndarray]) -> None:
        self.buffers = buffers
        self._values = None

    @property
    def batch(self) -> int:
        return self.buffers[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[2]

    @property
    def layers(self) -> list[tuple[np.ndarray, np.ndarray]]:
        n = self.length
        return [(self.buffers[2 * i][:, :, :n], self.buffers[2 * i + 1][:, :, :n])
                for i in range(len(self.buffers) // 2)]

    def reserve(self, total: int) -> None:
        """Make room for `total` positions (grows geometrically, copying the valid ones once)."""
        if total <= self.capacity:
            return
        capacity = -(-max(total, 2 * self.capacity) // self.GROW) * self.GROW
        bigger = self._allocate(self.batch, capacity)
        for new, old in zip(bigger, self.buffers):
            new[:, :, :self.length] = old[:, :, :self.length]
        self._replace(bigger)

    def ort_values(self) -> list:
        """One OrtValue per buffer, sharing its memory (bound as both past input and present output)."""
        if self._values is None:
            import onnxruntime as ort

            self._values = [ort.OrtValue.ortvalue_from_numpy(b) for b in self.buffers]
        return self._values

    def advance(self, new: int) -> None:
        self.length += new

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = length

    def repeat_rows(self, num_rows: int) -> None:
        if self.batch != 1:
            raise ValueError(f"repeat_rows needs a batch-1 cache, this one has {self.batch} rows")
        if num_rows == 1:
            return
        rows = self._allocate(num_rows, self.capacity)
        for new, old in zip(rows, self.buffers):
            new[:, :, :self.length] = old[:, :, :self.length]
        self._replace(rows)

    def keep_row(self, row: int) -> None:
        if self.batch == 1 and row == 0:
            return
        self._replace([b[row:row + 1] for b in self.buffers])   # a leading-axis slice stays contiguous

    def gather(self, keep: int, positions: np.ndarray) -> None:
        positions = np.asarray(positions, dtype=np.int64)
        m = len(positions)
        if not np.array_equal(positions, np.arange(keep, keep + m)):
            for b in self.buffers:
                b[:, :, keep:keep + m] = b[:, :, positions]    # fancy indexing reads a copy first
        self.length = keep + m
