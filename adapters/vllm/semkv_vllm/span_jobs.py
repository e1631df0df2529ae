"""Worker side: each realized span from its ``RealizeOp`` to its one report to vLLM.

Per op: its donor fetches (``donor_store: lmcache``) -> the realization job
(``realization.SpanRealizer``) -> the write into the request's blocks -> reported received
(``finished_recving``), or reported invalid and received (vLLM recomputes those blocks under
``kv_load_failure_policy: recompute``). Driven by ``WorkerSide`` on the main thread:
``start`` in ``start_load_kv``, ``advance`` in ``get_finished`` (after the step's forward).

NOTE: an op whose request was aborted (vLLM's ``finished_req_ids`` of the step) is cancelled
at the next ``advance``: its job is dropped, nothing is written, and it is reported received
at once, so vLLM can free its blocks (``transfers_cancelled``). Its fetches still run to their
end inside ``HostFetcher`` (their slots stay fenced until then, and a retrieve releases the
server's read locks), but nobody waits for them.
NOTE: an op still unreported ``transfer_timeout_s`` after it arrived (a retrieve the server
never answers, a realization starved by busy steps) is reported invalid: vLLM recomputes the
span, the request's output is the cold one (``transfer_timeouts``, ``load_failed``). Wall-clock
deadlines differ between ranks: realized spans are refused under tensor parallelism.
NOTE: a realization whose K or V holds a NaN or inf is never written: reported invalid and
recomputed (``realize_nonfinite``, ``load_failed`` why ``nonfinite_kv``).
NOTE: a realization that ends well is the cost gate's sample (``cost_gate.op_work`` of the op,
its busy chunks and its write, timed on the realizer's device clock); failed, cancelled and
expired ones are not (their time says nothing about the rates).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from semkv.log import get_logger
from semkv.metrics import CounterBag
from semkv_vllm.cost_gate import op_work
from semkv_vllm.metadata import RealizeOp
from semkv_vllm.realization import Realized, SpanRealizer
from semkv_vllm.step_timing import Timings
from semkv_vllm.worker_state import SlotGenerations, WorkerReports

log = get_logger("semkv.vllm.worker")


class SpanJobs:
    """Handed what it needs by ``WorkerSide``: the report sets it fills, the slots' generations
    it checks (and marks, for fetched donors), the worker's counters and step timings, and two
    of the worker's own actions (``drain_saves`` before a written span is checked; ``floor``,
    the ``kv_floor`` option over a span's blocks in every layer). ``realizer``, its ``shape``
    (layers, block size) and ``fetcher`` are set by the worker once known (start-up)."""

    def __init__(self, reports: WorkerReports, slots: SlotGenerations, stats: CounterBag,
                 timings: Timings, timeout_s: float, *, drain_saves: Callable[[], None],
                 floor: Callable[[RealizeOp], None]) -> None:
        self.reports = reports
        self.slots = slots
        self.stats = stats
        self.timings = timings
        self.timeout_s = timeout_s
        self._drain_saves = drain_saves
        self._floor = floor
        self.realizer: SpanRealizer | None = None
        self.shape: tuple[int, int] | None = None
        self.fetcher: Any = None  # lmcache_fetch.HostFetcher (donor_store: lmcache)
        self._awaiting: dict[str, tuple[RealizeOp, set[str]]] = {}  # rid -> op, fetches left
        self._open: dict[str, tuple[RealizeOp, float]] = {}  # rid -> op, its deadline

    def __len__(self) -> int:
        """Ops not yet reported (0 once every realization has been answered)."""
        return len(self._open)

    def _stale(self, op: RealizeOp) -> bool:
        return not all(self.slots.current(c.slots, c.generations) for c in op.copies)

    # -- from the op's arrival to its job --------------------------------------------------
    def start(self, op: RealizeOp) -> None:
        self._open[op.request_id] = (op, time.monotonic() + self.timeout_s)
        if not op.fetches:
            self._submit(op)
            return
        fetcher = self.fetcher
        if fetcher is None:
            self.fail(op, "fetch_unavailable")
            return
        try:
            for fetch in op.fetches:
                fetcher.submit(fetch)
        except Exception as exc:  # noqa: BLE001 - a failed fetch becomes a recompute
            self.fail(op, type(exc).__name__)
            return
        self._awaiting[op.request_id] = (op, {f.fetch_id for f in op.fetches})

    def _advance_fetches(self, idle: bool) -> None:
        """Mark landed fetches' slots current; submit the realizations they complete."""
        fetcher = self.fetcher
        if fetcher is None or not (self._awaiting or fetcher.busy):
            return
        try:
            done, errors = fetcher.poll(wait=idle and bool(self._awaiting))
        except Exception as exc:  # noqa: BLE001 - the shared store failed: recompute them all
            for op, _ in list(self._awaiting.values()):
                self.fail(op, type(exc).__name__)
            self._awaiting.clear()
            return
        for fetch in done:
            ok = not errors.intersection(fetch.slots)
            self.slots.mark(fetch.slots, fetch.generations, ok=ok)
            self.stats.inc("fetched_blocks", "landed" if ok else "failed",
                           amount=len(fetch.slots))
        landed = {f.fetch_id for f in done}
        for rid, (op, left) in list(self._awaiting.items()):
            left -= landed
            if not left:
                del self._awaiting[rid]
                self._submit(op)  # a failed fetch leaves its copies stale

    def _submit(self, op: RealizeOp) -> None:
        stale = self._stale(op)
        if self.realizer is None or stale:
            self.fail(op, "stale_slot" if stale else "realization_unavailable")
            return
        self.realizer.submit(op)

    # -- every step ------------------------------------------------------------------------
    def advance(self, finished: set[str], *, idle: bool, wait: bool = False) -> None:
        """Cancel the aborted, advance fetches and jobs, expire what is past its deadline."""
        self._cancel(finished)
        self._advance_fetches(idle)
        realizer = self.realizer
        if realizer is not None:
            for done in realizer.advance(idle=idle, finish=wait):
                self._finish(done)
        self._expire()

    def _cancel(self, finished: set[str]) -> None:
        for rid in finished & self._open.keys():
            op, _ = self._open.pop(rid)
            self._awaiting.pop(rid, None)
            if self.realizer is not None:
                self.realizer.cancel(rid)
            self.stats.inc("transfers_cancelled")
            self.reports.finished_recving.add(rid)  # nothing written; vLLM frees its blocks
            log.info("realize_cancelled", request_id=rid, blocks=len(op.block_ids))

    def _expire(self) -> None:
        now = time.monotonic()
        for rid, (op, deadline) in list(self._open.items()):
            if now < deadline:
                continue
            self._awaiting.pop(rid, None)
            if self.realizer is not None:
                self.realizer.cancel(rid)
            self.stats.inc("transfer_timeouts")
            self.fail(op, "deadline")

    # -- the end of one op -----------------------------------------------------------------
    def _finish(self, done: Realized) -> None:
        op = done.op
        self.stats.observe("realize_seconds", done.seconds)
        if op.request_id not in self._open:
            return  # cancelled or expired meanwhile: already reported
        if done.error is not None:
            self.fail(op, done.error)
            return
        # NOTE: slots are pinned for the realization, but an engine reset unpins everything and
        # later saves may have rewritten a slot while it was read: then the KV is not the donor's.
        if op.copies:
            self._drain_saves()
            if self._stale(op):
                self.fail(op, "slot_rewritten")
                return
        realizer = self.realizer
        assert realizer is not None
        if not realizer.finite(done):
            self.stats.inc("realize_nonfinite")
            self.fail(op, "nonfinite_kv")
            return
        try:
            start = self.timings.clock.mark()
            realizer.write(done)
            self._floor(op)
            spans = [*done.spans, (start, self.timings.clock.mark())]
        except Exception as exc:  # noqa: BLE001
            self.fail(op, type(exc).__name__)
            return
        if self.shape is not None and op.kv_floor is None:  # rounding is not realization work
            layers, block = self.shape
            self.timings.realized(op_work(op, done.recomputed, layers=layers, block_size=block),
                                  spans)
        del self._open[op.request_id]
        r = self.reports
        r.loaded[op.request_id] = len(op.block_ids)
        r.recomputed[op.request_id] = len(done.recomputed)
        self.stats.inc("loaded_blocks", amount=len(op.block_ids))
        r.finished_recving.add(op.request_id)

    def fail(self, op: RealizeOp, why: str) -> None:
        self._open.pop(op.request_id, None)
        # a window group's dropped blocks, or several groups: per request (RealizeOp)
        self.reports.record_failure(op.request_id, op.block_ids,
                                    per_request=op.groups is not None, received=True)
        self.stats.inc("materialize_failed")
        self.stats.inc("invalid_blocks", amount=len(op.block_ids))
        log.warning("realize_failed", request_id=op.request_id, blocks=len(op.block_ids),
                    why=why)
