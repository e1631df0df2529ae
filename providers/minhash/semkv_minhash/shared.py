"""MinHash LSH band tables in a shared Redis store (``discovery_store: redis://...``).

Layout (see ``semkv.discovery_store`` for records, TTL, LRU and failure handling), every key
under ``{store_prefix}:minhash:{variant}:{namespace}:``, where ``variant`` fingerprints
``num_perm``, ``shingle_tokens``, ``seed`` and the band parameters (differently configured
engines never share buckets):
- ``b{band}:{band key hex}``: one LSH bucket, a sorted set of donor ids (the newest 256 kept);
  band keys are datasketch's (``semkv_minhash.lsh.band_keys``), as in the in-process tables;
- ``d:{donor id}``: the record: ``t`` the token ids, ``s`` the signature (uint32,
  little-endian), ``h`` the number of unique shingles (for the coverage signal).

A lookup is two round trips (a third, ``donors_tokens``, when it found other engines'
donors): the query's ``b`` buckets (their newest members,
``store_lookup_max_members`` in all), then the signatures of at most
``store_lookup_max_records`` candidates, those in the most of the query's buckets first
(``RedisStore.most_found``; which also renews their TTL and LRU rank and the matched buckets'
TTL); ranking is the in-process one (``semkv_minhash.rank``). A fleet whose buckets are full
(every chat shares a system prompt) costs one lookup the same bounded read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from semkv.discovery_store import (
    MalformedRecord,
    Posting,
    RedisStore,
    SharedDonors,
    SharedStoreConfig,
    count_field,
    pack_tokens,
)
from semkv.provider import DonorRecord, LookupQuery
from semkv.types import Candidate
from semkv_minhash.lsh import band_keys
from semkv_minhash.rank import rank

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    from semkv_minhash.sketch import ShingleSketcher

BUCKET_CAP = 256  # donors kept per LSH bucket (newest first)


class SharedMinHash:
    def __init__(self, config: SharedStoreConfig, sketcher: ShingleSketcher,
                 params: tuple[int, int], np: Any) -> None:
        self.sketcher, self.params, self._np = sketcher, params, np
        variant = (f"p{sketcher.num_perm}k{sketcher.shingle_tokens}s{sketcher.seed}"
                   f"b{params[0]}r{params[1]}")
        self.store = RedisStore(config, "minhash", variant)
        self.donors = SharedDonors(self.store, ["s"], self._postings_of_record, BUCKET_CAP)

    def _postings(self, qid: str, signature: NDArray[np.uint32]) -> list[Posting]:
        return [(f"b{i}:{band.hex()}", qid)
                for i, band in enumerate(band_keys(signature, self.params))]

    def _signature(self, raw: bytes | None) -> NDArray[np.uint32]:
        """A stored signature; ``MalformedRecord`` unless it has ``num_perm`` values."""
        if raw is None or len(raw) != 4 * self.sketcher.num_perm:
            raise MalformedRecord("signature: not num_perm 4-byte values")
        sig: NDArray[np.uint32] = self._np.frombuffer(raw, dtype="<u4").astype(self._np.uint32)
        return sig

    def _postings_of_record(self, qid: str, row: list[bytes | None]) -> list[Posting]:
        return [] if row[0] is None else self._postings(qid, self._signature(row[0]))

    def register(self, donor: DonorRecord, hashes: NDArray[np.uint32],
                 signature: NDArray[np.uint32]) -> None:
        if not len(hashes):
            self.donors.evict(donor.donor_id)  # re-registration replaces, even by nothing
            return
        qid = self.store.qualify(donor.donor_id)
        fields = {"t": pack_tokens(donor.token_ids),
                  "s": signature.astype("<u4").tobytes(),
                  "h": str(len(hashes)).encode()}
        self.donors.register(donor.namespace, donor.donor_id, fields,
                             self._postings(qid, signature))

    def lookup(self, query: LookupQuery, hashes: NDArray[np.uint32],
               signature: NDArray[np.uint32]) -> list[Candidate]:
        np, ns = self._np, query.namespace
        suffixes = [s for s, _ in self._postings("", signature)]
        buckets = self.store.postings(ns, suffixes)
        checked = self.store.checked_id
        # a bounded read however full the buckets: the donors in most of them first
        qids = self.store.most_found([[q for q in bucket if checked(q)] for bucket in buckets])
        if not qids:
            return []
        found_in = [suffix for suffix, bucket in zip(suffixes, buckets, strict=True) if bucket]
        rows = self.store.records(ns, qids, ["s", "h"], touch=True, refresh=found_in)
        live: list[tuple[str, Any, int]] = []  # (id, signature, shingles)
        for qid, row in zip(qids, rows, strict=True):
            if row is None:
                continue  # expired or evicted
            try:
                live.append((qid, self._signature(row[0]), count_field(row[1])))
            except MalformedRecord:
                self.store.malformed()
        if not live:
            return []
        keys = [self.store.local(qid) for qid, _, _ in live]
        sigs = np.stack([sig for _, sig, _ in live])
        sizes = np.array([float(size) for _, _, size in live], dtype=np.float64)
        return rank(np, keys, sigs, sizes, signature, len(hashes), ns, query.max_candidates)

    def close(self) -> None:
        self.donors.close()
