"""The research-only ``oracle`` recompute strategy: copied tokens ranked by their true deviation.

At ratio 1.0 it recomputes every copied token, so it must equal the cold prefill on every
cluster type (as the shared strategies do); at ratio 0 it is ``none``; in between it computes
exactly the budget's tokens more, the ones whose reused KV is furthest from the cold KV over
all layers. Plans come from ``semkv.eval`` clusters at ~256 tokens, tokenized by the bundled
model's tokenizer, run by the tiny random Llama of tests/tiny_engine_model.py (the same
vocabulary; which tokens are recomputed is tested, not quality).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from semkv.realize.recompute import copied_positions, deviation  # noqa: E402
from semkv.research import DonorStore, LayerwiseModel, Strategy, assemble, plan_reuse  # noqa: E402
from semkv.research.recompute import prefill, runs, without  # noqa: E402
from semkv.research.study import strategy_from_name  # noqa: E402
from tests.bundled_lm import eval_cluster  # noqa: E402
from tests.tiny_engine_model import tiny_layerwise_model  # noqa: E402

LOGIT_ATOL = 1e-3
KINDS = ("multi_passage_rag", "reordered_chunks", "quoted_section", "cross_instruction",
         "paraphrased_lead_in")


@pytest.fixture(scope="module")
def lm() -> Iterator[LayerwiseModel]:
    with tiny_layerwise_model() as model:
        yield model


def _cluster(lm: LayerwiseModel, kind: str) -> tuple[list[int], DonorStore]:
    return eval_cluster(lm, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_oracle_at_ratio_one_equals_cold_on_every_cluster_type(lm: LayerwiseModel,
                                                               kind: str) -> None:
    target, store = _cluster(lm, kind)
    plan = plan_reuse(target, store.token_map(), chunk_tokens=32)
    assert plan.reused_tokens > 0, f"{kind}: the plan reuses nothing (nothing to test)"
    _, cold = lm.full_prefill(target)
    result = prefill(lm, target, plan, store, Strategy.oracle(1.0))
    assert result.reused_tokens == 0
    assert torch.allclose(result.logits, cold[-1], atol=LOGIT_ATOL)
    none = prefill(lm, target, plan, store, Strategy.none())
    assert (none.logits - cold[-1]).abs().max() > LOGIT_ATOL  # reuse changed something
    zero = prefill(lm, target, plan, store, Strategy.oracle(0.0))
    assert torch.equal(zero.logits, none.logits) and zero.passes == none.passes


def test_oracle_recomputes_the_budget_with_the_largest_true_deviation(lm: LayerwiseModel) -> None:
    target, store = _cluster(lm, "multi_passage_rag")
    plan = plan_reuse(target, store.token_map(), chunk_tokens=32)
    n = len(target)
    none = prefill(lm, target, plan, store, Strategy.none())
    result = prefill(lm, target, plan, store, Strategy.oracle(0.1))
    assert result.recomputed_tokens == none.recomputed_tokens + round(0.1 * n)
    cold, _ = lm.full_prefill(target)
    cache = assemble(plan, store, lm)
    layers = range(lm.num_layers)
    score = deviation(cold, [cache.keys[i][0, :, :n] for i in layers],
                      [cache.values[i][0, :, :n] for i in layers], 0, n)
    copied = set(copied_positions(runs(plan)))
    picked = [p for p in result.passes[-1][1] if p in copied]
    left = copied - set(picked)
    assert min(float(score[p]) for p in picked) >= max(float(score[p]) for p in left)


def test_oracle_names_round_trip() -> None:
    assert strategy_from_name("oracle20") == Strategy.oracle(0.2)
    assert Strategy.oracle(0.2).name == "oracle20"
    with pytest.raises(ValueError):
        Strategy.oracle(1.5)


@given(st.lists(st.tuples(st.integers(0, 200), st.integers(1, 40)), max_size=6),
       st.sets(st.integers(0, 260)))
def test_without_removes_exactly_the_chosen_positions(raw: list[tuple[int, int]],
                                                      chosen: set[int]) -> None:
    copied, at = [], 0
    for gap, length in raw:  # disjoint increasing runs
        copied.append((at + gap, length))
        at += gap + length
    out = without(copied, chosen)
    assert copied_positions(out) == [p for p in copied_positions(copied) if p not in chosen]
    assert all(length > 0 for _, length in out)
