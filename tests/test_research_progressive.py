"""The research-only ``progressive`` recompute strategy (per-layer selection, issue #25).

CacheBlend's gradual filtering: after the probe layers the selected copied tokens shrink layer
by layer, each layer re-ranking the ones still selected by its own deviation. At ratio 1.0 it
computes every copied token through every layer, so it must equal the cold prefill (as every
strategy does); at ratio 0 it is ``blend`` at 0; in between the sets are nested and their sizes
follow ``progressive_sizes``. Plans from ``semkv.eval`` clusters
(the tiny model of tests/tiny_engine_model.py, the bundled model's vocabulary).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from semkv.realize.recompute import copied_positions  # noqa: E402
from semkv.research import LayerwiseModel, Strategy, plan_reuse  # noqa: E402
from semkv.research.recompute import prefill, progressive_sizes, runs  # noqa: E402
from semkv.research.study import strategy_from_name  # noqa: E402
from tests.bundled_lm import eval_cluster  # noqa: E402
from tests.tiny_engine_model import tiny_layerwise_model  # noqa: E402

LOGIT_ATOL = 1e-3


@pytest.fixture(scope="module")
def lm() -> Iterator[LayerwiseModel]:
    with tiny_layerwise_model() as model:
        yield model


@pytest.mark.parametrize("kind", ["multi_passage_rag", "reordered_chunks", "cross_instruction"])
def test_progressive_at_ratio_one_equals_cold(lm: LayerwiseModel, kind: str) -> None:
    target, store = eval_cluster(lm, kind)
    plan = plan_reuse(target, store.token_map(), chunk_tokens=32)
    assert plan.reused_tokens > 0
    _, cold = lm.full_prefill(target)
    result = prefill(lm, target, plan, store, Strategy.progressive(1.0))
    assert result.reused_tokens == 0 and result.recompute_fraction == pytest.approx(1.0)
    assert torch.allclose(result.logits, cold[-1], atol=LOGIT_ATOL)
    zero = prefill(lm, target, plan, store, Strategy.progressive(0.0))
    blend = prefill(lm, target, plan, store, Strategy.blend(0.0))
    assert torch.allclose(zero.logits, blend.logits, atol=1e-5)
    assert zero.recompute_fraction == pytest.approx(blend.recompute_fraction)


def test_progressive_sets_are_nested_and_sized_by_the_schedule(lm: LayerwiseModel) -> None:
    target, store = eval_cluster(lm, "multi_passage_rag")
    plan = plan_reuse(target, store.token_map(), chunk_tokens=32)
    n = len(target)
    copied = set(copied_positions(runs(plan)))
    result = prefill(lm, target, plan, store, Strategy.progressive(0.1))
    per_layer = [[p for p in at if p in copied] for _, at in result.passes[1:]]
    sizes = progressive_sizes(round(0.1 * n), len(copied), lm.num_layers - 2)
    assert [len(s) for s in per_layer] == sizes and sizes[0] > sizes[-1]
    assert all(set(b) <= set(a) for a, b in zip(per_layer, per_layer[1:], strict=False))
    assert result.recomputed_tokens == n - len(copied) + sizes[-1]


def test_progressive_schedule_and_names() -> None:
    assert progressive_sizes(10, 100, 5) == [20, 18, 15, 12, 10]
    assert progressive_sizes(80, 100, 3) == [100, 90, 80]  # capped at the copied positions
    assert progressive_sizes(10, 100, 1) == [10] and progressive_sizes(10, 100, 0) == []
    assert strategy_from_name("progressive20") == Strategy.progressive(0.2)
    assert Strategy.progressive(0.2).name == "progressive20"
    with pytest.raises(ValueError):
        Strategy.progressive(-0.1)
