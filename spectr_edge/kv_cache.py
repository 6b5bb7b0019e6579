"""The KV cache of one model, on the model's device, with the few explicit operations speculation needs.

Per layer a key and a value tensor # [rows, kv_heads, positions, head_dim], held as ONNX Runtime
OrtValues on the model's device (spectr_edge/device.py) and bound to the graph's past inputs and
present outputs by I/O binding: a call never copies the cache to the host. All rows of a batch
have the same length.

    KVCache        graphs that concatenate (optimum's attention): a call reads `past` and writes
                   `present` = past + new positions into new tensors, which become the cache
    BufferKVCache  graphs with fused attention ("attention": "gqa", export/fuse_attention.py): the
                   cache lives in preallocated buffers # [rows, kv_heads, capacity, head_dim] that
                   every call reads and updates in place; rolling back is a smaller `length`

Operations (both layouts): crop(n) keeps the first n positions (rejected tokens rolled back);
repeat_rows(k) copies a batch-1 cache to k candidate rows; keep_row(r) keeps the surviving row;
gather(keep, positions) keeps the first `keep` positions followed by `positions` (an accepted tree
path, moved to contiguous positions). `offset` counts leading ids the cache never saw (a draft's
context window); positions start after them.
"""

from __future__ import annotations

import numpy as np


class KVCache:
    """A cache that each call replaces with its `present` outputs (past + new positions)."""

    def __init__(self, device, num_layers: int, num_kv_heads: int, head_dim: int, dtype=np.float32):
        self.device, self.dtype = device, np.dtype(dtype)
        self._geometry = (num_kv_heads, head_dim)
        self.values = [device.zeros((1, num_kv_heads, 0, head_dim), self.dtype) for _ in range(2 * num_layers)]
        self._pending = None
        self.offset = 0

    @property
    def length(self) -> int:
        """Number of cached positions (the `past` length fed to the next call)."""
        return self.device.shape(self.values[0])[2]

    @property
    def batch(self) -> int:
        return self.device.shape(self.values[0])[0]

    # -- a call --------------------------------------------------------------------------------
    def binding(self, session, past_names, present_names, new: int):
        """An I/O binding of `session` with the cache bound: past inputs are the cache, present outputs
        new tensors of past + new positions (so a new binding every call)."""
        binding = session.io_binding()
        self.bind(binding, past_names, present_names, new)
        return binding

    def bind(self, binding, past_names, present_names, new: int) -> None:
        """Past inputs are the cache; present outputs go to new tensors of past + new positions."""
        heads, dim = self._geometry
        shape = (self.batch, heads, self.length + new, dim)
        self._pending = [self.device.empty(shape, self.dtype) for _ in self.values]
        for name, tensor in zip(past_names, self.values):
            self.device.bind(binding, name, tensor)
        for name, tensor in zip(present_names, self._pending):
            self.device.bind(binding, name, tensor, output=True)

    def commit(self, new: int) -> None:
        self.values, self._pending = self._pending, None

    # -- speculation's operations ----------------------------------------------------------------
    def crop(self, length: int) -> None:
        """Keep the first `length` positions of every row (rollback of rejected tokens)."""
        if length == self.length:
            return
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.values = self.device.take(self.values, np.arange(length, dtype=np.int64), axis=2)

    def repeat_rows(self, num_rows: int) -> None:
        """Replicate a batch-1 cache to `num_rows` identical rows (one per candidate)."""
        if self.batch != 1:
            raise ValueError(f"repeat_rows needs a batch-1 cache, this one has {self.batch} rows")
        if num_rows > 1:
            self.values = self.device.take(self.values, np.zeros(num_rows, dtype=np.int64), axis=0)

    def keep_row(self, row: int) -> None:
        """Keep one row (the surviving candidate) as a batch-1 cache."""
        if self.batch == 1 and row == 0:
            return
        self.values = self.device.take(self.values, np.asarray([row], dtype=np.int64), axis=0)

    def gather(self, keep: int, positions: np.ndarray) -> None:
        """Keep the first `keep` positions followed by `positions` (ascending), made contiguous.

        After a tree call the cache holds past + every tree node; this keeps the past and the
        accepted path's nodes, in path order, so the cache reads as if the path had been decoded."""
        positions = np.asarray(positions, dtype=np.int64)
        if np.array_equal(positions, np.arange(keep, keep + len(positions))):
            self.crop(keep + len(positions))        # the path is already contiguous: a crop
            return
        index = np.concatenate([np.arange(keep, dtype=np.int64), positions])
        self.values = self.device.take(self.values, index, axis=2)

    def host_layers(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(key, value) per layer as host arrays of the valid positions: for tests and inspection only
        (a copy from the device)."""
        arrays = [self.device.to_host(v) for v in self.values]
        return [(arrays[2 * i], arrays[2 * i + 1]) for i in range(len(arrays) // 2)]


class BufferKVCache:
    """A cache in preallocated buffers that the fused attention kernel updates in place.

    Every call reads the past from, and writes its new positions into, the same buffers
    # [rows, kv_heads, capacity, head_dim] (bound as both past input and present output), so
    nothing is concatenated, copied out or reallocated per call. Rolling back rejected tokens is
    just a smaller `length` (the kernel reads positions below the valid length only); a tree path
    is moved to contiguous positions on the device."""

    GROW = 256

    def __init__(self, device, num_layers: int, num_kv_heads: int, head_dim: int, dtype=np.float32,
                 capacity: int = 512, max_capacity: int | None = None):
        self.device, self.dtype = device, np.dtype(dtype)
        self._geometry = (num_layers, num_kv_heads, head_dim)
        # the model's context: buffers never grow past it for calls within it (a kernel with its rotary
        # tables inside reads positions up to the buffer's length, export/fuse_rotary.py)
        self.max_capacity = max_capacity
        self._values = self._allocate(1, capacity if max_capacity is None else min(capacity, max_capacity))
        self._binding = None          # (session, I/O binding) with these buffers bound; kept between calls
        self.length = 0
        self.offset = 0

    @property
    def values(self) -> list:
        return self._values

    @values.setter
    def values(self, tensors: list) -> None:
        self._values, self._binding = tensors, None      # new buffers: bind them again

    def _allocate(self, rows: int, capacity: int) -> list:
        layers, heads, dim = self._geometry
        return [self.device.zeros((rows, heads, capacity, dim), self.dtype) for _ in range(2 * layers)]

    @property
    def batch(self) -> int:
        return self.device.shape(self.values[0])[0]

    @property
    def capacity(self) -> int:
        return self.device.shape(self.values[0])[2]

    def reserve(self, total: int) -> None:
        """Make room for `total` positions (grows geometrically, copying the valid ones once)."""
        if total <= self.capacity:
            return
        capacity = -(-max(total, 2 * self.capacity) // self.GROW) * self.GROW
        if self.max_capacity is not None and total <= self.max_capacity:
            capacity = min(capacity, self.max_capacity)
        # positions past the old capacity repeat its last one: never read before a call writes them
        index = np.minimum(np.arange(capacity, dtype=np.int64), self.capacity - 1)
        self.values = self.device.take(self.values, index, axis=2)

    # -- a call --------------------------------------------------------------------------------
    def binding(self, session, past_names, present_names, new: int):
        """A binding of `session` with the buffers bound as both past inputs and present outputs (the
        kernel writes the new positions at length .. length + new - 1 in place). The buffers stay
        bound between calls: only a call's own inputs and outputs are bound again."""
        self.reserve(self.length + new)
        if self._binding is None or self._binding[0] is not session:
            binding = session.io_binding()
            for names, output in ((past_names, False), (present_names, True)):
                for name, tensor in zip(names, self._values):
                    self.device.bind(binding, name, tensor, output)
            self._binding = (session, binding)
        return self._binding[1]

    def commit(self, new: int) -> None:
        self.length += new

    # -- speculation's operations ----------------------------------------------------------------
    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = length

    def repeat_rows(self, num_rows: int) -> None:
        if self.batch != 1:
            raise ValueError(f"repeat_rows needs a batch-1 cache, this one has {self.batch} rows")
        if num_rows > 1:
            self.values = self.device.take(self.values, np.zeros(num_rows, dtype=np.int64), axis=0)

    def keep_row(self, row: int) -> None:
        if self.batch == 1 and row == 0:
            return
        self.values = self.device.take(self.values, np.asarray([row], dtype=np.int64), axis=0)

    def gather(self, keep: int, positions: np.ndarray) -> None:
        positions = np.asarray(positions, dtype=np.int64)
        m = len(positions)
        dst = np.arange(keep, keep + m, dtype=np.int64)
        if not np.array_equal(positions, dst):
            moved = self.device.move(self._values, dst, positions)
            if moved is not self._values:                  # in place on the host; new tensors on a device
                self.values = moved
        self.length = keep + m

    def host_layers(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(key, value) per layer as host arrays of the valid positions (tests and inspection only)."""
        arrays = [self.device.to_host(v)[:, :, :self.length] for v in self.values]
        return [(arrays[2 * i], arrays[2 * i + 1]) for i in range(len(arrays) // 2)]
