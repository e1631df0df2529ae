"""Scheduler-side index of the donor store: which block content lives in which host slot.

The donor store is a fixed array of host "slots", each holding one engine block (every layer).
The scheduler owns all decisions: it reserves a slot for each block to save, pins slots that a
planned load will read, and evicts least-recently-used unpinned slots when full. Workers only
execute the copies they are told to do, so the scheduler always knows what is stored without
asking.

Content addressing: a block's key is a chained hash of the namespace and every token up to the
end of that block (``semkv.prefix_index.block_keys``), so identical prefixes are stored once,
whoever computed them, and the exact prefix index finds them by the same keys.

NOTE: a slot's generation increases every time it is (re)assigned. Loads carry the generation
they expect; a worker whose slot holds another generation reports the block as invalid.
NOTE: a pinned slot is never evicted; pins are released with the lease that took them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from semkv.prefix_index import block_keys

__all__ = ["StoreIndex", "block_keys"]  # block_keys: the keys are semkv.prefix_index's


class StoreIndex:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError("the donor store must hold at least one block")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # LRU order, oldest first
        self._key_of: dict[int, bytes] = {}
        self._generation = [0] * num_slots
        self._pins = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self.evicted_keys: list[bytes] = []  # drained by the owner to update donors

    def __len__(self) -> int:
        return len(self._slot_of)

    def get(self, key: bytes) -> tuple[int, int] | None:
        """(slot, generation) of a stored key, without touching LRU order."""
        slot = self._slot_of.get(key)
        return None if slot is None else (slot, self._generation[slot])

    def touch(self, key: bytes) -> None:
        if key in self._slot_of:
            self._slot_of.move_to_end(key)

    def stored_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are stored."""
        n = 0
        for key in keys:
            if key not in self._slot_of:
                break
            n += 1
        return n

    def reserve(self, key: bytes) -> tuple[int, int] | None:
        """A slot for new content ``key`` (evicting LRU if needed); None when all are pinned."""
        if key in self._slot_of:
            self.touch(key)
            return None
        slot = self._free.pop() if self._free else self._evict_one()
        if slot is None:
            return None
        self._generation[slot] += 1
        self._slot_of[key] = slot
        self._key_of[slot] = key
        return slot, self._generation[slot]

    def _evict_one(self) -> int | None:
        for key, slot in self._slot_of.items():
            if self._pins[slot] == 0:
                del self._slot_of[key]
                del self._key_of[slot]
                self.evicted_keys.append(key)
                return slot
        return None

    def drop(self, key: bytes) -> None:
        """Forget ``key`` (e.g. its save was abandoned); its slot becomes free."""
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            del self._key_of[slot]
            self._free.append(slot)
            self.evicted_keys.append(key)

    def pin(self, slots: Iterable[int]) -> None:
        for slot in slots:
            self._pins[slot] += 1

    def unpin(self, slots: Iterable[int]) -> None:
        for slot in slots:
            if self._pins[slot] <= 0:
                raise RuntimeError(f"slot {slot} unpinned more often than pinned")
            self._pins[slot] -= 1

    def pinned_slots(self) -> int:
        return sum(1 for p in self._pins if p)

    def clear(self) -> None:
        """Forget all content (engine reset). Pins must be released first."""
        self.evicted_keys.extend(self._slot_of)
        self._slot_of.clear()
        self._key_of.clear()
        self._free = [s for s in range(self.num_slots - 1, -1, -1)]
