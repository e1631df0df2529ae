"""Segmented, multi-donor span plans (``semkv.span_plan``): invariants, shapes, agreement."""

from __future__ import annotations

import json
import pickle
import random
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from semkv.span_plan import SpanPlan, SpanSegment, plan_span

B = 16


def seq(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 50000) for _ in range(n)]


def check_plan(plan: SpanPlan, target: Sequence[int], donors: Mapping[str, Sequence[int]],
               local: int) -> None:
    """Every invariant a plan promises the worker, checked from the outside."""
    assert plan.local_tokens == local and plan.block_size == B
    assert plan.span_tokens % B == 0 and local < plan.span_tokens <= len(target) - 1
    at = local
    for seg in plan.segments:
        assert seg.target_start == at and seg.length > 0
        at = seg.end
        if seg.donor_id is None:
            assert seg.donor_start == 0
            continue
        donor = donors[seg.donor_id]
        assert 0 <= seg.donor_start and seg.donor_start + seg.length <= len(donor)
        assert list(donor[seg.donor_start: seg.end - seg.target_start + seg.donor_start]) == \
            list(target[seg.target_start: seg.end])
    assert at == plan.span_tokens
    assert plan.copied_tokens + plan.computed_tokens == plan.num_tokens
    assert len(plan.gap_positions()) == plan.computed_tokens
    assert set(plan.donors) <= set(donors)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[int], dict[str, list[int]], int]:
    vocab = draw(st.sampled_from([4, 50, 50_000]))  # tiny vocabularies make coincidences
    n_donors = draw(st.integers(0, 3))
    donors = {f"d{i}": draw(st.lists(st.integers(0, vocab), max_size=160))
              for i in range(n_donors)}
    target: list[int] = []
    for _ in range(draw(st.integers(1, 6))):
        pool = [d for d in donors.values() if d]
        copy: bool = draw(st.booleans())
        if pool and copy:
            d = draw(st.sampled_from(pool))
            a = draw(st.integers(0, len(d)))
            target += d[a: draw(st.integers(a, len(d)))]
        else:
            target += draw(st.lists(st.integers(0, vocab), min_size=1, max_size=40))
    local = B * draw(st.integers(0, max(0, len(target) // B)))
    return target, donors, local


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.sampled_from([1, 8, 64]), st.sampled_from([1, 4]))
def test_plans_always_cover_the_span_with_identical_tokens(
    case: tuple[list[int], dict[str, list[int]], int], chunk: int, min_run: int,
) -> None:
    target, donors, local = case
    plan = plan_span(target, donors, local_tokens=local, block_size=B, chunk_tokens=chunk,
                     min_run_tokens=min_run)
    if plan is not None:
        check_plan(plan, target, donors, local)
        assert SpanPlan.model_validate_json(plan.model_dump_json()) == plan


def test_three_passages_from_three_donors_in_a_new_order() -> None:
    # Sizes are whole chunks here, so the gaps are exactly the target's own furniture.
    p1, p2, p3 = seq(1, 64), seq(2, 80), seq(3, 96)
    donors = {f"d{i}": seq(10 + i, 16 + 8 * i) + p + seq(20 + i, 12)
              for i, p in enumerate((p1, p2, p3), start=1)}
    head, sep1, sep2, question = seq(30, 16), seq(31, 16), seq(32, 16), seq(33, 24)
    target = head + p3 + sep1 + p1 + sep2 + p2 + question
    plan = plan_span(target, donors, local_tokens=0, block_size=B, chunk_tokens=B)
    assert plan is not None
    check_plan(plan, target, donors, 0)
    assert plan.donors == ("d3", "d1", "d2")
    gaps = {p for s in plan.segments if s.is_gap for p in range(s.target_start, s.end)}
    furniture = {*range(0, 16), *range(112, 128), *range(192, 208), *range(288, len(target))}
    assert gaps <= furniture and len(gaps) == 16 * 3 + plan.span_tokens - 288
    assert plan.copied_tokens == 240 and plan.shifted_tokens == 240
    # With the default chunking the same target still draws on all three donors.
    default = plan_span(target, donors, local_tokens=0, block_size=B)
    assert default is not None and len(default.donors) == 3


def test_another_instruction_in_front_of_a_shared_document() -> None:
    system, doc = seq(40, 32), seq(41, 300)
    donor = system + seq(42, 20) + doc + seq(43, 9)
    target = system + seq(44, 37) + doc + seq(45, 10)
    plan = plan_span(target, {"d": donor}, local_tokens=32, block_size=B)
    assert plan is not None
    check_plan(plan, target, {"d": donor}, 32)
    gap, copy = plan.segments
    assert gap.is_gap and (gap.target_start, gap.length) == (32, 37)
    assert copy.donor_id == "d" and copy.shifted and copy.donor_start == 52
    assert plan.span_tokens == 368 and plan.shifted_tokens == plan.copied_tokens == 368 - 69


def test_identical_prompt_is_one_unshifted_segment() -> None:
    t = seq(50, 200)
    plan = plan_span(t, {"d": t}, local_tokens=0, block_size=B)
    assert plan is not None
    assert plan.segments == (SpanSegment(target_start=0, length=192, donor_id="d", donor_start=0),)
    assert plan.shifted_tokens == 0 and plan.computed_tokens == 0


def test_nothing_worth_copying_is_none() -> None:
    target = seq(60, 200)
    assert plan_span(target, {"d": seq(61, 200)}, local_tokens=0, block_size=B) is None
    assert plan_span(target, {}, local_tokens=0, block_size=B) is None
    assert plan_span(target, {"d": target}, local_tokens=192, block_size=B) is None  # no span
    shared = seq(62, 40) + target[:24]
    small = plan_span(target, {"d": shared}, local_tokens=0, block_size=B)
    assert small is not None and small.copied_tokens == 24
    assert plan_span(target, {"d": shared}, local_tokens=0, block_size=B,
                     min_copied_tokens=32) is None


def test_caps_and_arguments() -> None:
    t = seq(70, 200)
    capped = plan_span(t, {"d": t}, local_tokens=16, block_size=B, max_span_tokens=40)
    assert capped is not None and (capped.local_tokens, capped.span_tokens) == (16, 48)
    assert capped.segments[0].donor_start == 16  # clipped runs keep their donor alignment
    with pytest.raises(ValueError, match="multiple"):
        plan_span(t, {"d": t}, local_tokens=8, block_size=B)
    with pytest.raises(ValueError, match="chunk_tokens"):
        plan_span(t, {"d": t}, local_tokens=0, block_size=B, chunk_tokens=0)


def _seg(start: int, length: int, donor: str | None = None, at: int = 0) -> SpanSegment:
    return SpanSegment(target_start=start, length=length, donor_id=donor, donor_start=at)


@pytest.mark.parametrize(("segments", "problem"), [
    ((_seg(0, 16), _seg(20, 12, "d", 3)), "leaves a hole"),
    ((_seg(0, 20), _seg(16, 16, "d", 3)), "overlaps"),
    ((_seg(16, 16),), "expected 0"),
    ((_seg(0, 16), _seg(16, 8, "d")), "not at span_tokens"),
])
def test_invalid_plans_name_the_problem(segments: tuple[SpanSegment, ...], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        SpanPlan(block_size=B, local_tokens=0, span_tokens=32, segments=segments)


def test_invalid_values() -> None:
    with pytest.raises(ValueError, match="multiples of block_size"):
        SpanPlan(block_size=B, local_tokens=0, span_tokens=30, segments=(_seg(0, 30),))
    with pytest.raises(ValueError, match="must exceed"):
        SpanPlan(block_size=B, local_tokens=32, span_tokens=32, segments=(_seg(32, 1),))
    with pytest.raises(ValueError, match="donor_start 0"):
        _seg(0, 4, None, 3)
    with pytest.raises(ValueError):
        _seg(0, 0, "d")
    with pytest.raises(ValueError):
        SpanPlan(block_size=B, local_tokens=0, span_tokens=32, segments=())


def test_round_trips_and_carries_no_token_ids() -> None:
    doc = seq(80, 120)
    target = seq(81, 30) + doc + seq(82, 5)
    plan = plan_span(target, {"d": seq(83, 3) + doc}, local_tokens=0, block_size=B)
    assert plan is not None
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert SpanPlan.model_validate_json(plan.model_dump_json()) == plan
    dumped = json.loads(plan.model_dump_json())
    assert set(dumped) == {"block_size", "local_tokens", "span_tokens", "segments"}
    assert all(set(s) == {"target_start", "length", "donor_id", "donor_start"}
               for s in dumped["segments"])
    assert plan.summary()["copied"] == plan.copied_tokens
    with pytest.raises(ValueError):
        plan.segments[0].__class__.model_validate({**dumped["segments"][0], "token_ids": [1]})


@pytest.mark.parametrize("seed", range(40))
def test_research_plan_reuse_agrees_on_reused_positions(seed: int) -> None:
    pytest.importorskip("torch")  # semkv.research needs it; the decision itself does not
    from semkv.research.assembly import plan_reuse

    rng = random.Random(seed)
    pieces = [seq(1000 + 10 * seed + i, rng.randrange(20, 120)) for i in range(4)]
    donors = {f"d{i}": seq(seed, rng.randrange(0, 30)) + p + seq(seed + 1, 7)
              for i, p in enumerate(pieces[:3])}
    order = rng.sample(pieces, len(pieces))
    target = [t for p in order for t in seq(seed + 2, rng.randrange(1, 12)) + p]
    local = B * rng.randrange(0, 3)
    chunk = rng.choice([16, 32, 64])
    research = plan_reuse(target, donors, chunk_tokens=chunk)
    plan = plan_span(target, donors, local_tokens=local, block_size=B, chunk_tokens=chunk)
    span = plan.span_tokens if plan is not None else local
    want = {(s.target_start + i, s.donor_id, s.donor_start + i)
            for s in research.segments for i in range(s.length)
            if local <= s.target_start + i < span}
    got = {(s.target_start + i, s.donor_id, s.donor_start + i)
           for s in (plan.segments if plan is not None else ()) if not s.is_gap
           for i in range(s.length)}
    assert got == want
