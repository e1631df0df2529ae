"""Donor discovery by a real semkv provider, for the study (the study "per provider", issue #7).

Protocol::

    with ProviderDiscovery("minhash", donors, block_size=32, detokenize=tokenizer.decode) as d:
        proposal = d.propose(target_id, target_ids)   # proposal.donor_id: best candidate or None

``ProviderDiscovery(name, donors, ...)`` resolves the provider by name
(``semkv.plugins.get_provider_class``), builds it with its default ``provider_config`` and
``ProviderContext(block_size, detokenize)``, registers every donor as a ``DonorRecord`` carrying
token ids only (as the vLLM adapter sends them; text-based providers detokenize through the
context) and flushes, so that background indexers have caught up before the first lookup.
``propose`` looks the target up (``max_candidates=5``) and takes the first candidate, the
provider's best, as it comes: no similarity threshold, because the study's plan reuses
identical runs only, whatever the provider's score. ``close()`` (or leaving the ``with``
block) closes the provider.

As in ``benchmarks/discovery_quality.py``: one namespace (``research``), default provider
settings, so the study's discovery matches that benchmark's. NOTE: a ``Proposal`` holds a donor
id and scores only; nothing here logs or keeps token ids or text (the provider holds them in
memory, as it would in an engine).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType

from semkv.plugins import get_provider_class
from semkv.provider import DonorRecord, LookupQuery, ProviderContext

NAMESPACE = "research"
DEFAULT_BLOCK_SIZE = 32  # the block size benchmarks/discovery_quality.py gives providers
MAX_CANDIDATES = 5


@dataclass(frozen=True)
class Proposal:
    """What a provider proposed for one target: its best donor (None: nothing) and scores."""

    donor_id: str | None
    similarity: float | None  # the best candidate's similarity, None without a candidate
    candidates: int


class ProviderDiscovery:
    """One provider, every donor registered; ``propose`` picks a target's donor."""

    def __init__(
        self, name: str, donors: Mapping[str, Sequence[int]], *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        detokenize: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        self.name = name
        self._donor_ids = frozenset(donors)
        context = ProviderContext(block_size=block_size, detokenize=detokenize)
        self._provider = get_provider_class(name).from_config({}, context)
        try:
            for donor_id, ids in donors.items():
                self._provider.register_donor(DonorRecord(
                    donor_id=donor_id, namespace=NAMESPACE, token_ids=tuple(ids)))
            self._provider.flush()
        except BaseException:
            self._provider.close()  # a half-built provider must not leak its threads
            raise

    def __repr__(self) -> str:  # name and sizes only
        return f"ProviderDiscovery({self.name!r}, donors={len(self._donor_ids)})"

    def propose(self, target_id: str, token_ids: Sequence[int]) -> Proposal:
        """The provider's best donor for this target (raises if it names an unknown donor)."""
        found = self._provider.lookup(LookupQuery(
            request_id=target_id, namespace=NAMESPACE, token_ids=tuple(token_ids),
            max_candidates=MAX_CANDIDATES))
        if not found:
            return Proposal(None, None, 0)
        best = found[0]
        if best.donor_id not in self._donor_ids:  # the protocol forbids it: fail loudly
            raise ValueError(f"provider {self.name!r} proposed an unregistered donor")
        return Proposal(best.donor_id, float(best.similarity), len(found))

    def close(self) -> None:
        self._provider.close()

    def __enter__(self) -> ProviderDiscovery:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
