"""A bounded cache of donor anchor indexes (issue #25: span planning under 5 ms p99).

The scheduler plans every request against up to 16 candidate donors, and building each donor's
k-gram -> first-position index (``semkv.span_map``) was most of the planning time, though a
donor's tokens rarely change between requests. Entries are keyed by the donor's exact token
bytes (plus k and the donor's namespace), so a stale entry can never be used: a donor whose
tokens changed (or an evicted donor id reused for other tokens) simply misses.

NOTE: the namespace is part of the key although an index holds no secret: a hit is faster
than a build, so an index built for one tenant's donor (``cache_salt``) must not speed up
planning against another tenant's donor of the same tokens (a timing signal of what the
first tenant sent). The cache is an LRU bounded by its bytes (each
entry's key and index arrays, and the token bytes it keeps for recently seen donor objects),
so memory stays capped without any hook into the donor registry; the engine sizes it from
``index_memory_bytes`` (``semkv.index_memory``).
"""

from __future__ import annotations

import threading
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

DEFAULT_MAX_BYTES = 128 * 1024 * 1024
_RECENT_DONORS = 1024  # token objects whose key bytes are reused (their hash computed once)
Tokens = Sequence[int] | npt.NDArray[np.int64]


_SKETCH_BITS = 1 << 16  # 8 KB: ~6 % false positives for a 4K-token donor's keys


class SketchSlots(NamedTuple):
    """Where each key's bit sits in any index's sketch: its byte and the bit's mask. A target's
    keys are read against up to 16 donors' sketches, so their slots are computed once."""

    byte: npt.NDArray[np.int64]
    mask: npt.NDArray[np.uint8]

    @classmethod
    def of(cls, keys: npt.NDArray[np.int64]) -> SketchSlots:
        low = keys & (_SKETCH_BITS - 1)
        return cls(low >> 3, (1 << (low & 7)).astype(np.uint8))


class AnchorIndex:
    """A donor's distinct k-gram keys (``semkv.span_map.gram_keys``), sorted, each with the donor
    position where it first occurs: 16 bytes per distinct k-gram (64 KB per 4K-token donor),
    plus a one-bit-per-slot sketch of the keys' low 16 bits (8 KB). Built once per donor and
    only read afterwards.

    NOTE: most candidates of a request share only its template with it (a few dozen k-grams):
    the sketch answers "certainly not here" for ~94 % of a target's other keys, so only the
    rest are searched (``find``)."""

    __slots__ = ("keys", "first", "sketch")

    def __init__(self, keys: npt.NDArray[np.int64], first: npt.NDArray[np.int64]) -> None:
        """``keys`` sorted and distinct, ``first[i]`` the first donor position of ``keys[i]``."""
        self.keys, self.first = keys, first
        self.sketch = np.zeros(_SKETCH_BITS // 8, np.uint8)
        np.bitwise_or.at(self.sketch, *SketchSlots.of(keys))

    def may_hold(self, grams: npt.NDArray[np.int64],
                 slots: SketchSlots | None = None) -> npt.NDArray[np.bool_]:
        """Per key: False where the index certainly lacks it (the sketch's bit is clear).
        ``slots``: ``SketchSlots.of(grams)``, when the caller holds them."""
        byte, mask = slots if slots is not None else SketchSlots.of(grams)
        bits: npt.NDArray[np.bool_] = (self.sketch[byte] & mask) != 0
        return bits

    def __len__(self) -> int:
        return len(self.keys)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, AnchorIndex) and np.array_equal(self.keys, other.keys)
                and np.array_equal(self.first, other.first))

    __hash__ = None  # type: ignore[assignment]  # arrays inside: not hashable

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.first.nbytes + self.sketch.nbytes)

    def lookup(self, grams: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Per key of ``grams`` (any order): the first donor position of that key, or -1."""
        if not len(self.keys) or not len(grams):
            return np.full(len(grams), -1, np.int64)
        at = np.searchsorted(self.keys, grams)
        np.minimum(at, len(self.keys) - 1, out=at)
        return np.where(self.keys[at] == grams, self.first[at], -1)

    def find(self, grams: npt.NDArray[np.int64],
             slots: SketchSlots | None = None) -> npt.NDArray[np.int64]:
        """``lookup(grams)``, searching only the keys the sketch may hold (``slots``: as for
        ``may_hold``)."""
        at = np.flatnonzero(self.may_hold(grams, slots))
        found = np.full(len(grams), -1, np.int64)
        found[at] = self.lookup(grams[at])
        return found

    @classmethod
    def empty(cls) -> AnchorIndex:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64))

    def __repr__(self) -> str:
        return f"AnchorIndex({len(self)} keys)"


def token_key(tokens: Tokens) -> bytes:
    """The exact tokens as bytes: equal keys mean equal token sequences."""
    if isinstance(tokens, np.ndarray):
        return tokens.astype(np.int64, copy=False).tobytes()
    if isinstance(tokens, array) and tokens.typecode == "q":
        return tokens.tobytes()
    return array("q", tokens).tobytes()


class AnchorCache:
    """LRU of anchor indexes keyed by (namespace, k, exact donor token bytes), bounded by
    bytes.

    The returned index is shared: callers must only read it.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, int, bytes], tuple[AnchorIndex, int]] = (
            OrderedDict())
        self._recent: OrderedDict[int, tuple[weakref.ref[Tokens], bytes]] = OrderedDict()
        self._bytes = 0  # entries'
        self._recent_bytes = 0  # the token bytes kept in _recent
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes + self._recent_bytes

    def resize(self, max_bytes: int) -> None:
        """A new bound (the engine's share of ``index_memory_bytes``), enforced at once."""
        with self._lock:
            self.max_bytes = max_bytes
            self._shrink()

    def _shrink(self) -> None:
        """Oldest first, the recent donors' bytes before the entries (called locked)."""
        while self._recent and self._bytes + self._recent_bytes > self.max_bytes:
            _, (_, raw) = self._recent.popitem(last=False)
            self._recent_bytes -= len(raw)
        while self._entries and self._bytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self._bytes -= dropped

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._recent.clear()
            self._bytes = self._recent_bytes = 0

    def _stable_bytes(self, tokens: Tokens) -> bytes:
        """``token_key(tokens)``; for a donor object seen recently with the same tokens, the
        bytes object made then, whose hash Python has cached: hashing a 4K donor's 32 KB on
        each of 16 look-ups per request was a tenth of planning (issue #25).

        NOTE: the tokens are compared each time, so a mutated array never reuses stale bytes;
        objects are held weakly (a list, which cannot be, is simply not remembered)."""
        raw = token_key(tokens)
        with self._lock:
            seen = self._recent.get(id(tokens))
            if seen is not None and seen[0]() is tokens and seen[1] == raw:
                self._recent.move_to_end(id(tokens))
                return seen[1]
            try:
                ref = weakref.ref(tokens)
            except TypeError:
                return raw
            old = self._recent.pop(id(tokens), None)
            if old is not None:
                self._recent_bytes -= len(old[1])
            self._recent[id(tokens)] = (ref, raw)
            self._recent_bytes += len(raw)
            if len(self._recent) > _RECENT_DONORS:
                self._recent_bytes -= len(self._recent.popitem(last=False)[1][1])
            self._shrink()
        return raw

    def get(self, tokens: Tokens, k: int, build: Callable[[Tokens, int], AnchorIndex],
            namespace: str = "") -> AnchorIndex:
        """The index of ``tokens`` for ``k``, built with ``build`` on a miss; ``namespace``:
        the donor's (an index built for one namespace never serves another)."""
        key = (namespace, k, self._stable_bytes(tokens))
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return found[0]
        index = build(tokens, k)
        size = len(key[2]) + index.nbytes
        with self._lock:
            self.misses += 1
            if size > self.max_bytes:
                return index  # too large to keep
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (index, size)
            self._bytes += size
            self._shrink()
        return index


ANCHOR_CACHE = AnchorCache()
