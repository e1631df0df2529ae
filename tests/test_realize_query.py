"""Query-aware selection (``semkv.realize.query``: ``query``, ``first_k_query``, ``query_valued``).

- The runners' attention accumulator is the model's own attention (transformers' eager
  ``output_attentions``), summed over layers, heads and the scored queries.
- Research and the engine's way of realizing a span (a cache holding the exact local prefix,
  the copies placed, ``recompute`` over the span with the prompt's tail supplied) select the
  same positions for the same plan; the selection is the top of the tail's attention.
- At fraction 1.0 both strategies equal the cold prefill on every cluster type of
  ``semkv.eval``; at 0 ``query`` is ``none``.
- In the engine-style run the probe writes only the cache's tail, never the span's positions
  before the first selected token (what the worker writes back holds no probe state).

Tiny random Llamas (fp32): in memory where token ids are made up, and on disk with the
bundled model's tokenizer and vocabulary (tests/tiny_engine_model.py) for the ``semkv.eval``
clusters: what is tested is which tokens are recomputed and that 1.0 is cold, not quality.
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
    cache_tokens,
    needed_positions,
    tail_positions,
)
from semkv.research import DonorStore, LayerwiseModel, Strategy, plan_reuse, prefill  # noqa: E402
from semkv.research.recompute import plan_of_span  # noqa: E402
from semkv.research.study import strategy_from_name  # noqa: E402
from semkv.span_plan import SpanPlan  # noqa: E402
from tests.bundled_lm import eval_cluster  # noqa: E402
from tests.tiny_engine_model import tiny_layerwise_model  # noqa: E402
from tests.tiny_model import (  # noqa: E402
    engine_style_recomputed,
    research_recomputed,
    tiny_llama,
    two_donor_case,
)

BLOCK = 16
LOGIT_ATOL = 1e-3
KINDS = ("multi_passage_rag", "reordered_chunks", "quoted_section", "cross_instruction",
         "paraphrased_lead_in")


@pytest.fixture(scope="module")
def lm() -> Iterator[LayerwiseModel]:
    with tiny_llama(5) as model:
        yield model


def _tokens(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(10, 300, (n,), generator=gen).tolist()


@pytest.fixture(scope="module")
def case(lm: LayerwiseModel) -> tuple[list[int], SpanPlan, DonorStore]:
    """Two donors' passages in a new order behind another lead-in, a 40-token question."""
    target, plan, store = two_donor_case(lm, 40, BLOCK)
    assert plan.span_tokens < len(target) - 8  # the question lies after the span
    return target, plan, store


def test_the_attention_accumulator_is_the_models_own_attention(lm) -> None:
    ids = _tokens(torch.Generator().manual_seed(9), 90)
    scored = 12
    with torch.no_grad():
        out = lm.model(torch.tensor([ids]), output_attentions=True)
    want = sum(a[0, :, -scored:, :].sum(dim=(0, 1)) for a in out.attentions)
    cache = lm.empty_cache(len(ids))
    lm.run_layers(cache, lm.embed(ids[:-scored]), torch.arange(len(ids) - scored))
    got = torch.zeros(len(ids))
    lm.run_layers(cache, lm.embed(ids[-scored:]), torch.arange(len(ids) - scored, len(ids)),
                  attention=got)
    assert torch.allclose(got, want, atol=1e-4)
    assert float(got.sum()) == pytest.approx(scored * lm.num_layers * lm.num_heads, rel=1e-5)


@pytest.mark.parametrize("fraction", [0.1, 0.25, 1.0])
@pytest.mark.parametrize("kind", ["query", "first_k_query", "query_valued"])
def test_engine_and_research_select_the_same_positions(lm, case, kind, fraction) -> None:
    target, plan, store = case
    strategy = RecomputeStrategy(RecomputeKind(kind), fraction=fraction, first_k=4,
                                 query_tokens=16)
    mine = engine_style_recomputed(lm, target, plan, store, strategy)
    research = {"query": Strategy.query(fraction, 16),
                "first_k_query": Strategy.first_k_query(4, fraction, 16),
                "query_valued": Strategy.queryv(fraction, 16)}[kind]
    assert mine == research_recomputed(lm, target, plan, store, research)
    take = budget(strategy, len(target), plan.copied_tokens)
    runs = [(s.target_start, s.length) for s in plan.segments if s.donor_id is not None]
    halo = {start + i for start, length in runs for i in range(min(4, length))}
    if kind != "first_k_query":
        assert len(mine) == take
    else:
        assert halo <= set(mine) and len(mine) == max(len(halo), take)
    if fraction == 1.0:
        assert len(mine) == plan.copied_tokens


def test_query_picks_the_copied_tokens_the_question_attends_to_most(lm, case) -> None:
    """The selection against an independent score: the cold-free assembled prompt (every
    non-copied position computed over the reused KV, as ``none``) run once more for the
    question's last ``query_tokens`` with transformers' own attention weights."""
    target, plan, store = case
    n, q = len(target), 16
    reuse = plan_of_span(plan, n)
    none = prefill(lm, target, reuse, store, Strategy.none())
    queries = list(range(n - q, n))
    score = torch.zeros(n)
    lm.run_layers(none.cache, lm.embed([target[p] for p in queries]), torch.tensor(queries),
                  attention=score)
    copied = [p for p in range(n) if reuse.reused[p]]
    take = round(0.1 * n)
    want = sorted(sorted(copied, key=lambda p: (-float(score[p]), p))[:take])
    assert research_recomputed(lm, target, plan, store, Strategy.query(0.1, q)) == want


def test_the_probe_writes_only_the_tail_and_gaps_before_any_recompute(lm, case) -> None:
    target, plan, store = case
    runs = [(s.target_start, s.length) for s in plan.segments if s.donor_id is not None]
    tail = tail_positions(runs, len(target))
    writes: list[int] = []
    strategy = RecomputeStrategy(RecomputeKind.QUERY, fraction=0.0, query_tokens=16)
    real = lm.run_layers

    def spy(c, hidden, positions, layers=None, **kw):  # type: ignore[no-untyped-def]
        writes.extend(int(p) for p in positions)
        return real(c, hidden, positions, layers, **kw)

    lm.run_layers = spy  # type: ignore[method-assign]
    try:
        assert engine_style_recomputed(lm, target, plan, store, strategy) == []
    finally:
        del lm.run_layers
    copied = {p for start, length in runs for p in range(start, start + length)}
    assert not copied & set(writes)  # no copied token's KV is touched at fraction 0
    assert set(writes) >= set(tail) and tail.stop == len(target) > plan.span_tokens


def test_the_tail_travels_with_the_op_only_for_query() -> None:
    span, runs = range(16, 64), [(20, 10), (40, 20)]
    query = RecomputeStrategy(RecomputeKind.QUERY)
    assert needed_positions(span, runs, query, 80) == list(range(16, 80))
    assert cache_tokens(span, runs, query, 80) == 80
    assert tail_positions(runs, 80) == range(60, 80)
    blend = RecomputeStrategy(RecomputeKind.BLEND)
    assert needed_positions(span, runs, blend, 80) == list(span)
    assert cache_tokens(span, runs, blend, 80) == 64


def test_query_names_round_trip() -> None:
    for strategy in (Strategy.query(0.15), Strategy.first_k_query(16, 0.3),
                     Strategy.first_k_blend(16, 0.15), Strategy.queryv(0.2)):
        assert strategy_from_name(strategy.name) == strategy
    with pytest.raises(ValueError):
        strategy_from_name("first16+oracle15")
    with pytest.raises(ValueError):
        RecomputeStrategy(RecomputeKind.QUERY, query_tokens=0)


@pytest.fixture(scope="module")
def text_lm() -> Iterator[LayerwiseModel]:
    with tiny_layerwise_model() as model:
        yield model


@pytest.mark.parametrize("kind", KINDS)
def test_query_at_fraction_one_equals_cold_on_every_cluster_type(text_lm, kind) -> None:
    target, store = eval_cluster(text_lm, kind)
    plan = plan_reuse(target, store.token_map(), chunk_tokens=32)
    assert plan.reused_tokens > 0, f"{kind}: the plan reuses nothing (nothing to test)"
    _, cold = text_lm.full_prefill(target, all_logits=False)
    for strategy in (Strategy.query(1.0), Strategy.first_k_query(16, 1.0), Strategy.queryv(1.0)):
        result = prefill(text_lm, target, plan, store, strategy)
        assert result.reused_tokens == 0, strategy.name
        assert torch.allclose(result.logits, cold[-1], atol=LOGIT_ATOL), strategy.name
    none = prefill(text_lm, target, plan, store, Strategy.none())
    assert (none.logits - cold[-1]).abs().max() > LOGIT_ATOL  # reuse changed something
    zero = prefill(text_lm, target, plan, store, Strategy.query(0.0))
    assert torch.allclose(zero.logits, none.logits, atol=1e-4)
    assert zero.reused_tokens == none.reused_tokens
