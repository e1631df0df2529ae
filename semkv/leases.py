"""Donor leases and generations.

Protocol (who calls what, when):
- The store calls ``publish(donor_id)`` when a donor's KV is (re)written; this bumps the
  donor's generation, so every lease taken on the old content becomes stale.
- Admission calls ``acquire(donor_id)`` before reporting any token of that donor to the engine.
- The loader calls ``validate(lease)`` right before it copies; a stale lease is a miss before
  allocation and an invalid-block report after it.
- The owner of the request calls ``release(lease_id)`` on finish, abort, preemption, reset,
  stale donor and failed load. ``release`` is idempotent.
- The store calls ``try_retire(donor_id)`` to evict; it refuses while any lease is live.

NOTE: all methods are thread-safe. ``live_count()`` must be zero after every finished
scenario; a non-zero count is a leak and tests assert on it.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter

from pydantic import BaseModel, ConfigDict


class Lease(BaseModel):
    model_config = ConfigDict(frozen=True)

    lease_id: str
    donor_id: str
    generation: int


class UnknownDonorError(KeyError):
    """Raised when a lease is asked for a donor that was never published or was retired."""


class LeaseTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generations: dict[str, int] = {}
        self._leases: dict[str, Lease] = {}
        self._holders: Counter[str] = Counter()
        self._ids = itertools.count(1)

    def publish(self, donor_id: str) -> int:
        """Record new content for ``donor_id``; returns its new generation."""
        with self._lock:
            generation = self._generations.get(donor_id, 0) + 1
            self._generations[donor_id] = generation
            return generation

    def generation(self, donor_id: str) -> int | None:
        with self._lock:
            return self._generations.get(donor_id)

    def acquire(self, donor_id: str, generation: int | None = None) -> Lease:
        """Lease the donor's current generation (or fail if ``generation`` is not current)."""
        with self._lock:
            current = self._generations.get(donor_id)
            if current is None:
                raise UnknownDonorError(donor_id)
            if generation is not None and generation != current:
                raise UnknownDonorError(f"{donor_id} generation {generation} is stale")
            lease = Lease(lease_id=f"L{next(self._ids)}", donor_id=donor_id, generation=current)
            self._leases[lease.lease_id] = lease
            self._holders[donor_id] += 1
            return lease

    def validate(self, lease: Lease | str) -> bool:
        """True while the lease is live and its donor still has the leased generation."""
        with self._lock:
            lease_id = lease if isinstance(lease, str) else lease.lease_id
            held = self._leases.get(lease_id)
            return held is not None and self._generations.get(held.donor_id) == held.generation

    def release(self, lease_id: str) -> bool:
        """Drop a lease; returns False if it was not live (already released)."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            self._holders[lease.donor_id] -= 1
            if self._holders[lease.donor_id] <= 0:
                del self._holders[lease.donor_id]
            return True

    def is_leased(self, donor_id: str) -> bool:
        with self._lock:
            return self._holders.get(donor_id, 0) > 0

    def try_retire(self, donor_id: str) -> bool:
        """Forget a donor so it can be evicted; refused (False) while it is leased."""
        with self._lock:
            if self._holders.get(donor_id, 0) > 0:
                return False
            self._generations.pop(donor_id, None)
            return True

    def release_all(self) -> int:
        """Drop every lease (engine reset / shutdown); returns how many were live."""
        with self._lock:
            count = len(self._leases)
            self._leases.clear()
            self._holders.clear()
            return count

    def live_count(self) -> int:
        with self._lock:
            return len(self._leases)
