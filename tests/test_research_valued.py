"""``queryv`` (research only, ``semkv.research.valued``): the question's attention weighted by
each copied token's value error in the probe layers.

- The weights are exactly the cold prefill's values minus the reused ones in the last probe
  layer (its norm, summed over heads) at copied positions, 0 elsewhere; the cache is untouched.
- The weight reaches the engine's selection: ones change nothing against ``query``; a weight
  that zeroes some copied tokens keeps them out while others are left.
- At 1.0 every copied token is recomputed: the cold prefill (bundled model, RAG and reordered
  chunks); below it the weighted ranking picks other tokens than ``query``.

A tiny random Llama (fp32) where no trained model is needed; the bundled SmolLM2 otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from semkv.realize.query import query_select  # noqa: E402
from semkv.realize.recompute import RecomputeKind, RecomputeStrategy  # noqa: E402
from semkv.research import LayerwiseModel, Strategy, plan_reuse, prefill  # noqa: E402
from semkv.research.study import strategy_from_name  # noqa: E402
from semkv.research.valued import value_weights  # noqa: E402
from tests.bundled_lm import bundled_layerwise_model, eval_cluster  # noqa: E402
from tests.tiny_model import tiny_llama  # noqa: E402

LOGIT_ATOL = 1e-3


@pytest.fixture(scope="module")
def lm() -> Iterator[LayerwiseModel]:
    with tiny_llama(3) as model:
        yield model


def _assembled(lm: LayerwiseModel, target: list[int], runs: list[tuple[int, int]]):
    """The cold cache with the copied runs' KV replaced by noise-shifted KV (reused, off)."""
    cache, _ = lm.full_prefill(target, all_logits=False)
    cold = cache.clone()
    gen = torch.Generator().manual_seed(5)
    for start, length in runs:
        for part in (cache.keys, cache.values):
            for layer in part:
                noise = torch.randn(layer[0][:, start:start + length].shape, generator=gen)
                layer[0][:, start:start + length] += 0.5 * noise
    return cache, cold


def _drain(steps):
    while True:
        try:
            next(steps)
        except StopIteration as finished:
            return finished.value


def test_value_weights_are_the_last_probe_layers_value_error_at_copied_positions(lm) -> None:
    target = [(7 * i + 3) % 90 + 5 for i in range(36)]
    runs = [(4, 10), (18, 12)]
    cache, cold = _assembled(lm, target, runs)
    before = cache.clone()

    weight = value_weights(lm, cache, target, runs, probe_layers=2)

    expected = (cold.values[1][0] - before.values[1][0]).norm(dim=2).sum(dim=0)
    copied = [p for s, n in runs for p in range(s, s + n)]
    for p in range(cache.capacity):
        want = float(expected[p]) if p in copied else 0.0
        assert abs(float(weight[p]) - want) < 1e-4 * max(1.0, want), p
    assert all(float(weight[p]) > 0 for p in copied)
    for part, old in ((cache.keys, before.keys), (cache.values, before.values)):
        assert all(torch.equal(a, b) for a, b in zip(part, old, strict=True))


def test_the_weight_steers_the_engines_query_selection(lm) -> None:
    target = [(11 * i + 2) % 90 + 5 for i in range(40)]
    runs = [(2, 14), (18, 14)]
    strategy = RecomputeStrategy(RecomputeKind.QUERY, fraction=0.2, query_tokens=4)
    tokens = dict(enumerate(target))

    def select(weight):
        cache, _ = _assembled(lm, target, runs)
        return _drain(query_select(lm, cache, range(40), runs, tokens, strategy, 40, None, None,
                                   weight=weight)).recomputed

    plain = select(None)
    assert len(plain) == 8  # 20 % of 40 prompt tokens
    assert select(torch.ones(40)) == plain
    shut = torch.ones(40)
    shut[torch.tensor(plain)] = 0.0
    steered = select(shut)
    assert len(steered) == 8 and not set(steered) & set(plain)


def test_queryv_names_round_trip() -> None:
    assert Strategy.queryv(0.15).name == "queryv15"
    assert strategy_from_name("queryv30") == Strategy.queryv(0.3)
    with pytest.raises(ValueError):
        Strategy.queryv(1.5)


@pytest.fixture(scope="module")
def bundled() -> Iterator[LayerwiseModel]:
    with bundled_layerwise_model() as model:
        yield model


@pytest.mark.parametrize("kind", ["multi_passage_rag", "reordered_chunks"])
def test_queryv_at_one_is_cold_and_below_it_selects_otherwise_than_query(bundled, kind) -> None:
    target, store = eval_cluster(bundled, kind)
    plan = plan_reuse(target, store.token_map(), chunk_tokens=32)
    assert plan.reused_tokens > 0, f"{kind}: the plan reuses nothing (nothing to test)"
    _, cold = bundled.full_prefill(target, all_logits=False)
    full = prefill(bundled, target, plan, store, Strategy.queryv(1.0))
    assert full.reused_tokens == 0
    assert torch.allclose(full.logits, cold[-1], atol=LOGIT_ATOL)
    valued = prefill(bundled, target, plan, store, Strategy.queryv(0.2))
    plain = prefill(bundled, target, plan, store, Strategy.query(0.2))
    assert valued.recomputed_tokens == plain.recomputed_tokens  # the same budget
    last = bundled.num_layers - 1
    picked = [{p for layers, pos in r.passes if last in layers for p in pos}
              for r in (valued, plain)]
    assert picked[0] != picked[1]  # the value error re-ranked the question's attention
    assert valued.recompute_fraction > plain.recompute_fraction  # the probe layers ran
