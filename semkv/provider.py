"""The donor-discovery provider protocol.

Protocol (who calls what, when):
- The host builds one provider per engine (scheduler side) with
  ``ProviderClass(config, context)``; ``config`` is the operator's ``provider_config``
  validated by the provider's own ``Config`` model.
- ``register_donor`` is called once a donor's KV is stored (its tokens are final), possibly
  from a background thread. Re-registering a donor id replaces the old entry.
- ``lookup`` is called for a new request, possibly from a worker thread under a latency
  budget; it returns ranked candidates, best first, at most ``query.max_candidates``.
- ``evict`` is called when the host drops a donor (its KV evicted from the donor store, or
  past ``index_memory_bytes`` / ``max_donors``); ``reset`` when the engine resets its prefix
  cache; ``close`` once at shutdown.
- ``donor_memory_bytes`` and ``cache_memory_bytes`` (optional) tell the host what the
  provider's index costs, so that one setting bounds the host's discovery memory.

Shared discovery store (opt-in; see ``semkv.discovery_store`` and docs/deployment.md): a
provider whose index can live outside the engine process, so that several engines discover
each other's donors, does three things:
- its ``Config`` inherits ``semkv.discovery_store.SharedStoreConfig`` (the ``discovery_store``
  key, ``"memory"`` by default, and the TTL / LRU / timeout keys) and keeps its index in a
  ``RedisStore`` when ``config.shared``; the namespace is part of every key it writes;
- donor ids it stores are instance-qualified (``RedisStore.qualify``); ``lookup`` returns this
  engine's own donors under the ids the host registered and other engines' donors qualified
  (``instance/donor_id``), and ``donor_tokens`` returns a donor's token ids so that the host
  can verify a donor it never registered; ``evict`` and ``reset`` touch only its own donors;
- when the store is unreachable or slow it raises (``DiscoveryStoreUnavailable``) within the
  store timeouts instead of waiting: the host's ``GuardedProvider`` turns that into a
  ``provider_error`` fallback (normal prefill) and counts failed registrations, and the
  provider's ``stats()`` count store errors and timeouts;
- it trusts nothing it reads back (anyone with access to the store writes any bytes): members
  and records that are not what it writes are dropped and counted in ``stats()`` as
  ``malformed_records`` (the host exports them as ``lookup_errors{kind="malformed_records"}``),
  and ``donor_tokens`` raises ``MalformedRecord`` for such a record (the host drops the
  candidate); the host also drops a donor whose token ids fall outside the model's vocabulary.
``semkv_chunks`` and ``semkv_minhash`` are the reference implementations; the conformance kit
(``semkv.testing``) runs the same contract against a provider built with a shared-store
``provider_config`` (``semkv_provider_config``).

NOTE: a provider must never return a donor registered under another namespace, never return
an evicted donor, and never raise for well-formed input. Everything it returns is verified by
admission anyway: a provider proposes, semkv decides.
NOTE: providers must be thread-safe: register, lookup and evict may run concurrently.
NOTE: providers must not log token ids, text or embeddings.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from semkv.types import Candidate


class ProviderCapabilities(BaseModel):
    model_config = ConfigDict(frozen=True)

    needs_text: bool = False  # lookups and registrations want text (detokenized if absent)
    async_capable: bool = True  # safe to call from a worker thread under a timeout
    reports_spans: bool = False  # candidates carry exact token spans (else the verifier finds them)
    background_indexing: bool = False  # register_donor returns before the donor is searchable
    # The host budget one lookup needs (an encoder's forward on a CPU, say): the connector's
    # lookup_timeout_ms when the operator sets none and this is above its default.
    lookup_ms: float | None = Field(default=None, gt=0, le=60_000.0)


class ProviderContext(BaseModel):
    """What the host tells a provider about the engine it serves."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    block_size: int = Field(default=16, ge=1)
    # Turns token ids into text for providers that need text; None where no tokenizer is at hand.
    detokenize: Callable[[Sequence[int]], str] | None = None
    # The host's lookup budget: a lookup that answers later is counted as a timeout and the
    # request is served without it. None where the host sets no budget (a research script).
    lookup_timeout_ms: float | None = Field(default=None, gt=0)


class DonorRecord(BaseModel):
    model_config = ConfigDict(frozen=True)

    donor_id: str = Field(min_length=1)
    namespace: str = Field(min_length=1)
    token_ids: tuple[int, ...]
    text: str | None = None

    def __repr__(self) -> str:  # never print token ids or text
        return f"DonorRecord(donor_id={self.donor_id!r}, tokens={len(self.token_ids)})"

    __str__ = __repr__


class LookupQuery(BaseModel):
    model_config = ConfigDict(frozen=True)

    request_id: str
    namespace: str = Field(min_length=1)
    token_ids: tuple[int, ...]
    text: str | None = None
    local_prefix_tokens: int = Field(default=0, ge=0)
    max_candidates: int = Field(default=5, ge=1)

    def __repr__(self) -> str:
        return f"LookupQuery(request_id={self.request_id!r}, tokens={len(self.token_ids)})"

    __str__ = __repr__


class EmptyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DonorProvider(abc.ABC):
    """Base class of every provider. Subclasses set ``name`` and usually ``Config``."""

    name: ClassVar[str]
    capabilities: ClassVar[ProviderCapabilities] = ProviderCapabilities()
    Config: ClassVar[type[BaseModel]] = EmptyConfig

    def __init__(self, config: BaseModel, context: ProviderContext) -> None:
        self.config = config
        self.context = context

    @classmethod
    def from_config(
        cls, provider_config: dict[str, Any] | None, context: ProviderContext
    ) -> DonorProvider:
        """Validate ``provider_config`` with ``cls.Config`` and build the provider."""
        return cls(cls.Config.model_validate(provider_config or {}), context)

    @abc.abstractmethod
    def register_donor(self, donor: DonorRecord) -> None:
        """Make ``donor`` discoverable (now, or soon for background indexing)."""

    @abc.abstractmethod
    def lookup(self, query: LookupQuery) -> list[Candidate]:
        """Ranked candidates for ``query``, best first, same namespace only."""

    @abc.abstractmethod
    def evict(self, donor_id: str) -> None:
        """Forget ``donor_id``; a no-op for unknown ids."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget every donor."""

    def flush(self) -> None:  # noqa: B027 - optional hook
        """Block until background indexing has caught up (tests and benchmarks call it)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release threads and memory. Idempotent."""

    def stats(self) -> dict[str, float]:
        """Provider-specific counters (numbers only: never text or token ids)."""
        return {}

    def donor_memory_bytes(self, num_tokens: int) -> int | None:
        """Host memory one registered donor of ``num_tokens`` tokens costs this provider's
        index (an upper estimate); the host adds it to its own per-donor cost to hold
        ``index_memory_bytes``. None: not known (the host assumes ``UNKNOWN_BYTES_PER_TOKEN``
        per token and says so at start-up). A provider whose index lives elsewhere (a shared
        store) returns what it keeps in this process."""
        return None

    def cache_memory_bytes(self) -> int:
        """Host memory this provider's caches may hold whatever the donors (a vector cache at
        its bound); taken from ``index_memory_bytes`` before any donor."""
        return 0

    def donor_tokens(self, donor_id: str, namespace: str) -> tuple[int, ...] | None:
        """A discovered donor's token ids, when this provider holds donors the host did not
        register (a shared store); None otherwise (the host knows its own donors' tokens).
        Raises ``semkv.discovery_store.MalformedRecord`` for a stored record it did not write."""
        return None

    def donors_tokens(self, donor_ids: Sequence[str],
                      namespace: str) -> dict[str, tuple[int, ...] | None]:
        """``donor_tokens`` of several donors, what the host asks once per lookup (a shared
        store answers in one round trip): each id maps to its token ids, or None; an id whose
        record is malformed is left out (the host drops its candidate, counted). By default,
        ``donor_tokens`` one by one."""
        from semkv.discovery_store import MalformedRecord

        out: dict[str, tuple[int, ...] | None] = {}
        for donor_id in donor_ids:
            try:
                out[donor_id] = self.donor_tokens(donor_id, namespace)
            except MalformedRecord:
                continue
        return out

    def text_of(self, token_ids: Sequence[int], text: str | None) -> str:
        """The text of a donor or query: as carried, else detokenized through the context."""
        if text is not None:
            return text
        if self.context.detokenize is None:
            raise ValueError(f"provider {self.name!r} needs text but no detokenizer was given")
        return self.context.detokenize(token_ids)
