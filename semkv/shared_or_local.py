"""A discovery provider's donors in a shared store when it has one, else in its own index.

Mixed in before ``DonorProvider`` by the built-ins that can share an index in Redis (chunks,
MinHash): ``evict``, ``reset`` and the donors' token ids are written once here. The provider
sets ``_shared`` (an object whose ``donors`` is the ``SharedDonors`` of its store, or None) and
``_lock`` (its own index's lock), and supplies ``_forget(donor_id)`` and ``_clear()`` for its
own index; they are called under the lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import threading

    from semkv.discovery_store import SharedDonors


class _Shared(Protocol):
    @property
    def donors(self) -> SharedDonors: ...


class SharedOrLocal:
    _shared: _Shared | None
    _lock: threading.Lock | threading.RLock

    def _forget(self, donor_id: str) -> None:
        raise NotImplementedError

    def _clear(self) -> None:
        raise NotImplementedError

    def evict(self, donor_id: str) -> None:
        if self._shared is not None:
            self._shared.donors.evict(donor_id)
            return
        with self._lock:
            self._forget(donor_id)

    def reset(self) -> None:
        if self._shared is not None:
            self._shared.donors.reset()
            return
        with self._lock:
            self._clear()

    def donor_tokens(self, donor_id: str, namespace: str) -> tuple[int, ...] | None:
        return None if self._shared is None else self._shared.donors.tokens(donor_id, namespace)

    def donors_tokens(self, donor_ids: Sequence[str],
                      namespace: str) -> dict[str, tuple[int, ...] | None]:
        """Several donors' token ids in one round trip to the shared store."""
        if self._shared is None:
            return dict.fromkeys(donor_ids)
        return self._shared.donors.tokens_many(donor_ids, namespace)
