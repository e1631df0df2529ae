"""A bounded cache of donor anchor indexes (issue #25: span planning under 5 ms p99).

The scheduler plans every request against up to 16 candidate donors, and building each donor's
k-gram -> first-position index (``semkv.span_map``) was most of the planning time, though a
donor's tokens rarely change between requests. Entries are keyed by the donor's exact token
bytes (plus k), so a stale entry can never be used: a donor whose tokens changed (or an evicted
donor id reused for other tokens) simply misses. The cache is an LRU bounded by an estimate of
its bytes, so memory stays capped without any hook into the donor registry.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

AnchorIndex = dict[int, int]  # k-gram key (its hash, semkv.span_map.gram_keys) -> position

DEFAULT_MAX_BYTES = 128 * 1024 * 1024
_BYTES_PER_ENTRY = 160  # measured 152: 0.62 MB per 4K-token donor (int keys; tracemalloc)


def token_key(tokens: Sequence[int]) -> bytes:
    """The exact tokens as bytes: equal keys mean equal token sequences."""
    if isinstance(tokens, array) and tokens.typecode == "q":
        return tokens.tobytes()
    return array("q", tokens).tobytes()


class AnchorCache:
    """LRU of anchor indexes keyed by (k, exact donor token bytes), bounded by bytes.

    The returned index is shared: callers must only read it.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, bytes], tuple[AnchorIndex, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def get(self, tokens: Sequence[int], k: int,
            build: Callable[[Sequence[int], int], AnchorIndex]) -> AnchorIndex:
        """The index of ``tokens`` for ``k``, built with ``build`` on a miss."""
        key = (k, token_key(tokens))
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return found[0]
        index = build(tokens, k)
        size = len(key[1]) + _BYTES_PER_ENTRY * len(index)
        with self._lock:
            self.misses += 1
            if size > self.max_bytes:
                return index  # too large to keep
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (index, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped
        return index


ANCHOR_CACHE = AnchorCache()
