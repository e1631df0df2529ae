"""The chunk indexes in a shared Redis store (``discovery_store: redis://...``).

Layout (see ``semkv.discovery_store`` for records, TTL, LRU and failure handling), every key
under ``{store_prefix}:chunks:c{chunk_tokens}:{namespace}:``:
- ``p:{hash}``: the prefix index, a sorted set of donor ids whose chained hash of chunks
  ``0..i`` is ``hash``;
- ``s:{hash}``: the span index, members ``{first chunk index}|{donor id}`` holding the
  position-free chunk ``hash`` (first occurrence within the donor);
- ``d:{donor id}``: the record: ``t`` the token ids (compact bytes), ``n`` their count.
Each posting set keeps the newest ``max_postings_per_chunk`` donors.

Hashes are 64-bit BLAKE2b of the chunk's little-endian token ids (chained: of the previous
hash and the chunk), identical in every process and Python version, unlike ``hash()``.

A lookup is two round trips (a third, ``donors_tokens``, when it found other engines'
donors): the prefix and span posting sets of the query's chunks (at most
``store_lookup_max_keys``: a long prompt's are sampled, see ``sampled``), then the records
(lengths) of the best-ranked donors, which also renews their TTL and LRU rank and the
TTL of the posting sets that matched.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b

from semkv.discovery_store import (
    MalformedRecord,
    Posting,
    RedisStore,
    SharedDonors,
    SharedStoreConfig,
    count_field,
    pack_tokens,
    unpack_tokens,
)
from semkv.provider import DonorRecord, LookupQuery
from semkv.types import Candidate
from semkv_chunks.runs import best_runs, candidates

MAX_CHUNK_DIGITS = 7  # a span posting's chunk index: below 10**7 chunks


def chunk_hashes(tokens: Sequence[int], chunk: int) -> tuple[list[str], list[str]]:
    """(position-free, chained) hex hashes of the full chunks of ``tokens``."""
    packed = array("q", tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    raw, width = packed.tobytes(), chunk * packed.itemsize
    spans: list[str] = []
    chained: list[str] = []
    parent = b""
    for i in range(len(tokens) // chunk):
        piece = raw[i * width : (i + 1) * width]
        spans.append(blake2b(piece, digest_size=8).hexdigest())
        parent = blake2b(parent + piece, digest_size=8).digest()
        chained.append(parent.hex())
    return spans, chained


class SharedChunks:
    def __init__(self, config: SharedStoreConfig, chunk: int, cap: int) -> None:
        self.chunk = chunk
        self.store = RedisStore(config, "chunks", f"c{chunk}")
        self.donors = SharedDonors(self.store, ["t"], self._postings_of_record, cap)

    def _postings(self, qid: str, tokens: Sequence[int]) -> list[Posting]:
        spans, chained = chunk_hashes(tokens, self.chunk)
        out: list[Posting] = [("p:" + h, qid) for h in chained]
        seen: set[str] = set()
        for j, h in enumerate(spans):
            if h not in seen:  # first occurrence within the donor
                seen.add(h)
                out.append(("s:" + h, f"{j}|{qid}"))
        return out

    def _postings_of_record(self, qid: str, row: list[bytes | None]) -> list[Posting]:
        return [] if row[0] is None else self._postings(qid, unpack_tokens(row[0]))

    def register(self, donor: DonorRecord) -> None:
        qid = self.store.qualify(donor.donor_id)
        fields = {"t": pack_tokens(donor.token_ids), "n": str(len(donor.token_ids)).encode()}
        self.donors.register(donor.namespace, donor.donor_id, fields,
                             self._postings(qid, donor.token_ids))

    def lookup(self, query: LookupQuery) -> list[Candidate]:
        """At most ``store_lookup_max_keys`` posting sets in one round trip (``sampled``)."""
        spans, chained = chunk_hashes(query.token_ids, self.chunk)
        if not spans:
            return []
        ns, n = query.namespace, len(spans)
        prefix_at, span_at = sampled(n, self.store.config.store_lookup_max_keys)
        suffixes = ["p:" + chained[j] for j in prefix_at] + ["s:" + spans[j] for j in span_at]
        read = self.store.postings(ns, suffixes)
        # unsampled chunks read as empty: a donor is still found by the ones read, and
        # admission verifies its real overlap on the tokens
        rows: list[list[str]] = [[] for _ in range(2 * n)]
        for j, members in zip([*prefix_at, *(n + j for j in span_at)], read, strict=True):
            rows[j] = members
        checked = self.store.checked_id
        prefix_hits = [[qid for qid in members if checked(qid)] for members in rows[:n]]
        span_postings: list[dict[str, int]] = []
        for members in rows[n:]:
            posting: dict[str, int] = {}
            for member in members:
                pos, sep, qid = member.partition("|")
                if not (sep and pos.isdigit() and len(pos) <= MAX_CHUNK_DIGITS):
                    self.store.malformed()
                elif checked(qid) is not None:  # (a bad id is counted there)
                    posting.setdefault(qid, int(pos))
            span_postings.append(posting)
        best = best_runs(prefix_hits, span_postings, self.chunk)
        if not best:
            return []
        # Records of the best-ranked few: gone (expired, evicted) donors drop out here.
        shortlist = sorted(best, key=lambda d: (-best[d].chunks, best[d].target_start, d))
        shortlist = shortlist[: min(4 * query.max_candidates,
                                    self.store.config.store_lookup_max_records)]
        found_in = [suffix for suffix, members in zip(suffixes, read, strict=True) if members]
        records = self.store.records(ns, shortlist, ["n"], touch=True, refresh=found_in)
        lengths: dict[str, int] = {}
        for qid, row in zip(shortlist, records, strict=True):
            if row is None:
                continue  # expired or evicted
            try:
                lengths[qid] = count_field(row[0])
            except MalformedRecord:
                self.store.malformed()
        found = candidates(best, lengths, ns, self.chunk, len(query.token_ids),
                           query.max_candidates)
        return [c.model_copy(update={"donor_id": self.store.local(c.donor_id)}) for c in found]


    def close(self) -> None:
        self.donors.close()


def sampled(n: int, max_keys: int) -> tuple[list[int], list[int]]:
    """Which of a prompt's ``n`` chunks a lookup reads: the chained prefix keys of the first
    half of ``max_keys`` (a prefix run starts at chunk 0 and breaks at its first miss), and
    span keys spread evenly over the whole prompt for the other half; all when they fit."""
    if 2 * n <= max_keys:
        return list(range(n)), list(range(n))
    half = max_keys // 2
    prefix = list(range(min(n, half)))
    spans = sorted({(i * n) // half for i in range(half)})
    return prefix, spans
