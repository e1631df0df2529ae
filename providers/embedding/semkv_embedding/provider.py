"""Embedding-ANN discovery: donors whose text embeds close to the target's (MiniLM + faiss).

Protocol (see ``semkv.provider``): ``register_donor`` only enqueues (``background_indexing``);
one daemon thread detokenizes, embeds and inserts queued donors in batches, and ``flush``
blocks until the queue is drained. ``lookup`` embeds the query text (its only real cost) and
searches the faiss index of the query's namespace within ``lookup_budget_ms``: if the model or
the index stays busy past the budget, the lookup returns no candidates (a miss, never an
error). ``evict`` drops a donor from the queue and from the index at once (a re-registered or
evicted donor still being embedded is discarded when its batch lands); ``reset`` forgets
everything; ``close`` stops the thread (idempotent).

Similarity is the cosine of the two text vectors, clamped to [0, 1]; candidates come best
first (ties by donor id) and spans are left to the verifier. Each namespace has its own index,
so a lookup never sees another namespace's donors.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from semkv.log import get_logger
from semkv.provider import (
    DonorProvider,
    DonorRecord,
    LookupQuery,
    ProviderCapabilities,
    ProviderContext,
)
from semkv.types import Candidate
from semkv_embedding.config import EmbeddingConfig
from semkv_embedding.index import HNSW_M

if TYPE_CHECKING:
    from semkv_embedding.index import NamespaceIndex

_log = get_logger("semkv.embedding")
_OPEN: weakref.WeakSet[EmbeddingProvider] = weakref.WeakSet()


@atexit.register
def _close_open_providers() -> None:
    # NOTE: a process that exits with a provider still open (a host that never called close)
    # must stop its indexing thread first: with vLLM loaded, a daemon thread still parked in
    # it at interpreter teardown aborted the process ("terminate called without an active
    # exception").
    for provider in list(_OPEN):
        provider.close()


@dataclass(frozen=True)
class _Pending:
    ticket: int
    donor_id: str
    namespace: str
    token_ids: tuple[int, ...]
    text: str | None


class EmbeddingProvider(DonorProvider):
    name = "embedding"
    # One MiniLM window of 600 characters takes ~50 ms on one CPU core (p99 ~70 ms; docs:
    # benchmarks/embedding_lookup.py): over the connector's 50 ms default, so it asks for 100.
    capabilities = ProviderCapabilities(needs_text=True, background_indexing=True,
                                        lookup_ms=100.0)
    Config = EmbeddingConfig
    config: EmbeddingConfig

    def __init__(self, config: BaseModel, context: ProviderContext) -> None:
        super().__init__(config, context)
        from semkv_embedding.encoder import INSTALL_HINT, Encoder, VectorCache, load_model

        try:
            import faiss
            import numpy as np
        except ImportError as exc:
            raise ImportError(
                f"the semkv provider 'embedding' needs faiss: {INSTALL_HINT}"
            ) from exc
        cfg = self.config
        if cfg.model_path is None:
            from semkv.assets import minilm_dir

            path = minilm_dir()
        else:
            path = cfg.model_path
        if not path.is_dir():
            raise FileNotFoundError(f"embedding model folder not found: {path}")
        if cfg.faiss_threads is not None:
            faiss.omp_set_num_threads(cfg.faiss_threads)
        model, model_lock = load_model(path)
        self._np: Any = np
        self._faiss: Any = faiss
        self._encoder = Encoder(model, model_lock, cfg.max_text_chars, cfg.chunk_chars,
                                VectorCache(cfg.vector_cache_entries))
        self._budget_s = (cfg.lookup_budget_ms or context.lookup_timeout_ms or 250.0) / 1000.0
        # Warm the model (the first forward is slow) off any request's clock, and say at
        # start-up, by name, when one window already costs more than the lookup budget.
        self.window_ms = self._encoder.time_one_window()
        if self.window_ms > 1000.0 * self._budget_s:
            _log.warning(
                "embedding_lookup_over_budget", window_ms=round(self.window_ms, 1),
                budget_ms=round(1000.0 * self._budget_s, 1), max_text_chars=cfg.max_text_chars,
                fix="raise lookup_timeout_ms, or lower max_text_chars and chunk_chars")
        self._gpu = cfg.use_gpu and hasattr(faiss, "StandardGpuResources") and (
            faiss.get_num_gpus() > 0
        )
        self._state = threading.Condition(threading.Lock())  # guards every field below
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._taken: dict[str, int] = {}  # donor id -> ticket of the batch being embedded
        self._indexed: dict[str, tuple[str, int]] = {}  # donor id -> (namespace, faiss id)
        self._donor_of: dict[int, str] = {}
        self._spaces: dict[str, NamespaceIndex] = {}
        self._tickets = 0
        self._next_id = 0
        self._counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()  # lookups count even when the state lock is busy
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="semkv-embedding", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    # -- registration (enqueue) and removal ---------------------------------------------------

    def register_donor(self, donor: DonorRecord) -> None:
        with self._state:
            if self._closed:
                return
            self._forget(donor.donor_id)  # the old entry must not outlive its KV
            self._tickets += 1
            self._pending[donor.donor_id] = _Pending(
                self._tickets, donor.donor_id, donor.namespace, donor.token_ids, donor.text
            )
            while len(self._pending) > self.config.max_pending:
                self._pending.popitem(last=False)
                self._count("dropped_pending")
            self._state.notify_all()

    def _forget(self, donor_id: str) -> None:
        self._pending.pop(donor_id, None)
        self._taken.pop(donor_id, None)  # its in-flight vector is discarded on arrival
        held = self._indexed.pop(donor_id, None)
        if held is None:
            return
        ns, ident = held
        self._donor_of.pop(ident, None)
        space = self._spaces[ns]
        space.remove(ident)
        if not len(space):  # an emptied namespace leaves no index behind
            del self._spaces[ns]

    def evict(self, donor_id: str) -> None:
        with self._state:
            self._forget(donor_id)

    def reset(self) -> None:
        with self._state:
            self._pending.clear()
            self._taken.clear()
            self._indexed.clear()
            self._donor_of.clear()
            self._spaces.clear()
            self._state.notify_all()

    def flush(self) -> None:
        with self._state:
            while (self._pending or self._taken) and not self._closed:
                if not self._thread.is_alive():
                    return
                self._state.wait(timeout=0.5)

    def donor_memory_bytes(self, num_tokens: int) -> int:
        """One vector, its HNSW links (faiss: outside Python's allocator) and its id maps
        (measured: ~2.4 KB at MiniLM's 384 dimensions, ~3.7 KB with few donors)."""
        return 4 * self._encoder.dim + 10 * HNSW_M + 2_048

    def cache_memory_bytes(self) -> int:
        """The vector cache at its bound (a row and its 16-byte key each)."""
        return self.config.vector_cache_entries * (4 * self._encoder.dim + 112 + 49 + 96)

    def close(self) -> None:
        with self._state:
            if self._closed:
                return
            self._closed = True
            self._pending.clear()
            self._taken.clear()
            self._state.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)
        with self._state:
            self._indexed.clear()
            self._donor_of.clear()
            self._spaces.clear()

    # -- background indexing ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._state:
                while not self._pending and not self._closed:
                    self._state.wait()
                if self._closed:
                    return
                batch: list[_Pending] = []
                while self._pending and len(batch) < self.config.batch_size:
                    item = self._pending.popitem(last=False)[1]
                    self._taken[item.donor_id] = item.ticket
                    batch.append(item)
            vectors = self._embed_batch(batch)
            with self._state:
                self._insert(batch, vectors)
                for item in batch:
                    if self._taken.get(item.donor_id) == item.ticket:
                        del self._taken[item.donor_id]
                self._maintain()
                self._state.notify_all()

    def _embed_batch(self, batch: list[_Pending]) -> Any:
        texts, namespaces = [], []
        for item in batch:
            namespaces.append(item.namespace)
            try:
                texts.append(self.text_of(item.token_ids, item.text))
            except Exception as exc:  # noqa: BLE001 - one bad donor must not stop the queue
                self._count_error("detokenize", exc)
                texts.append("")
        try:
            return self._encoder.encode(texts, namespaces)
        except Exception as exc:  # noqa: BLE001
            self._count_error("embed", exc)
            return None

    def _count_error(self, stage: str, exc: BaseException) -> None:
        self._count("index_errors")
        # The exception's type only: its message could quote the text.
        _log.warning("embedding_index_error", stage=stage, error=type(exc).__name__)

    def _insert(self, batch: list[_Pending], vectors: Any) -> None:
        if vectors is None:
            return
        np = self._np
        by_ns: dict[str, list[tuple[int, Any]]] = {}
        for item, vector in zip(batch, vectors, strict=True):
            if self._taken.get(item.donor_id) != item.ticket or not vector.any():
                continue  # evicted, replaced or reset meanwhile; or blank text
            ident, self._next_id = self._next_id, self._next_id + 1
            self._indexed[item.donor_id] = (item.namespace, ident)
            self._donor_of[ident] = item.donor_id
            by_ns.setdefault(item.namespace, []).append((ident, vector))
        for ns, rows in by_ns.items():
            space = self._spaces.get(ns)
            if space is None:
                from semkv_embedding.index import NamespaceIndex

                kind = "hnsw" if self.config.index == "hnsw" else "flat"
                space = NamespaceIndex(
                    self._faiss, self._encoder.dim, kind, self.config.hnsw_ef_search, self._gpu
                )
                self._spaces[ns] = space
            ids = np.array([r[0] for r in rows], dtype=np.int64)
            space.add(ids, np.stack([r[1] for r in rows]).astype(np.float32))

    def _maintain(self) -> None:
        # Under the state lock, in this thread: lookups meanwhile wait at most their budget.
        for space in self._spaces.values():
            if space.needs_compaction():
                space.compact()
            if (
                self.config.index == "auto"
                and space.kind == "flat"
                and len(space) >= self.config.hnsw_min_donors
            ):
                space.rebuild_as("hnsw")

    # -- lookup -------------------------------------------------------------------------------

    def lookup(self, query: LookupQuery) -> list[Candidate]:
        deadline = time.monotonic() + self._budget_s
        ns = query.namespace
        if (not query.token_ids and not query.text) or ns not in self._spaces:
            return []  # nothing to compare with: skip the embedding cost (racy peek, rechecked)
        try:
            text = self.text_of(query.token_ids, query.text)
        except ValueError:  # no text carried and no detokenizer: a host set-up problem
            self._count("missing_text")
            if self._counts["missing_text"] == 1:
                _log.warning("embedding_lookup_without_text", provider=self.name)
            return []
        vectors = self._encoder.encode([text], [ns], timeout_s=deadline - time.monotonic())
        if vectors is None or not vectors[0].any():
            if vectors is None:
                self._count("lookups_over_budget")
            return []
        if not self._state.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            self._count("lookups_over_budget")
            return []
        try:
            self._count("lookups")
            space = self._spaces.get(ns)
            hits = space.search(vectors[0], query.max_candidates) if space else []
            named = [(self._donor_of[i], s) for i, s in hits if i in self._donor_of]
        finally:
            self._state.release()
        floor = self.config.min_similarity
        scored = [(d, min(1.0, max(0.0, s)), s) for d, s in named]
        scored.sort(key=lambda row: (-row[1], row[0]))
        return [
            Candidate(donor_id=d, namespace=ns, similarity=sim, signals={"cosine": raw})
            for d, sim, raw in scored
            if sim >= floor
        ][: query.max_candidates]

    def _count(self, key: str) -> None:
        with self._counts_lock:
            self._counts[key] += 1

    def stats(self) -> dict[str, float]:
        with self._counts_lock:
            out = {key: float(value) for key, value in self._counts.items()}
        with self._state:
            out["donors"] = float(len(self._indexed))
            out["pending"] = float(len(self._pending) + len(self._taken))
            out["namespaces"] = float(len(self._spaces))
            out["tombstones"] = float(sum(len(s.tombstones) for s in self._spaces.values()))
            out["gpu_index"] = float(self._gpu)
            out["cached_vectors"] = float(len(self._encoder.cache))
            out["window_ms"] = self.window_ms
            return out
