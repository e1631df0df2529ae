"""Donor KV fetched from the ``lmcache server`` into semkv's host slots, for realized spans.

With ``donor_store: lmcache`` a donor's KV lives in the shared server under its own token
chunks (whichever replica computed it), but LMCache writes only into KV caches registered with
the server, by block id. The host store mirrors vLLM's page shape exactly (``block_copy.py``),
so LMCache can take it as one more KV cache of this worker: a second embedded LMCache connector
in the worker role registers it (its own instance id, the same namespaced model name as the
engine's LMCache connector, so every key agrees). A fetched donor then sits in host slots like
a local one, and the realization copies from there.

Protocol, per realized span whose donors are in the shared store (``SpanHold.fetches``):
- scheduler, at decision time: ``FetchLookups.start`` asks the server how much of each donor's
  token prefix it holds (this also locks those chunks until ``end``); ``ready`` answers None
  while a lookup runs, then whether every donor's prefix is there (else ``donor_stale``).
- worker, when the ``RealizeOp`` arrives: ``HostFetcher.submit`` retrieves each ``FetchOp``
  into its slots; ``poll`` returns the fetches finished since the last call and the slots whose
  retrieve failed. The realization starts once all of its fetches have landed.
- scheduler, when the request's hold is released (loaded, failed, finished or preempted):
  ``FetchLookups.end`` closes the lookups' sessions; a retrieve releases the read locks of the
  chunks it reads, so where none was sent (donor_stale, aborted first) it releases them. A
  lookup still running then (an abort during it) is settled on a later step (``settle``), when
  its answer says which chunks it locked.
- a lookup the server has not answered within ``transfer_timeout_s`` is ``donor_stale``
  (``fetch_timeouts``); the worker applies the same deadline to its retrieves.

NOTE: the slots are private to one request, free when reserved and pinned until its hold is
released; a new fetch into a slot that an abandoned fetch may still be writing is queued
behind it (``HostFetcher.submit``; sent by a later ``poll``, never waited for on the main
thread). An abandoned fetch is still sent and finished: its retrieve releases the read locks
its lookup took, and its slots are fenced until LMCache reports it.
NOTE: a fetch into slot ``s`` writes it only on success: the worker then sets the slot's
generation, so a failed or unfinished fetch leaves its copies stale (normal prefill, counted).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from semkv.config import SemkvConfig
from semkv.metrics import CounterBag
from semkv.types import FallbackReason, SemanticKVMatch
from semkv_vllm.metadata import FetchOp
from semkv_vllm.request_state import RequestState
from semkv_vllm.span_admission import SpanAdmission

WAIT_SLICE_S = 0.002
# Fault injection (tests and chaos runs, with SEMKV_ALLOW_FAULT_INJECTION=1): LMCache's reports
# of finished retrieves are never taken, as if the server never answered one.
FAULT_STALL_FETCHES = "SEMKV_FAULT_STALL_FETCHES"


class FetchLookups:
    """Scheduler side, over the engine's embedded LMCache scheduler adapter."""

    def __init__(self, adapter: Any, timeout_s: float = 120.0) -> None:
        self.adapter = adapter  # LMCacheMPSchedulerAdapter
        self.timeout_s = timeout_s
        self._closing: list[tuple[FetchOp, float]] = []  # ended while their lookup ran

    @property
    def chunk_tokens(self) -> int:
        """The server's chunk: it stores, finds and returns whole chunks only."""
        return int(self.adapter.lmcache_tokens_per_chunk)

    def start(self, fetches: Sequence[FetchOp]) -> None:
        for f in fetches:
            self.adapter.maybe_submit_lookup_request(f.fetch_id, list(f.token_ids),
                                                     cache_salt=f.cache_salt)

    def ready(self, fetches: Sequence[FetchOp]) -> bool | None:
        """None while a lookup runs; else whether the server holds every fetch's tokens."""
        found = [self.adapter.check_lookup_result(f.fetch_id) for f in fetches]
        if any(n is None for n in found):
            return None
        return all(int(n) >= f.end for n, f in zip(found, fetches, strict=True))

    def end(self, fetches: Sequence[FetchOp], *, retrieved: bool) -> None:
        """Close the lookups' sessions; without a retrieve (which releases the chunks it
        reads) also release the chunks each lookup locked."""
        for f in fetches:
            if not retrieved and self.adapter.check_lookup_result(f.fetch_id) is None:
                self._closing.append((f, time.monotonic() + self.timeout_s))
                continue
            self._close(f, unlock=not retrieved)

    def _close(self, f: FetchOp, *, unlock: bool) -> None:
        found = self.adapter.check_lookup_result(f.fetch_id) if unlock else None
        if found:
            self.adapter.free_lookup_locks(list(f.token_ids), 0, int(found), f.fetch_id,
                                           cache_salt=f.cache_salt)
        self.adapter.end_session(f.fetch_id)
        self.adapter.cleanup_lookup_result(f.fetch_id)

    def settle(self) -> None:
        """Close the lookups ended while they ran, once answered (or past their deadline:
        then the server's lock TTL frees what they took)."""
        if not self._closing:
            return
        now, still = time.monotonic(), []
        for f, deadline in self._closing:
            if self.adapter.check_lookup_result(f.fetch_id) is not None or now >= deadline:
                self._close(f, unlock=True)
            else:
                still.append((f, deadline))
        self._closing = still

    @property
    def unsettled(self) -> int:
        return len(self._closing)


class SpanFetches:
    """Scheduler side: a realized span is answered once the store confirms its donors."""

    def __init__(self, lookups: FetchLookups, spans: SpanAdmission, stats: CounterBag, *,
                 timeout_s: float = 120.0) -> None:
        self.lookups = lookups
        self.timeout_s = timeout_s
        self.spans = spans
        self.stats = stats

    def start(self, st: RequestState, realized: SemanticKVMatch) -> SemanticKVMatch | None:
        """Look the span's donor prefixes up; the answer as ``poll``."""
        assert st.span is not None
        for fetch in st.span.fetches:
            fetch.cache_salt = st.request.cache_salt or ""
        self.lookups.start(st.span.fetches)
        st.fetching, st.fetch_started = realized, time.monotonic()
        return self.poll(st)

    def poll(self, st: RequestState) -> SemanticKVMatch | None:
        """None while the lookups run; then the span, or ``donor_stale`` with all released."""
        assert st.span is not None and st.fetching is not None
        ready = self.lookups.ready(st.span.fetches)
        if ready is None and time.monotonic() - st.fetch_started < self.timeout_s:
            return None
        match, st.fetching = st.fetching, None
        if ready:
            return match
        self.stats.inc("fetch_missing" if ready is not None else "fetch_timeouts")
        self.end(st)
        self.spans.release(st.span)
        st.span = None
        return SemanticKVMatch.fallback(st.request.request_id, FallbackReason.DONOR_STALE,
                                        local_prefix_tokens=match.local_prefix_tokens)

    def end(self, st: RequestState) -> None:
        """The span's donors are copied (or will not be): unlock them, free their slots."""
        if st.span is None or not st.span.fetches:
            return
        # NOTE: a planned span's RealizeOp went to the workers, whose retrieve releases what
        # it reads (a worker failing before its retrieve leaves the locks to the server's TTL).
        self.lookups.end(st.span.fetches, retrieved=st.planned)
        self.spans.release_fetched(st.span)


class HostFetcher:
    """Worker side: a second LMCache worker connector whose KV cache is the host store."""

    def __init__(self, vllm_config: Any, config: SemkvConfig, kv_cache_config: Any,
                 namespace_digest: str) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from semkv_vllm.lmcache_store import inner_vllm_config, lmcache_connector_class

        self.connector = lmcache_connector_class()(
            inner_vllm_config(vllm_config, config, namespace_digest), KVConnectorRole.WORKER,
            kv_cache_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.wait_s = config.lookup_timeout_ms / 1000.0
        self.timeout_s = config.transfer_timeout_s
        self._in_flight: dict[str, FetchOp] = {}
        self._sent_at: dict[str, float] = {}  # fetch id -> when its retrieve was sent
        self._queued: list[FetchOp] = []  # behind an earlier fetch into one of their slots
        self._stalled: set[str] = set()  # finished reports held back by fault injection
        self._early: list[FetchOp] = []  # collected by a submit: the next poll's

    @property
    def adapter(self) -> Any:
        return self.connector.worker_adapter

    def register(self, store: dict[str, Any]) -> None:
        self.connector.register_kv_caches(store)

    @property
    def busy(self) -> bool:
        return bool(self._in_flight or self._queued or self._early)

    def submit(self, op: FetchOp) -> None:
        """Retrieve the donor's tokens ``[0, op.end)`` into ``op.slots`` (now, or queued behind
        an earlier fetch into one of them)."""
        if op.end % self.block_size or len(op.slots) != op.end // self.block_size:
            raise ValueError(f"{len(op.slots)} slots for {op.end} tokens of "
                             f"{self.block_size}-token blocks")
        self._early += self._collect()  # what has landed meanwhile no longer fences
        if self._lost_slots().intersection(op.slots):
            # NOTE: a retrieve LMCache has not reported past the deadline keeps its slots
            # fenced (a late write must never land in another donor): fail now, not after
            # waiting a whole deadline behind it.
            raise TimeoutError("an earlier fetch into these slots was never reported")
        self._queued.append(op)
        self._send_queued()

    def _lost_slots(self) -> set[int]:
        """Slots of in-flight fetches sent more than ``transfer_timeout_s`` ago."""
        oldest = time.monotonic() - self.timeout_s
        return {s for fid, f in self._in_flight.items() if self._sent_at[fid] < oldest
                for s in f.slots}

    def _send_queued(self) -> None:
        """Send every queued fetch whose slots no earlier fetch still writes (in order)."""
        from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

        fenced = {s for f in self._in_flight.values() for s in f.slots}
        still = []
        for op in self._queued:
            if fenced.intersection(op.slots):
                still.append(op)
            else:
                load = LoadStoreOp(token_ids=list(op.token_ids), block_ids=[list(op.slots)],
                                   start=0, end=op.end)
                self._in_flight[op.fetch_id] = op
                self._sent_at[op.fetch_id] = time.monotonic()
                self.adapter.submit_retrieve_request(op.fetch_id, load, None,
                                                     cache_salt=op.cache_salt)
            fenced.update(op.slots)
        self._queued = still

    def poll(self, *, wait: bool = False) -> tuple[list[FetchOp], set[int]]:
        """(fetches finished since the last call, slots whose retrieve failed).

        With ``wait`` (nothing else to do this step) wait up to ``lookup_timeout_ms`` for at
        least one in-flight fetch to finish.
        """
        deadline = time.monotonic() + (self.wait_s if wait else 0.0)
        done, self._early = self._early, []
        errors: set[int] = set()
        while True:
            errors |= set(self.adapter.get_block_ids_with_load_errors())
            done += self._collect()
            self._send_queued()
            if done or not self._in_flight or time.monotonic() >= deadline:
                return done, errors
            time.sleep(WAIT_SLICE_S)

    def _collect(self) -> list[FetchOp]:
        """The in-flight fetches LMCache reports finished, out of ``_in_flight``."""
        _, finished = self.adapter.get_finished(set())
        reported = self._stalled | set(finished or ())
        if _stall_fetches():  # held back, not lost: handed over once the stall ends
            self._stalled = reported
            return []
        self._stalled = set()
        done = [self._in_flight.pop(f) for f in sorted(reported) if f in self._in_flight]
        for f in done:
            self._sent_at.pop(f.fetch_id, None)
        return done

    def shutdown(self) -> None:
        self.connector.shutdown()


def _stall_fetches() -> bool:
    import os

    from semkv.plugins import fault_injection_allowed

    return bool(os.environ.get(FAULT_STALL_FETCHES)) and fault_injection_allowed()
