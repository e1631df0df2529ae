"""``shift`` (research only, ``semkv.research.shift``): query selection, then each copied run's
mean K/V deviation added to the copied tokens it left.

- ``shift_unselected`` moves exactly the run's copied tokens that were not recomputed, values by
  the run's mean deviation, keys by it in the un-rotated frame; recomputed tokens, gaps and
  runs with too few recomputed tokens stay as they are.
- At 1.0 nothing copied is left: the cold prefill (RAG and reordered chunks);
  below it the correction changes the answer's distribution against plain ``query``.

Tiny random Llamas (fp32): in memory where token ids are made up, and on disk with the
bundled model's tokenizer and vocabulary (tests/tiny_engine_model.py) for the ``semkv.eval``
clusters: what is tested is which tokens are recomputed and that 1.0 is cold, not quality.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from semkv.research import LayerwiseModel, Strategy, plan_reuse, prefill  # noqa: E402
from semkv.research.shift import MIN_SAMPLES, shift_unselected  # noqa: E402
from semkv.research.study import strategy_from_name  # noqa: E402
from tests.bundled_lm import eval_cluster  # noqa: E402
from tests.tiny_engine_model import tiny_layerwise_model  # noqa: E402
from tests.tiny_model import tiny_llama  # noqa: E402

LOGIT_ATOL = 1e-3


@pytest.fixture(scope="module")
def lm() -> Iterator[LayerwiseModel]:
    with tiny_llama(3) as model:
        yield model


def test_shift_moves_only_the_runs_unrecomputed_tokens_by_their_mean_deviation(lm) -> None:
    gen = torch.Generator().manual_seed(3)
    n = 40
    cache = lm.empty_cache(n)
    for part in (cache.keys, cache.values):
        for layer in part:
            layer.copy_(torch.randn(layer.shape, generator=gen))
    runs = [(4, 12), (20, 10), (32, 6)]  # the third run gets one recomputed token: too few
    copied = [p for s, length in runs for p in range(s, s + length)]
    index = torch.tensor(copied)
    old_k = [k[0][:, index].clone() for k in cache.keys]
    old_v = [v[0][:, index].clone() for v in cache.values]
    recomputed = {5, 9, 14, 21, 22, 25, 33}
    for p in recomputed:  # what a recompute wrote there
        for part in (cache.keys, cache.values):
            for layer in part:
                layer[0][:, p] += torch.randn(layer[0][:, p].shape, generator=gen)
    before_k = [k.clone() for k in cache.keys]
    before_v = [v.clone() for v in cache.values]

    moved = shift_unselected(lm, cache, runs, recomputed, old_k, old_v, copied)

    assert MIN_SAMPLES == 2
    assert moved == (12 - 3) + (10 - 3)
    rot = lm.rotator
    col = {p: i for i, p in enumerate(copied)}
    for layer in range(lm.num_layers):
        for start, length in runs[:2]:
            run = range(start, start + length)
            picked = torch.tensor([p for p in run if p in recomputed])
            left = torch.tensor([p for p in run if p not in recomputed])
            cols = torch.tensor([col[p] for p in picked.tolist()])
            dv = (before_v[layer][0][:, picked] - old_v[layer][:, cols]).mean(dim=1)
            got_v = cache.values[layer][0][:, left] - before_v[layer][0][:, left]
            assert torch.allclose(got_v, dv[:, None].expand_as(got_v), atol=1e-5)
            dk = (rot.rotate(before_k[layer][0][:, picked], -picked, layer)
                  - rot.rotate(old_k[layer][:, cols], -picked, layer)).mean(dim=1)
            got_k = rot.rotate(cache.keys[layer][0][:, left] - before_k[layer][0][:, left],
                               -left, layer)
            assert torch.allclose(got_k, dk[:, None].expand_as(got_k), atol=1e-4)
        untouched = [p for p in range(n) if p not in range(4, 16) and p not in range(20, 30)]
        untouched += sorted(recomputed & (set(range(4, 16)) | set(range(20, 30))))
        for p in untouched:
            assert torch.equal(cache.keys[layer][0][:, p], before_k[layer][0][:, p]), p
            assert torch.equal(cache.values[layer][0][:, p], before_v[layer][0][:, p]), p


def test_shift_names_round_trip() -> None:
    assert Strategy.shift(0.15).name == "shift15"
    assert strategy_from_name("shift30") == Strategy.shift(0.3)
    with pytest.raises(ValueError):
        Strategy.shift(1.5)


@pytest.fixture(scope="module")
def text_lm() -> Iterator[LayerwiseModel]:
    with tiny_layerwise_model() as model:
        yield model


@pytest.mark.parametrize("kind", ["multi_passage_rag", "reordered_chunks"])
def test_shift_at_one_is_cold_and_below_it_moves_the_answer_from_query(text_lm, kind) -> None:
    target, store = eval_cluster(text_lm, kind)
    plan = plan_reuse(target, store.token_map(), chunk_tokens=32)
    assert plan.reused_tokens > 0, f"{kind}: the plan reuses nothing (nothing to test)"
    _, cold = text_lm.full_prefill(target, all_logits=False)
    full = prefill(text_lm, target, plan, store, Strategy.shift(1.0))
    assert full.reused_tokens == 0
    assert torch.allclose(full.logits, cold[-1], atol=LOGIT_ATOL)
    shifted = prefill(text_lm, target, plan, store, Strategy.shift(0.3))
    plain = prefill(text_lm, target, plan, store, Strategy.query(0.3))
    assert shifted.recomputed_tokens == plain.recomputed_tokens  # the same selection
    assert (shifted.logits - plain.logits).abs().max() > LOGIT_ATOL  # the correction acted
    assert shifted.recompute_fraction > plain.recompute_fraction  # the question ran again
