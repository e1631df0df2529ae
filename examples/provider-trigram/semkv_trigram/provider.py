"""A deliberately small provider: an inverted index of token trigrams.

A donor is proposed when it contains at least ``min_shared`` of the request's distinct
trigrams (three consecutive token ids); candidates are ranked by that fraction. The provider
does not say *where* the shared tokens lie (``num_tokens=0``): semkv's verifier finds the exact
prefix and the longest identical run itself, and admission decides. So a provider only has to
be good at *finding* donors; it cannot make semkv serve wrong KV.

Everything the contract asks of a provider is here: namespace isolation (the namespace is part
of every index key), thread safety (one lock), eviction, reset and re-registration.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from semkv.provider import DonorProvider, DonorRecord, LookupQuery, ProviderContext
from semkv.types import Candidate

Trigram = tuple[int, int, int]
_Key = tuple[str, Trigram]  # (namespace, trigram)


class TrigramConfig(BaseModel):
    """``provider_config`` of the ``trigram`` provider (unknown keys are refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_shared: float = Field(
        default=0.2, gt=0.0, le=1.0,
        description="Least fraction of the request's distinct trigrams a donor must contain.")
    max_postings: int = Field(
        default=256, ge=1, description="Donors remembered per trigram (newest kept).")


def trigrams(token_ids: Sequence[int]) -> set[Trigram]:
    """The distinct trigrams of a token sequence (empty below three tokens)."""
    return {(token_ids[i], token_ids[i + 1], token_ids[i + 2]) for i in range(len(token_ids) - 2)}


class TrigramProvider(DonorProvider):
    name = "trigram"
    Config = TrigramConfig
    config: TrigramConfig

    def __init__(self, config: BaseModel, context: ProviderContext) -> None:
        super().__init__(config, context)
        self._lock = threading.Lock()
        self._donors: dict[str, list[_Key]] = {}  # donor id -> its index keys
        # index key -> donor ids, insertion-ordered so the oldest posting is dropped first
        self._postings: dict[_Key, dict[str, None]] = defaultdict(dict)

    def register_donor(self, donor: DonorRecord) -> None:
        keys = [(donor.namespace, t) for t in trigrams(donor.token_ids)]
        with self._lock:
            self._forget(donor.donor_id)
            self._donors[donor.donor_id] = keys
            for key in keys:
                postings = self._postings[key]
                postings[donor.donor_id] = None
                if len(postings) > self.config.max_postings:
                    del postings[next(iter(postings))]

    def lookup(self, query: LookupQuery) -> list[Candidate]:
        wanted = trigrams(query.token_ids)
        if not wanted:
            return []
        shared: dict[str, int] = defaultdict(int)
        with self._lock:
            for trigram in wanted:
                for donor_id in self._postings.get((query.namespace, trigram), ()):
                    shared[donor_id] += 1
        scored = [(count / len(wanted), donor_id) for donor_id, count in shared.items()]
        scored = [(s, d) for s, d in scored if s >= self.config.min_shared]
        scored.sort(key=lambda sd: (-sd[0], sd[1]))  # best first; ties by id (deterministic)
        return [
            Candidate(donor_id=donor_id, namespace=query.namespace, similarity=score,
                      signals={"shared_trigrams": float(shared[donor_id])})
            for score, donor_id in scored[: query.max_candidates]
        ]

    def evict(self, donor_id: str) -> None:
        with self._lock:
            self._forget(donor_id)

    def reset(self) -> None:
        with self._lock:
            self._donors.clear()
            self._postings.clear()

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"donors": float(len(self._donors)), "trigrams": float(len(self._postings))}

    def _forget(self, donor_id: str) -> None:
        """Drop a donor's postings. The caller holds the lock."""
        for key in self._donors.pop(donor_id, ()):
            postings = self._postings.get(key)
            if postings is not None:
                postings.pop(donor_id, None)
                if not postings:
                    del self._postings[key]
