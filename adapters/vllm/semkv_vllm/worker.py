"""Worker side of the connector: executes the scheduler's copies, reports what really happened.

Per step (vLLM's order): ``bind_connector_metadata`` -> ``start_load_kv`` (before the forward
when the step has a synchronous load, else after it) -> per layer ``wait_for_layer_load`` /
``save_kv_layer`` -> ``wait_for_save`` -> ``get_transfer_results`` ->
``get_block_ids_with_load_errors`` -> ``build_connector_worker_meta``.

NOTE: a load whose slot does not hold the generation the scheduler expects (never saved, or
overwritten) is not copied; its blocks are reported invalid so vLLM recomputes them.
NOTE: verified/semantic loads (``LoadOp.segments``) go token by token: donor pages are read
through the ``PageLayout`` probed from the engine's own cache-write kernel, keys are moved to
their new positions with ``RopeShift``, and whole target blocks are written back. Without a
known layout (or a needed shift without a RopeShift) such a load fails and is recomputed.
NOTE: with several KV-cache groups (vLLM's hybrid manager) each layer is copied with its own
group's blocks (``LoadOp.groups`` / ``SaveOp.groups``); a position whose block a window group
does not hold (``NO_BLOCK``: vLLM's null block) is neither read nor written. A failed load is
then reported per request (``take_failed_recving``), never as block ids, which vLLM maps back to
requests for one group only.
NOTE: saves start in ``wait_for_save``, after the whole forward, and only cover blocks whose
every token was computed by the end of this step (the scheduler guarantees it), so chunked
prefill never stores a partial block.
NOTE: realized spans (``RealizeOp``, non-prefix reuse) are advanced between steps on the main
thread (``span_jobs.py``, ``realization.py``): submitted in ``start_load_kv``, computed a
bounded amount per step in ``take_finished_recving`` (all of it in a step that scheduled no
token), then written into the request's blocks and reported received, or reported invalid;
cancelled when their request is aborted, failed past ``transfer_timeout_s``. A ``RealizeOp``
with ``fetches`` (donors in a shared KV store) first retrieves them into its private slots
(``lmcache_fetch.HostFetcher``); it is submitted once all of them have landed.
NOTE: the cost gate's samples (``cost_gate.py``): the forward of every step whose metadata
carries its work is timed between ``bind`` and ``wait_for_save``, less semkv's own
``start_load_kv`` (``step_timing.py``); every realization that ends well is timed (its busy
chunks and its write); the realization runner is timed on synthetic spans once, when the
connector hands it over (``realize_calibration.calibrate``). All reported with the next step.
NOTE: with ``async_save`` the copy runs on one background thread, off the step's critical path
(the first token is sampled and sent while it runs). It reads blocks that are complete and
still owned by their request, which nothing rewrites until vLLM frees and reallocates them; a
freed block is zeroed or overwritten only by a later step, and every later step first calls
``handle_preemptions`` (vLLM's hook for async saves), where in-flight saves are drained. Loads
also drain first, so a load never reads a slot that is still being written.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from semkv.cost import RealizeWork
from semkv.log import get_logger
from semkv.metrics import CounterBag
from semkv_vllm.block_copy import allocate_store, copy_blocks
from semkv_vllm.metadata import (
    NO_BLOCK,
    LoadOp,
    RealizeOp,
    SaveOp,
    SemkvMetadata,
    SemkvWorkerMetadata,
)
from semkv_vllm.options import round_blocks_fp8
from semkv_vllm.page_layout import PageLayout
from semkv_vllm.realization import SpanRealizer
from semkv_vllm.realize_calibration import calibrate
from semkv_vllm.rope import RopeShift
from semkv_vllm.span_jobs import SpanJobs
from semkv_vllm.step_timing import Clock, Timings
from semkv_vllm.worker_state import SlotGenerations, WorkerReports

log = get_logger("semkv.vllm.worker")


@dataclass(frozen=True)
class _SaveResult:
    saved: int  # blocks
    seconds: float


class WorkerSide:
    def __init__(self, num_slots: int, *, layerwise: bool = False,
                 rope: RopeShift | None = None, async_save: bool = False,
                 transfer_timeout_s: float = 120.0,
                 groups: list[list[str]] | None = None) -> None:
        self.num_slots = num_slots
        # layer name -> its KV-cache group (an op's ``groups[g]`` are that group's blocks)
        self.group_of = {name: g for g, names in enumerate(groups or []) for name in names}
        self.layerwise = layerwise
        self.async_save = async_save
        self._saver: ThreadPoolExecutor | None = None
        self._saves_in_flight: list[Future[_SaveResult]] = []
        self.rope = rope
        self.layout: PageLayout | None = None  # set when the pages' interior is known
        # id(op) -> (op, map): the op is kept so that an id reused by a later op never matches
        self._maps: dict[int, tuple[LoadOp, torch.Tensor, torch.Tensor]] = {}
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.store: dict[str, torch.Tensor] = {}
        self.slots = SlotGenerations(num_slots)
        self.stats = CounterBag()
        self._meta: SemkvMetadata | None = None
        self._pending_layers: dict[str, list[LoadOp]] = {}
        self.reports = WorkerReports()  # loads' and realized spans' results, until reported
        self._failed_counted: set[str] = set()  # one materialize_failed per request and step
        self.report_layout = False  # set when token-level loads are configured
        self.timings = Timings()  # the cost gate's samples, until reported
        self._calibration: list[tuple[RealizeWork, float]] = []  # reported with report_realize
        self.report_realize = False  # set when span realization is configured
        self.realize_why: str | None = None  # why this worker has no realizer (reported once)
        self.spans = SpanJobs(self.reports, self.slots, self.stats, self.timings,
                              transfer_timeout_s, drain_saves=self.drain_saves,
                              floor=self._floor_span)  # realized spans, op to report

    # -- setup -----------------------------------------------------------------------------
    @property
    def slot_generation(self) -> list[int]:
        return self.slots.generation

    @slot_generation.setter
    def slot_generation(self, generation: list[int]) -> None:
        self.slots.generation = generation

    @property
    def fetcher(self) -> Any:
        """``lmcache_fetch.HostFetcher`` (``donor_store: lmcache``), set by the connector."""
        return self.spans.fetcher

    @fetcher.setter
    def fetcher(self, fetcher: Any) -> None:
        self.spans.fetcher = fetcher

    @property
    def realizer(self) -> SpanRealizer | None:
        return self.spans.realizer

    @realizer.setter
    def realizer(self, realizer: SpanRealizer | None) -> None:
        """Set in ``register_kv_caches`` (start-up), held by ``SpanJobs`` with its shape (layers,
        block size); the runner is timed on synthetic spans then, the cost gate's first
        realization rates."""
        runner, layout = getattr(realizer, "runner", None), getattr(realizer, "layout", None)
        self.spans.realizer = realizer
        self.spans.shape = (None if runner is None or layout is None
                            else (int(runner.num_layers), int(layout.block_size)))
        if isinstance(realizer, SpanRealizer):
            self._calibration = list(calibrate(realizer))

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = dict(kv_caches)
        if self.kv_caches:
            self.timings.clock = Clock(next(iter(self.kv_caches.values())).device)
        for name, kv in self.kv_caches.items():
            self.store[name] = allocate_store(kv, self.num_slots)
        per_slot = sum(kv[0].numel() * kv.element_size() for kv in self.kv_caches.values())
        log.info("donor_store_ready", layers=len(self.kv_caches), slots=self.num_slots,
                 bytes_per_slot=per_slot)

    def bind(self, meta: Any) -> None:
        self._meta = meta if isinstance(meta, SemkvMetadata) else None
        self.timings.begin(self._meta.step if self._meta is not None else None)

    def clear(self) -> None:
        self._meta = None
        self.timings.cancel()
        self._maps.clear()  # token maps live for one step (keyed by the step's op objects)

    # -- loads -----------------------------------------------------------------------------
    def _valid(self, op: LoadOp) -> bool:
        return self.slots.current(op.slots, op.generations)

    def start_load_kv(self) -> None:
        with self.timings.excluded():  # before or after the forward: never part of it
            self._start_load_kv()

    def _start_load_kv(self) -> None:
        if self._meta is not None and self._meta.realizes:
            self.drain_saves()  # a realization reads slots an in-flight save may be writing
            for rop in self._meta.realizes:
                self.spans.start(rop)
        if self._meta is None or not self._meta.loads:
            return
        self.drain_saves()  # a load may read a slot an in-flight save is writing
        started = time.perf_counter()
        for op in self._meta.loads:
            if not self._valid(op):
                self._fail(op, "stale_slot")
                continue
            if self.layerwise and not op.asynchronous:
                for name in self.kv_caches:
                    self._pending_layers.setdefault(name, []).append(op)
                continue
            try:
                for name in self.kv_caches:
                    self._load_layer(op, name)
            except Exception as exc:  # noqa: BLE001 - a failed copy becomes a recompute
                self._fail(op, type(exc).__name__)
                continue
            self._done(op)
        self.stats.observe("load_seconds", time.perf_counter() - started)

    def wait_for_layer_load(self, layer_name: str) -> None:
        ops = self._pending_layers.pop(layer_name, None)
        if not ops:
            return
        for op in ops:
            try:
                self._load_layer(op, layer_name)
            except Exception as exc:  # noqa: BLE001
                self._fail(op, type(exc).__name__)
                continue
            if not self._pending_layers_for(op):
                self._done(op, counted=op.request_id not in self.reports.failed)

    def _blocks(self, op: LoadOp | SaveOp, name: str) -> tuple[list[int], list[int]]:
        """(slots, blocks) of ``op`` for layer ``name``: its group's blocks, without the
        positions its group holds no block at (vLLM's null block: never read or written)."""
        ids = op.block_ids if op.groups is None else op.groups[self.group_of[name]]
        kept = [(slot, b) for slot, b in zip(op.slots, ids, strict=True) if b != NO_BLOCK]
        return [slot for slot, _ in kept], [b for _, b in kept]

    def _load_layer(self, op: LoadOp, name: str) -> None:
        kv = self.kv_caches[name]
        if op.segments is None:
            slots, ids = self._blocks(op, name)
            copy_blocks(self.store[name], slots, kv, ids)
            self._floor(op.kv_floor, kv, ids)
            return
        if self.layout is None:
            raise RuntimeError("page layout unknown: token-level loads are not possible")
        source, deltas = self._token_map(op)
        pages = self.store[name].index_select(0, torch.as_tensor(op.slots, dtype=torch.long))
        keys, values = self.layout.read(pages.to(kv.device))
        keys, values = keys[source.to(kv.device)], values[source.to(kv.device)]
        if bool(deltas.any()):
            if self.rope is None:
                raise RuntimeError("positions cannot be moved for this model")
            keys = self.rope.rotate(keys.cpu(), deltas).to(kv.device)
        self.layout.write(kv, op.block_ids, keys, values)
        self._floor(op.kv_floor, kv, op.block_ids)

    def _floor(self, floor: str | None, kv: torch.Tensor, block_ids: list[int]) -> None:
        """The ``kv_floor`` request option: round the KV just placed (one layer's blocks; a
        ``NO_BLOCK`` is vLLM's null block, never written)."""
        if floor is None:
            return
        if self.layout is None:
            raise RuntimeError("kv_floor needs the page layout (token-level access)")
        round_blocks_fp8(kv, [b for b in block_ids if b != NO_BLOCK], self.layout)

    def _floor_span(self, op: RealizeOp) -> None:
        """``kv_floor`` over a realized span's blocks, in every layer (its group's blocks)."""
        for name, kv in self.kv_caches.items():
            self._floor(op.kv_floor, kv, op.span_blocks(self.group_of.get(name, 0)))

    def _token_map(self, op: LoadOp) -> tuple[torch.Tensor, torch.Tensor]:
        """Per target token: index into the op's donor pages, and its position shift."""
        cached = self._maps.get(id(op))
        if cached is not None and cached[0] is op:
            return cached[1], cached[2]
        assert op.segments is not None
        base = op.donor_first_block * self.layout.block_size if self.layout else 0
        donor_pos = [d + i for _, d, n in op.segments for i in range(n)]
        target_pos = [t + i for t, _, n in op.segments for i in range(n)]
        if len(target_pos) != len(op.block_ids) * (self.layout.block_size if self.layout else 0):
            raise ValueError("segments do not cover the target blocks exactly")
        source = torch.as_tensor(donor_pos, dtype=torch.long) - base
        deltas = torch.as_tensor(target_pos, dtype=torch.long) - torch.as_tensor(donor_pos)
        self._maps[id(op)] = (op, source, deltas)
        return source, deltas

    def _pending_layers_for(self, op: LoadOp) -> bool:
        return any(op in ops for ops in self._pending_layers.values())

    def _done(self, op: LoadOp, counted: bool = True) -> None:
        self._maps.pop(id(op), None)
        if counted:
            self.reports.loaded[op.request_id] = len(op.block_ids)
            self.stats.inc("loaded_blocks", amount=len(op.block_ids))
        if op.asynchronous:
            self.reports.finished_recving.add(op.request_id)

    def _fail(self, op: LoadOp, why: str) -> None:
        self._maps.pop(id(op), None)
        # vLLM maps invalid block ids back to requests for one group only; an async load's
        # request is reported received (vLLM then recomputes its blocks)
        self.reports.record_failure(op.request_id, [b for b in op.block_ids if b != NO_BLOCK],
                                    per_request=op.groups is not None,
                                    received=op.asynchronous)
        if op.request_id not in self._failed_counted:  # layerwise loads fail once per layer
            self._failed_counted.add(op.request_id)
            self.stats.inc("materialize_failed")
            self.stats.inc("invalid_blocks", amount=len(op.block_ids))
        log.warning("load_failed", request_id=op.request_id, blocks=len(op.block_ids), why=why)

    # -- saves -----------------------------------------------------------------------------
    def wait_for_save(self) -> None:
        self.timings.end()  # the forward is over
        if self._meta is None or not self._meta.saves:
            return
        ops = list(self._meta.saves)
        if not self.async_save:
            self._record(self._save_all(ops))
            return
        if self._saver is None:
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="semkv-save")
        self._saves_in_flight.append(self._saver.submit(self._save_all, ops))

    def drain_saves(self) -> None:
        """Finish every in-flight save; called before anything may rewrite or read its blocks."""
        if not self._saves_in_flight:
            return
        started = time.perf_counter()
        self.harvest_saves(wait=True)
        self.stats.observe("save_wait_seconds", time.perf_counter() - started)

    def harvest_saves(self, *, wait: bool = False) -> None:
        """Count the saves that have finished (all of them with ``wait``)."""
        still: list[Future[_SaveResult]] = []
        for future in self._saves_in_flight:
            if wait or future.done():
                self._record(future.result())  # _save_all never raises
            else:
                still.append(future)
        self._saves_in_flight = still

    def _save_all(self, ops: list[SaveOp]) -> _SaveResult:
        started = time.perf_counter()
        saved = 0
        for op in ops:
            try:
                for name, kv in self.kv_caches.items():
                    slots, ids = self._blocks(op, name)
                    copy_blocks(kv, ids, self.store[name], slots)
            except Exception as exc:  # noqa: BLE001 - an unsaved block is a future miss
                self.slots.mark(op.slots, op.generations, ok=False)
                log.warning("save_failed", blocks=len(op.block_ids),
                            error_type=type(exc).__name__)
                continue
            self.slots.mark(op.slots, op.generations)
            saved += len(op.slots)
        return _SaveResult(saved, time.perf_counter() - started)

    def _record(self, result: _SaveResult) -> None:
        self.stats.observe("save_seconds", result.seconds)
        if result.saved:
            self.stats.inc("saved_blocks", amount=result.saved)

    def shutdown(self) -> None:
        if self.realizer is not None:
            self.realizer.shutdown()
        if self.fetcher is not None:
            self.fetcher.shutdown()
        self.drain_saves()
        if self._saver is not None:
            self._saver.shutdown(wait=True)
            self._saver = None

    # -- reporting -------------------------------------------------------------------------
    def take_finished_recving(self, finished_req_ids: set[str] | None = None) -> set[str]:
        idle = self._meta is not None and self._meta.idle
        self.spans.advance(finished_req_ids or set(), idle=idle)
        return self.reports.take_finished_recving()

    def take_failed_recving(self) -> set[str]:
        return self.reports.take_failed_recving()

    def take_invalid_blocks(self) -> set[int]:
        return self.reports.take_invalid_blocks()

    def take_worker_meta(self) -> SemkvWorkerMetadata | None:
        layout = realize = None
        if self.report_layout:
            layout, self.report_layout = self.layout is not None, False
        forwards, realizations = self.timings.take()
        if self.report_realize:
            realize, self.report_realize = self.realizer is not None, False
            realizations, self._calibration = self._calibration + realizations, []
        r = self.reports
        if not (r.loaded or r.failed or forwards or realizations) and (
                layout is None and realize is None):
            return None
        meta = SemkvWorkerMetadata(dict(r.loaded), set(r.failed), layout, realize,
                                   dict(r.recomputed), forwards, realizations,
                                   realize_why=self.realize_why if realize is False else None)
        r.loaded, r.failed, self._failed_counted = {}, set(), set()
        r.recomputed = {}
        return meta
