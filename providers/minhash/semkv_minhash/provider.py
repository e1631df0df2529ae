"""MinHash-lexical discovery: donors whose token shingles overlap the target's (datasketch LSH).

Protocol (see ``semkv.provider``): ``register_donor`` sketches the donor's token ids at once
(no background step, no text needed); ``lookup`` sketches the query and asks the LSH band
tables of the query's namespace for donors whose estimated shingle Jaccard likely passes
``threshold``; ``evict``/``reset`` remove from the tables. One LSH per namespace, so a lookup
can only ever see donors of its own namespace. Signatures are datasketch ``MinHash`` values and
band parameters come from datasketch's ``MinHashLSH``; the tables are ``lsh.CompactLSH`` by
default or ``MinHashLSH`` itself (``lsh: datasketch``), see ``semkv_minhash.lsh`` for why.

A shingle is ``shingle_tokens`` consecutive token ids. The reported similarity is the MinHash
estimate of the Jaccard similarity of the two shingle sets, clamped to [0, 1]; candidates come
best first. Spans are not reported (``num_tokens=0``): the verifier finds them.

Costs: a lookup is a few numpy operations over the query's shingles (linear in its length),
one probe per LSH band, and one vectorized comparison per candidate. A donor costs its
``num_perm`` signature (4 bytes each) plus one entry per band.

Thread safety: sketching runs outside the lock (the sketcher is immutable); LSH and donor
table changes and probes run under one lock.

Store: in this process by default; ``discovery_store: redis://host:port/db`` keeps the band
tables, signatures and token ids in Redis, shared by every engine naming the same server (see
``semkv_minhash.shared`` and ``semkv.discovery_store``: TTL, LRU bound, failure handling).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from semkv.discovery_store import SharedStoreConfig
from semkv.provider import (
    DonorProvider,
    DonorRecord,
    LookupQuery,
    ProviderCapabilities,
    ProviderContext,
)
from semkv.shared_or_local import SharedOrLocal
from semkv.types import Candidate
from semkv_minhash.rank import rank

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    from semkv_minhash.lsh import BandIndex
    from semkv_minhash.shared import SharedMinHash

INSTALL_HINT = "pip install semkv-minhash (it brings datasketch==2.0.0)"


class MinHashConfig(SharedStoreConfig):
    num_perm: int = Field(
        default=128, ge=16, le=1024, description="MinHash permutations (signature length)."
    )
    threshold: float = Field(
        default=0.1,
        gt=0.0,
        lt=1.0,
        description=(
            "LSH Jaccard threshold: where the band S-curve is tuned to switch. The default 0.1 "
            "keeps a RAG target's one-passage donors (Jaccard about 0.25-0.35 against a "
            "three-passage prompt), which 0.3 misses; admission re-verifies every candidate "
            "against token ids, so a loose threshold costs lookups, never wrong reuse."
        ),
    )
    shingle_tokens: int = Field(
        default=8, ge=1, le=64, description="Consecutive token ids per shingle."
    )
    seed: int = Field(default=1, ge=0, lt=2**32, description="Seed of the hash permutations.")
    lsh: Literal["compact", "datasketch"] = Field(
        default="compact",
        description=(
            "Band tables: compact (same candidates, no per-donor GC containers) or "
            "datasketch's MinHashLSH dict storage."
        ),
    )


class MinHashProvider(SharedOrLocal, DonorProvider):
    name = "minhash"
    capabilities = ProviderCapabilities(needs_text=False, reports_spans=False)
    Config = MinHashConfig
    config: MinHashConfig

    def __init__(self, config: BaseModel, context: ProviderContext) -> None:
        super().__init__(config, context)
        try:
            import numpy as np
            from datasketch import MinHashLSH
        except ImportError as exc:
            raise ImportError(
                f"the semkv provider 'minhash' needs datasketch: {INSTALL_HINT}"
            ) from exc
        from semkv_minhash.sketch import ShingleSketcher

        self._np: Any = np
        cfg = self.config
        self._sketcher = ShingleSketcher(cfg.num_perm, cfg.shingle_tokens, cfg.seed)
        # Band parameters are optimized once here (datasketch integrates the S-curve, which is
        # slow), then handed to every per-namespace LSH.
        template = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm)
        self._params: tuple[int, int] = (template.b, template.r)
        self._lock = threading.Lock()
        # Per-donor state in flat dicts of untracked values: nothing per donor for the GC to walk.
        self._namespace_of: dict[str, str] = {}
        self._signature_of: dict[str, NDArray[np.uint32]] = {}
        self._shingles_of: dict[str, int] = {}  # unique shingles, for the coverage signal
        self._lsh: dict[str, BandIndex] = {}
        self._per_namespace: Counter[str] = Counter()
        self._lookups = 0
        self._closed = False
        self._shared: SharedMinHash | None = None
        if cfg.shared:
            from semkv_minhash.shared import SharedMinHash

            self._shared = SharedMinHash(cfg, self._sketcher, self._params, np)

    # -- registration -------------------------------------------------------------------------

    def register_donor(self, donor: DonorRecord) -> None:
        hashes = self._sketcher.shingles(donor.token_ids)
        signature = self._sketcher.signature(hashes)
        if self._shared is not None:
            if not self._closed:
                self._shared.register(donor, hashes, signature)
            return
        with self._lock:
            self._forget(donor.donor_id)  # re-registration replaces
            if not len(hashes) or self._closed:
                return
            ns = donor.namespace
            lsh = self._lsh.get(ns)
            if lsh is None:
                lsh = self._lsh[ns] = self._new_lsh()
            lsh.insert(donor.donor_id, signature)
            self._namespace_of[donor.donor_id] = ns
            self._signature_of[donor.donor_id] = signature
            self._shingles_of[donor.donor_id] = len(hashes)
            self._per_namespace[ns] += 1

    def _new_lsh(self) -> BandIndex:
        from semkv_minhash.lsh import CompactLSH, DatasketchLSH

        if self.config.lsh == "datasketch":
            return DatasketchLSH(self._params, self._sketcher)
        return CompactLSH(self._params)

    def _forget(self, donor_id: str) -> None:
        ns = self._namespace_of.pop(donor_id, None)
        if ns is None:
            return
        self._lsh[ns].remove(donor_id, self._signature_of.pop(donor_id))
        del self._shingles_of[donor_id]
        self._per_namespace[ns] -= 1
        if self._per_namespace[ns] <= 0:  # drop an emptied namespace's tables entirely
            del self._per_namespace[ns]
            del self._lsh[ns]

    def donor_memory_bytes(self, num_tokens: int) -> int:
        """The signature and one LSH entry per band, whatever the length (measured: ~5.3 KB
        at 128 permutations; tests/test_index_memory.py)."""
        if self._shared is not None:
            return 0  # the signature and buckets live in the shared store
        per_perm = 192 if self.config.lsh == "datasketch" else 48
        return 1024 + per_perm * self.config.num_perm

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()
        with self._lock:
            self._closed = True
            self._clear()

    def _clear(self) -> None:
        self._namespace_of.clear()
        self._signature_of.clear()
        self._shingles_of.clear()
        self._lsh.clear()
        self._per_namespace.clear()

    # -- lookup -------------------------------------------------------------------------------

    def lookup(self, query: LookupQuery) -> list[Candidate]:
        ns = query.namespace
        if self._shared is not None and query.token_ids:
            hashes = self._sketcher.shingles(query.token_ids)
            signature = self._sketcher.signature(hashes)
            with self._lock:
                self._lookups += 1
            return self._shared.lookup(query, hashes, signature)
        if not query.token_ids or ns not in self._lsh:  # racy peek; rechecked under the lock
            return []
        np = self._np
        hashes = self._sketcher.shingles(query.token_ids)
        signature = self._sketcher.signature(hashes)
        with self._lock:
            self._lookups += 1
            lsh = self._lsh.get(ns)
            if lsh is None:
                return []
            keys = sorted(lsh.query(signature))
            if not keys:
                return []
            donor_sigs = np.stack([self._signature_of[k] for k in keys])
            donor_sizes = np.array([self._shingles_of[k] for k in keys], dtype=np.float64)
        return rank(np, keys, donor_sigs, donor_sizes, signature, len(hashes), ns,
                    query.max_candidates)

    def stats(self) -> dict[str, float]:
        with self._lock:
            if self._shared is not None:
                return {**self._shared.donors.stats(), "lookups": float(self._lookups)}
            return {
                "donors": float(len(self._namespace_of)),
                "namespaces": float(len(self._lsh)),
                "lookups": float(self._lookups),
                "bands": float(self._params[0]),
                "rows_per_band": float(self._params[1]),
            }
