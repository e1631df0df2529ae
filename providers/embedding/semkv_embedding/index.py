"""One namespace's vectors in faiss: inner product over unit vectors (= cosine), int64 ids.

Kinds: ``flat`` (exact, ``IndexIDMap2`` over ``IndexFlatIP``) and ``hnsw`` (approximate,
``IndexIDMap2`` over ``IndexHNSWFlat``). A flat index moves to a GPU only when faiss sees one
(``faiss.get_num_gpus() > 0``, i.e. faiss-gpu is installed and a device is visible).

Removal is a tombstone: the id leaves ``live`` at once and searches exclude it (an IDSelector
on CPU; over-fetch and filter on GPU, where selectors are not supported), so an evicted donor
is never returned and eviction costs O(1) under the caller's lock. ``compact`` reclaims the
space later (HNSW cannot remove in place, so it is rebuilt from its own stored vectors); the
provider calls it from its background thread once tombstones pass a quarter of the index.

Not thread-safe by itself: the provider serializes every call under its state lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

HNSW_M = 32  # graph degree: faiss's usual default for sentence-embedding sizes
_MIN_TOMBSTONES = 256  # below this, compaction is not worth a pass


class NamespaceIndex:
    def __init__(
        self, faiss: Any, dim: int, kind: str, ef_search: int, use_gpu: bool
    ) -> None:
        self._faiss = faiss
        self.dim = dim
        self.kind = kind
        self.ef_search = ef_search
        self.gpu = use_gpu and kind == "flat"
        self._gpu_res: Any = None
        self.index = self._new_index()
        self.live: set[int] = set()
        self.tombstones: set[int] = set()
        self._selector: Any = None  # cached IDSelectorNot over the tombstones
        self._selector_parts: tuple[Any, ...] = ()  # keeps the selector's referents alive

    def _new_index(self) -> Any:
        faiss = self._faiss
        if self.kind == "hnsw":
            base = faiss.IndexHNSWFlat(self.dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        else:
            base = faiss.IndexFlatIP(self.dim)
            if self.gpu:
                self._gpu_res = self._gpu_res or faiss.StandardGpuResources()
                base = faiss.index_cpu_to_gpu(self._gpu_res, 0, base)
        return faiss.IndexIDMap2(base)

    def __len__(self) -> int:
        return len(self.live)

    def add(self, ids: NDArray[np.int64], vectors: NDArray[np.float32]) -> None:
        self.index.add_with_ids(vectors, ids)
        self.live.update(int(i) for i in ids)

    def remove(self, ident: int) -> None:
        if ident in self.live:
            self.live.discard(ident)
            self.tombstones.add(ident)
            self._selector = None

    def needs_compaction(self) -> bool:
        t = len(self.tombstones)
        return t >= _MIN_TOMBSTONES and t * 4 >= self.index.ntotal

    def vectors(self) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
        """(ids, vectors) of the live entries."""
        import numpy as np

        ids = self._faiss.vector_to_array(self.index.id_map).astype(np.int64)
        keep = np.fromiter((int(i) in self.live for i in ids), dtype=bool, count=len(ids))
        if not len(ids):
            return ids, np.zeros((0, self.dim), dtype=np.float32)
        return ids[keep], self.index.index.reconstruct_n(0, len(ids))[keep]

    def compact(self) -> None:
        """Drop tombstoned vectors for good (a rebuild for HNSW)."""
        import numpy as np

        if not self.tombstones:
            return
        if self.kind == "flat" and not self.gpu:
            self.index.remove_ids(np.fromiter(self.tombstones, dtype=np.int64))
        else:
            ids, vectors = self.vectors()
            self.index = self._new_index()
            if len(ids):
                self.index.add_with_ids(vectors, ids)
        self.tombstones.clear()
        self._selector = None

    def rebuild_as(self, kind: str) -> None:
        """Move the live vectors into an index of another kind (``auto`` growing into HNSW)."""
        ids, vectors = self.vectors()
        self.kind, self.gpu = kind, self.gpu and kind == "flat"
        self.index = self._new_index()
        if len(ids):
            self.index.add_with_ids(vectors, ids)
        self.tombstones.clear()
        self._selector = None

    def search(self, vector: NDArray[np.float32], k: int) -> list[tuple[int, float]]:
        """Up to ``k`` live (id, inner product) pairs, best first."""
        import numpy as np

        if not self.live:
            return []
        faiss = self._faiss
        query = vector.reshape(1, -1).astype(np.float32, copy=False)
        params: Any = None
        fetch = min(k, len(self.live))
        if self.tombstones and self.gpu:
            fetch = min(self.index.ntotal, k + len(self.tombstones))
        elif self.tombstones:
            if self._selector is None:
                batch = faiss.IDSelectorBatch(np.fromiter(self.tombstones, dtype=np.int64))
                self._selector = faiss.IDSelectorNot(batch)
                self._selector_parts = (batch,)
            params = self._selector
        if self.kind == "hnsw":
            params = faiss.SearchParametersHNSW(sel=params, efSearch=max(self.ef_search, fetch))
        elif params is not None:
            params = faiss.SearchParameters(sel=params)
        scores, ids = self.index.search(query, fetch, params=params)
        found = [
            (int(i), float(s))
            for s, i in zip(scores[0], ids[0], strict=True)
            if i >= 0 and int(i) in self.live
        ]
        return found[:k]
