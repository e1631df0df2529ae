"""``query_valued`` (``semkv.realize.query``; research's ``queryv<percent>``): the question's
attention weighted by each copied token's value error in the probe layers.

- The weight is exactly the cold prefill's values minus the reused ones in the last probe
  layer (its norm, summed over heads) at copied positions, 0 elsewhere; the probe leaves the
  fresh KV in its layers for the positions it ran and nothing else changes.
- A run reused exactly (no value error) is never picked while a run reused with error has
  tokens left, though the question's attention alone picks from it.
- At 1.0 every copied token is recomputed: the cold prefill (RAG and reordered chunks;
  every cluster type in ``tests/test_realize_query.py``); below it the weighted ranking
  picks other tokens than ``query``. Engine and research select alike there too.

Tiny random Llamas (fp32): in memory where token ids are made up, and on disk with the
bundled model's tokenizer and vocabulary (tests/tiny_engine_model.py) for the ``semkv.eval``
clusters: what is tested is which tokens are recomputed and that 1.0 is cold, not quality.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from semkv.realize.query import query_select, value_error  # noqa: E402
from semkv.realize.recompute import RecomputeKind, RecomputeStrategy  # noqa: E402
from semkv.research import LayerwiseModel, Strategy, plan_reuse, prefill  # noqa: E402
from semkv.research.study import strategy_from_name  # noqa: E402
from tests.bundled_lm import eval_cluster  # noqa: E402
from tests.tiny_engine_model import tiny_layerwise_model  # noqa: E402
from tests.tiny_model import tiny_llama  # noqa: E402

LOGIT_ATOL = 1e-3
N = 40


@pytest.fixture(scope="module")
def lm() -> Iterator[LayerwiseModel]:
    with tiny_llama(3) as model:
        yield model


def _assembled(lm: LayerwiseModel, target: list[int], noisy: list[tuple[int, int]]):
    """The cold cache with the ``noisy`` runs' KV shifted by noise (reused with error)."""
    cache, _ = lm.full_prefill(target, all_logits=False)
    cold = cache.clone()
    gen = torch.Generator().manual_seed(5)
    for start, length in noisy:
        for part in (cache.keys, cache.values):
            for layer in part:
                shape = layer[0][:, start:start + length].shape
                layer[0][:, start:start + length] += 0.5 * torch.randn(shape, generator=gen)
    return cache, cold


def _drain(steps):
    while True:
        try:
            next(steps)
        except StopIteration as finished:
            return finished.value


def _target() -> list[int]:
    return [(11 * i + 2) % 90 + 5 for i in range(N)]


def test_value_error_is_the_last_probe_layers_value_error_at_copied_positions(lm) -> None:
    target, runs = _target(), [(4, 10), (18, 12)]
    cache, cold = _assembled(lm, target, runs)
    before = cache.clone()
    copied = [p for s, n in runs for p in range(s, s + n)]

    weight = _drain(value_error(lm, cache, range(N), copied, dict(enumerate(target)), 2, None,
                                None))

    expected = (cold.values[1][0] - before.values[1][0]).norm(dim=2).sum(dim=0)
    for p in range(N):
        want = float(expected[p]) if p in copied else 0.0
        assert abs(float(weight[p]) - want) < 1e-4 * max(1.0, want), p
    assert all(float(weight[p]) > 0 for p in copied)
    for layer in range(lm.num_layers):  # fresh KV in the probe layers, nothing above moved
        for part, was, fresh in ((cache.keys, before.keys, cold.keys),
                                 (cache.values, before.values, cold.values)):
            if layer < 2:
                assert torch.allclose(part[layer], fresh[layer], atol=1e-4), layer
            else:
                assert torch.equal(part[layer], was[layer]), layer


def test_an_exactly_reused_run_is_not_picked_while_one_with_error_has_tokens_left(lm) -> None:
    target, noisy, exact = _target(), (2, 16), (20, 16)
    runs = [noisy, exact]
    tokens = dict(enumerate(target))

    def select(kind: RecomputeKind) -> list[int]:
        cache, _ = _assembled(lm, target, [noisy])
        strategy = RecomputeStrategy(kind, fraction=0.2, query_tokens=4)
        return _drain(query_select(lm, cache, range(N), runs, tokens, strategy, N, None,
                                   None)).recomputed

    in_exact = set(range(exact[0], exact[0] + exact[1]))
    plain = select(RecomputeKind.QUERY)
    assert set(plain) & in_exact, plain  # the question's attention alone reads the exact run
    valued = select(RecomputeKind.QUERY_VALUED)
    assert len(valued) == len(plain) == 8  # 20 % of 40 prompt tokens
    assert not set(valued) & in_exact, valued


def test_queryv_names_round_trip() -> None:
    assert Strategy.queryv(0.15).name == "queryv15"
    assert strategy_from_name("queryv30") == Strategy.queryv(0.3)
    with pytest.raises(ValueError):
        Strategy.queryv(1.5)


@pytest.fixture(scope="module")
def text_lm() -> Iterator[LayerwiseModel]:
    with tiny_layerwise_model() as model:
        yield model


@pytest.mark.parametrize("kind", ["multi_passage_rag", "reordered_chunks"])
def test_queryv_at_one_is_cold_and_below_it_selects_otherwise_than_query(text_lm, kind) -> None:
    target, store = eval_cluster(text_lm, kind)
    plan = plan_reuse(target, store.token_map(), chunk_tokens=32)
    assert plan.reused_tokens > 0, f"{kind}: the plan reuses nothing (nothing to test)"
    _, cold = text_lm.full_prefill(target, all_logits=False)
    full = prefill(text_lm, target, plan, store, Strategy.queryv(1.0))
    assert full.reused_tokens == 0
    assert torch.allclose(full.logits, cold[-1], atol=LOGIT_ATOL)
    valued = prefill(text_lm, target, plan, store, Strategy.queryv(0.2))
    plain = prefill(text_lm, target, plan, store, Strategy.query(0.2))
    assert valued.recomputed_tokens == plain.recomputed_tokens  # the same budget
    last = text_lm.num_layers - 1
    picked = [{p for layers, pos in r.passes if last in layers for p in pos}
              for r in (valued, plain)]
    assert picked[0] != picked[1]  # the value error re-ranked the question's attention
    assert valued.recompute_fraction > plain.recompute_fraction  # the probe layers ran
