"""Chunk-aligned discovery: hashes of fixed, block-aligned token chunks.

Two indexes per namespace:
- a *prefix* index of chained chunk hashes (hash of the chunk and of every chunk before it,
  like vLLM's own block hashes): a hit at chunk ``k`` means the donor's first ``k`` chunks are
  token-identical to the target's, the only span whose KV is exact;
- a *span* index of position-free chunk hashes: runs of consecutive chunks that a donor shares
  with the target at any (aligned) offsets, e.g. a document moved behind another instruction.

Every candidate names its span exactly (``reports_spans``); similarity is the fraction of the
target's tokens that the span covers. Hash collisions are harmless: admission verifies tokens.

Store: in this process by default; ``discovery_store: redis://host:port/db`` keeps both indexes
and the donors' token ids in Redis, shared by every engine naming the same server (see
``semkv_chunks.shared`` and ``semkv.discovery_store``: TTL, LRU bound, failure handling).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from semkv.discovery_store import SharedStoreConfig
from semkv.provider import DonorProvider, DonorRecord, LookupQuery, ProviderCapabilities
from semkv.shared_or_local import SharedOrLocal
from semkv.types import Candidate
from semkv_chunks.runs import best_runs, candidates

if TYPE_CHECKING:
    from semkv_chunks.shared import SharedChunks

_Key = tuple[str, int]  # (namespace, hash)


class ChunksConfig(SharedStoreConfig):
    chunk_tokens: int | None = Field(
        default=None, ge=1, description="Chunk length; defaults to the engine's block size."
    )
    max_postings_per_chunk: int = Field(
        default=64, ge=1, description="Donors remembered per chunk hash (newest kept)."
    )


@dataclass
class _Donor:
    namespace: str
    length: int
    span_keys: list[_Key] = field(default_factory=list)
    prefix_keys: list[_Key] = field(default_factory=list)


class ChunksProvider(SharedOrLocal, DonorProvider):
    name = "chunks"
    capabilities = ProviderCapabilities(reports_spans=True)
    Config = ChunksConfig
    config: ChunksConfig

    def __init__(self, config: BaseModel, context) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, context)
        self.chunk = self.config.chunk_tokens or context.block_size
        self._lock = threading.RLock()
        self._donors: dict[str, _Donor] = {}
        # hash key -> {donor_id: chunk index}, insertion-ordered so the oldest is dropped first
        self._spans: dict[_Key, dict[str, int]] = defaultdict(dict)
        self._prefixes: dict[_Key, dict[str, int]] = defaultdict(dict)
        self._shared: SharedChunks | None = None
        if self.config.shared:
            from semkv_chunks.shared import SharedChunks

            self._shared = SharedChunks(self.config, self.chunk,
                                        self.config.max_postings_per_chunk)

    def _chunks(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        c = self.chunk
        return [tuple(tokens[i : i + c]) for i in range(0, len(tokens) - c + 1, c)]

    @staticmethod
    def _chained(chunks: list[tuple[int, ...]]) -> list[int]:
        out, parent = [], 0
        for chunk in chunks:
            parent = hash((parent, chunk))
            out.append(parent)
        return out

    def _post(self, index: dict[_Key, dict[str, int]], key: _Key, donor_id: str, pos: int) -> None:
        postings = index[key]
        postings.pop(donor_id, None)
        postings[donor_id] = pos
        while len(postings) > self.config.max_postings_per_chunk:
            del postings[next(iter(postings))]

    def register_donor(self, donor: DonorRecord) -> None:
        if self._shared is not None:
            self._shared.register(donor)
            return
        chunks = self._chunks(donor.token_ids)
        ns = donor.namespace
        span_keys = [(ns, hash(c)) for c in chunks]
        prefix_keys = [(ns, h) for h in self._chained(chunks)]
        with self._lock:
            self._forget(donor.donor_id)
            self._donors[donor.donor_id] = _Donor(ns, len(donor.token_ids), span_keys, prefix_keys)
            for i, key in enumerate(span_keys):
                if donor.donor_id not in self._spans[key]:  # first occurrence within the donor
                    self._post(self._spans, key, donor.donor_id, i)
            for i, key in enumerate(prefix_keys):
                self._post(self._prefixes, key, donor.donor_id, i)

    def _forget(self, donor_id: str) -> None:
        old = self._donors.pop(donor_id, None)
        if old is None:
            return
        for index, keys in ((self._spans, old.span_keys), (self._prefixes, old.prefix_keys)):
            for key in keys:
                postings = index.get(key)
                if postings is not None:
                    postings.pop(donor_id, None)
                    if not postings:
                        del index[key]

    def _clear(self) -> None:
        self._donors.clear()
        self._spans.clear()
        self._prefixes.clear()

    def lookup(self, query: LookupQuery) -> list[Candidate]:
        if self._shared is not None:
            return self._shared.lookup(query)
        chunks = self._chunks(query.token_ids)
        if not chunks:
            return []
        ns = query.namespace
        with self._lock:
            prefix_hits = (self._prefixes.get((ns, h)) or {} for h in self._chained(chunks))
            spans = (self._spans.get((ns, hash(chunk))) or {} for chunk in chunks)
            best = best_runs(prefix_hits, spans, self.chunk)
            lengths = {d: self._donors[d].length for d in best}
        return candidates(best, lengths, ns, self.chunk, len(query.token_ids),
                          query.max_candidates)

    def donor_memory_bytes(self, num_tokens: int) -> int:
        """Per chunk a span and a prefix posting (key tuple, posting dict entry) and the
        donor's two key lists (measured: ~640 bytes a chunk; tests/test_index_memory.py)."""
        if self._shared is not None:
            return 0  # the postings live in the shared store
        return 512 + 768 * (num_tokens // self.chunk)

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()

    def stats(self) -> dict[str, float]:
        if self._shared is not None:
            return self._shared.donors.stats()
        with self._lock:
            return {
                "donors": float(len(self._donors)),
                "span_keys": float(len(self._spans)),
                "prefix_keys": float(len(self._prefixes)),
            }
