"""semkv provider ``semblend``: SemBlend's donor discovery behind the semkv provider protocol.

Protocol mapping (SemBlend 0.3.x, package ``semblend_core``; see README.md):
- ``register_donor`` -> ``DonorStore.add_donor(DonorNode(...))`` in the store of the donor's
  namespace, with an embedding from SemBlend's ``MiniLMEmbedder.embed`` (bundled model, read
  from disk) of the donor text truncated as SemBlend's pipeline truncates it.
- ``lookup`` -> ``DonorStore.find_donors`` (SemBlend's own matching: cosine top-k, token-Jaccard
  pre-filter, ``estimate_reuse_ratio``, ``compute_alignment``); with ``embedder="jaccard"`` or
  when no text is at hand, ``DonorStore.find_candidates_jaccard``. Each ``DonorMatch`` becomes a
  ``Candidate``: similarity = SemBlend's score, span = the longest token-identical contiguous
  run of its alignment, signals = reuse ratio and chunk counts.
- SemBlend skips donors whose tokens equal the query (it leaves those to the engine's prefix
  cache); semkv's contract wants them, so identical donors are found by a token hash here.
- ``evict`` -> per-donor removal (see ``_semblend.remove_donor``); ``reset`` -> drop the stores.

NOTE: one SemBlend store per namespace (and the namespace as SemBlend's ``extra_key`` too), so
no lookup can see another namespace's donors. One lock guards all stores: SemBlend's store is
not thread-safe. Embedding runs outside the lock. No text, token ids or embeddings are logged;
donors are stored without their text.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from semkv.provider import (
    DonorProvider,
    DonorRecord,
    LookupQuery,
    ProviderCapabilities,
    ProviderContext,
)
from semkv.types import Candidate

logger = logging.getLogger(__name__)
_Key = tuple[str, int, int]  # (namespace, length, hash of the token tuple)


class SemBlendConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    embedder: Literal["minilm", "jaccard"] = Field(
        default="minilm",
        description="minilm: SemBlend's MiniLM cosine search; jaccard: token-set search only.",
    )
    model_path: str | None = Field(
        default=None, description="sentence-transformers folder; default: the bundled MiniLM."
    )
    device: str = Field(default="cpu", description="Device of the embedding model.")
    min_similarity: float = Field(default=0.60, ge=-1.0, le=1.0, description="Cosine gate.")
    min_reuse_ratio: float = Field(default=0.50, ge=0.0, le=1.0)
    min_jaccard: float = Field(default=0.30, ge=0.0, le=1.0, description="Jaccard-mode gate.")
    chunk_tokens: int | None = Field(
        default=None, ge=1, description="SemBlend chunk size; defaults to the engine block size."
    )
    max_donors_per_namespace: int = Field(default=10_000, ge=1)
    embed_max_chars: int = Field(
        default=4000, ge=1, description="Text embedded per prompt (SemBlend's default cap)."
    )


class SemBlendProvider(DonorProvider):
    name = "semblend"
    capabilities = ProviderCapabilities(needs_text=True, reports_spans=True)
    Config = SemBlendConfig
    config: SemBlendConfig

    def __init__(self, config: BaseModel, context: ProviderContext) -> None:
        super().__init__(config, context)
        from semkv_semblend import _semblend

        self._sb = _semblend
        self._donor_store = _semblend.require_semblend()  # ImportError with the install hint
        self._embedder: Any = None
        if self.config.embedder == "minilm":
            self._embedder = _semblend.shared_embedder(self.config.model_path, self.config.device)
        self._dim = int(self._embedder.dimension) if self._embedder is not None else 384
        self.chunk = self.config.chunk_tokens or context.block_size
        self._lock = threading.RLock()
        self._stores: dict[str, Any] = {}  # namespace -> semblend DonorStore
        self._home: dict[str, _Key] = {}  # donor id -> where it lives
        self._identical: dict[_Key, dict[str, None]] = {}  # token hash -> donor ids (ordered)
        self._counts = {"lookups": 0, "semblend_matches": 0, "identical_hits": 0, "errors": 0}

    # -- helpers ---------------------------------------------------------------------------

    def _embed(self, token_ids: tuple[int, ...], text: str | None, namespace: str) -> Any:
        """SemBlend embedding of the (truncated) text, or None: then Jaccard search is used
        (cached per namespace: ``CachingEmbedder``)."""
        if self._embedder is None or not token_ids:
            return None
        try:
            full = self.text_of(token_ids, text)
        except ValueError:  # no text and no detokenizer: token-only search still works
            return None
        return self._embedder.embed(full[: self.config.embed_max_chars], namespace)

    def _forget(self, donor_id: str) -> None:
        key = self._home.pop(donor_id, None)
        if key is None:
            return
        ids = self._identical.get(key)
        if ids is not None:
            ids.pop(donor_id, None)
            if not ids:
                del self._identical[key]
        store = self._stores.get(key[0])
        if store is not None:
            self._sb.remove_donor(store, donor_id)

    # -- protocol --------------------------------------------------------------------------

    def register_donor(self, donor: DonorRecord) -> None:
        embedding = self._embed(donor.token_ids, donor.text, donor.namespace)
        key: _Key = (donor.namespace, len(donor.token_ids), hash(donor.token_ids))
        node = self._donor_store.DonorNode(
            request_id=donor.donor_id,
            token_ids=list(donor.token_ids),
            embedding=embedding,
            timestamp=time.monotonic(),
            prompt_text="",  # SemBlend keeps a preview for its paraphrase tier; not needed here
            extra_key=donor.namespace,
        )
        with self._lock:
            self._forget(donor.donor_id)  # SemBlend's add_donor would keep the old entry
            store = self._stores.get(donor.namespace)
            if store is None:
                store = self._sb.new_store(
                    self.config.max_donors_per_namespace, self._dim,
                    self.config.min_similarity, self.chunk,
                )
                self._stores[donor.namespace] = store
            store.add_donor(node)
            self._home[donor.donor_id] = key
            self._identical.setdefault(key, {})[donor.donor_id] = None

    def lookup(self, query: LookupQuery) -> list[Candidate]:
        if not query.token_ids:
            return []
        tokens = list(query.token_ids)
        embedding = self._embed(query.token_ids, query.text, query.namespace)
        key: _Key = (query.namespace, len(tokens), hash(query.token_ids))
        top_k = max(query.max_candidates, 5)
        with self._lock:
            self._counts["lookups"] += 1
            store = self._stores.get(query.namespace)
            if store is None:
                return []
            found = {d: self._identical_candidate(d, query) for d in self._identical.get(key, {})}
            self._counts["identical_hits"] += len(found)
            try:
                matches = self._search(store, embedding, tokens, top_k, query.namespace)
            except Exception as exc:  # noqa: BLE001 - a provider never fails a request
                self._counts["errors"] += 1
                logger.warning("semblend lookup failed: %s", type(exc).__name__)
                matches = []
            for match in matches:
                donor_id = match.donor.request_id
                home = self._home.get(donor_id)
                if donor_id in found or home is None or home[0] != query.namespace:
                    continue  # identical already reported; evicted or foreign: never returned
                found[donor_id] = self._candidate(match, tokens, query.namespace)
            self._counts["semblend_matches"] += len(matches)
        ranked = sorted(found.values(), key=lambda c: (-c.similarity, -c.num_tokens, c.donor_id))
        return ranked[: query.max_candidates]

    def _search(
        self, store: Any, embedding: Any, tokens: list[int], top_k: int, namespace: str
    ) -> list[Any]:
        if embedding is not None:
            return list(
                store.find_donors(
                    embedding, tokens, top_k=top_k,
                    min_reuse_ratio=self.config.min_reuse_ratio, extra_key=namespace,
                )
            )
        return list(
            store.find_candidates_jaccard(
                tokens, top_k=top_k, min_jaccard=self.config.min_jaccard,
                min_reuse_ratio=self.config.min_reuse_ratio, extra_key=namespace,
            )
        )

    def _identical_candidate(self, donor_id: str, query: LookupQuery) -> Candidate:
        n = len(query.token_ids)
        return Candidate(
            donor_id=donor_id, namespace=query.namespace, similarity=1.0, num_tokens=n,
            signals={"identical": 1.0},
        )

    def _candidate(self, match: Any, tokens: list[int], namespace: str) -> Candidate:
        alignment = match.alignment
        ts, ds, n = self._sb.exact_span(alignment.slot_actions, tokens, match.donor.token_ids)
        return Candidate(
            donor_id=match.donor.request_id,
            namespace=namespace,
            # SemBlend's score: cosine (MiniLM) or token Jaccard; clamp the cosine's range
            similarity=min(1.0, max(0.0, float(match.similarity))),
            target_start=ts,
            donor_start=ds,
            num_tokens=n,
            signals={
                "semblend_similarity": float(match.similarity),
                "semblend_reuse_ratio": float(alignment.reuse_ratio),
                "semblend_exact_chunks": float(getattr(alignment, "exact_chunks", 0)),
                "semblend_fuzzy_chunks": float(getattr(alignment, "fuzzy_chunks", 0)),
            },
        )

    def evict(self, donor_id: str) -> None:
        with self._lock:
            self._forget(donor_id)

    def reset(self) -> None:
        with self._lock:
            for store in self._stores.values():
                store.clear()
            self._stores.clear()
            self._home.clear()
            self._identical.clear()

    def donor_memory_bytes(self, num_tokens: int) -> int:
        """SemBlend keeps each donor's token ids as a Python list, its chunk index and its
        embedding (measured: ~35 KB and ~200-280 bytes a token, the most with few donors;
        tests/test_index_memory.py)."""
        return 48_000 + 4 * self._dim + 288 * num_tokens

    def close(self) -> None:
        self.reset()  # idempotent; the shared embedding model stays loaded for other providers

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = {k: float(v) for k, v in self._counts.items()}
            out["donors"] = float(len(self._home))
            out["namespaces"] = float(len(self._stores))
            return out
