"""KV caches of recent generations, reused for the longest common token prefix of the next prompt.

The second turn of a conversation repeats the first turn and its answer: with the target's cache
(and the draft's) kept, only the new tokens are prefilled. An entry holds the tokens the target
cache holds (every committed token but the last), the cache itself, and the draft model's cache
with the number of tokens it has read. Entries are taken out while a generation uses them and put
back when it ends, so two generations never share one. Bounded: at most `max_entries`, and at most
`max_bytes` of cache tensors in all, the least recently used going first.

Reuse never changes what is generated: the cached keys and values are the target's own for those
tokens, so greedy output is the same token for token and sampled output has the same law (up to
float rounding of keys computed in another call shape, as in every verification call).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

DEFAULT_ENTRIES = 4
DEFAULT_BYTES = 1 << 30      # 1 GiB of cache tensors: ~18k tokens of the 1.5B float32 target's cache


@dataclass
class CachedPrefix:
    tokens: tuple[int, ...]        # what the target cache holds, position by position
    target: object                 # its KVCache / BufferKVCache
    draft: object = None           # the draft model's cache, or None
    draft_seen: int = 0            # committed tokens the draft cache has read (from its offset)
    nbytes: int = field(default=0)


def cache_bytes(cache) -> int:
    if cache is None:
        return 0
    device = cache.device
    return int(sum(np.prod(device.shape(v)) * cache.dtype.itemsize for v in cache.values))


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.asarray(a[:n], dtype=np.int64), np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


class PrefixCache:
    """A small LRU of cached prefixes, keyed by their tokens."""

    def __init__(self, max_entries: int = DEFAULT_ENTRIES, max_bytes: int = DEFAULT_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[int, CachedPrefix] = OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def take(self, prompt_ids) -> tuple[CachedPrefix | None, int]:
        """The entry sharing the longest prefix with `prompt_ids` (removed while in use) and how many
        of its tokens are reusable: at most len(prompt_ids) - 1, since the prompt's last token must
        be fed to score the first new one. (None, 0) when no entry shares a token."""
        best, best_len = None, 0
        for key, entry in self._entries.items():
            n = min(common_prefix(entry.tokens, prompt_ids), len(prompt_ids) - 1)
            if n > best_len:
                best, best_len = key, n
        if best is None:
            return None, 0
        return self._entries.pop(best), best_len

    def put(self, entry: CachedPrefix) -> None:
        """Keep `entry` as the most recent; evict the least recent beyond the bounds."""
        entry.nbytes = cache_bytes(entry.target) + cache_bytes(entry.draft)
        if entry.nbytes > self.max_bytes or self.max_entries < 1 or not entry.tokens:
            return
        self._entries[self._next] = entry
        self._next += 1
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
