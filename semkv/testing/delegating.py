"""``DelegatingProvider``: wraps another provider and forwards every call to it.

Fault injectors, spies and other wrappers subclass it and override only the calls they change
(``faulty`` overrides ``lookup`` and ``stats``).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel

from semkv.provider import DonorProvider, DonorRecord, EmptyConfig, LookupQuery, ProviderContext
from semkv.types import Candidate


class DelegatingProvider(DonorProvider):
    name = "delegating"

    def __init__(self, inner: DonorProvider, config: BaseModel | None = None,
                 context: ProviderContext | None = None) -> None:
        super().__init__(config if config is not None else EmptyConfig(),
                         context if context is not None else inner.context)
        self.inner = inner
        self.capabilities = inner.capabilities  # type: ignore[misc]

    def lookup(self, query: LookupQuery) -> list[Candidate]:
        return self.inner.lookup(query)

    def register_donor(self, donor: DonorRecord) -> None:
        self.inner.register_donor(donor)

    def evict(self, donor_id: str) -> None:
        self.inner.evict(donor_id)

    def reset(self) -> None:
        self.inner.reset()

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    def donor_tokens(self, donor_id: str, namespace: str) -> tuple[int, ...] | None:
        return self.inner.donor_tokens(donor_id, namespace)

    def donors_tokens(self, donor_ids: Sequence[str],
                      namespace: str) -> dict[str, tuple[int, ...] | None]:
        return self.inner.donors_tokens(donor_ids, namespace)
