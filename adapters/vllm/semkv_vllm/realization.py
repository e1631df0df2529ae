"""Worker side of span realization: a ``RealizeOp`` advanced between engine steps.

Protocol (driven by ``WorkerSide``):

- ``SpanRealizer.build(model, layout, kv_caches, store, config, context)`` once, in
  ``register_kv_caches``: the layer runner for the engine's model (``semkv_vllm.models``; its
  layer passes run inside ``context``, the engine's forward context), the page layout probed
  from the engine's cache-write kernel, and which paged cache belongs to which decoder layer.
  The reason instead (logged), when the model or the layout is not supported: the scheduler is
  told it with the worker's first step and answers such requests ``unsupported_request``. With
  ``config``, ``recompute_probe_layers`` is checked against the model's layers there, and
  ``realize_memory_bytes`` against the device's free memory when the model runs on an
  accelerator (``ConfigError`` naming the key).
- ``submit(op)`` in ``start_load_kv``: the op becomes a job. Its working set
  (``semkv.realize.memory``, the same estimate the scheduler refused over-bound plans with) is
  checked against ``realize_memory_bytes`` before anything is allocated; over it the job fails
  (``RealizationOverBudget``: the span is reported invalid, vLLM recomputes it). Its first
  steps read the request's local prefix blocks and the pinned donor-store slots into a dense
  ``KVCache`` of the span and place the copies (keys re-rotated), one layer per step; every
  later step runs one layer over at most ``op.max_chunk_tokens`` (vLLM's
  ``max_num_batched_tokens``) of the span's gaps plus the copied tokens the op's recompute
  strategy selects (``semkv.realize.recompute_steps``, the code research's strategies run).
  The request waits in WAITING_FOR_REMOTE_KVS meanwhile.
- ``advance(idle=...)`` in ``get_finished`` (main thread, after the step's forward): advances
  the oldest jobs by ``TOKEN_LAYERS_PER_STEP`` token-layers (at least one layer call), or every
  job to its end in a step that scheduled no token; returns the finished ones, which the worker
  writes into the request's blocks and reports received, or reports invalid when they failed
  (vLLM recomputes them under ``kv_load_failure_policy: recompute``).
- ``cancel(request_id)``: drops the request's job unfinished (an aborted request).
- ``run_now(op)``: one op realized and written at once; the worker's start-up calibration
  (``realize_calibration.calibrate``, called when the worker is handed the realizer) times
  synthetic spans through it: the cost gate's first realization rates.

NOTE: nothing runs beside vLLM's forward. A background thread did first, and failed twice: (1)
the engine's loop is Python and holds the GIL between its torch calls, so the thread waited up
to the 5 ms switch interval after each of its calls (27 s instead of 0.3 s for a 900-token span
while vLLM's loop spun idle); (2) it called the same layers' oneDNN matmul handles as the
forward, concurrently, and the worker died once with SIGSEGV. Stepping on the main thread
between forwards has neither problem, keeps tensor-parallel ranks in lockstep (every rank
advances by the same plan-determined amount, so the projections' all-reduces pair up), and
bounds what a realization adds to a busy step: ``TOKEN_LAYERS_PER_STEP`` (a fifteenth of
what one 1,024-token prefill chunk computes in a step), in whole layer calls of at most one
chunk each, so a long span never runs a full layer over all its tokens in one step.
NOTE: with sliding-window or several KV-cache groups each decoder layer reads its local prefix
from and writes the span into its own group's blocks (``RealizeOp.groups``, ``group_of`` at
build); a window group's local window is pinned for the op by the scheduler
(``window_pins.py``), and a ``NO_BLOCK`` there reads as zeros and is never written.
NOTE: the paged blocks are written between steps, before the request can be scheduled again.
vLLM frees the blocks of a request that finished while waiting for remote KV only after we
report it received, so no block is ever reused under a realization. The donor slots read are
pinned for it; the worker re-validates them before writing (``worker.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from semkv.config import ConfigError, SemkvConfig, check_probe_layers
from semkv.log import MAX_STRING, get_logger
from semkv.realize import KVCache
from semkv.realize.memory import Budget, Geometry, over_budget, working_set
from semkv.realize.recompute import cache_tokens, layer_calls, recompute_steps
from semkv.realize.span import place_layer
from semkv_vllm.metadata import RealizeOp
from semkv_vllm.page_layout import PageLayout
from semkv_vllm.span_io import SpanReads, write_span
from semkv_vllm.step_timing import Clock, Span

log = get_logger("semkv.vllm.realization")
# Fault injection (tests and chaos runs, with SEMKV_ALLOW_FAULT_INJECTION=1): fail every
# realization after this many layers have been computed.
FAULT_AFTER_LAYERS = "SEMKV_FAULT_REALIZE_AFTER_LAYERS"
# ... or after this many layer calls of the recompute strategy (inside blend's or query's probe
# for a small number): the dense cache then holds probe state that must never be written.
FAULT_AFTER_CALLS = "SEMKV_FAULT_REALIZE_AFTER_CALLS"
# What a realization may compute in one busy engine step, in token-layers (deterministic, so
# tensor-parallel ranks advance alike): 1/15 of a 1,024-token prefill chunk of 30 layers. A
# layer also costs a fixed overhead (module calls, attention over the whole realized context),
# counted as LAYER_OVERHEAD_TOKENS more tokens: measured 7.7 ms per layer for 70 gap tokens
# against 43 ms per layer of a 1,024-token chunk on the bundled model (2 CPU cores).
TOKEN_LAYERS_PER_STEP = 2048
LAYER_OVERHEAD_TOKENS = 128


class InjectedRealizationFault(RuntimeError):
    pass


class RealizationOverBudget(RuntimeError):
    """The op's working set is over ``realize_memory_bytes`` (refused before allocating)."""


def op_working_set(geometry: Geometry, op: RealizeOp, block_size: int) -> int:
    """``semkv.realize.memory.working_set`` of an op: the same figure ``span_admission``
    computes from the plan the op came from (``plan_working_set``)."""
    return working_set(
        geometry, span_tokens=op.span_tokens, local_tokens=op.local_tokens,
        read_rows=op.local_tokens + block_size * sum(len(c.slots) for c in op.copies),
        computed=len(op.token_positions),
        probe_layers=op.recompute.held_probe_layers,
        chunk_tokens=op.max_chunk_tokens, cache_tokens=op_cache_tokens(op))


def op_cache_tokens(op: RealizeOp) -> int:
    """The op's dense cache capacity (``semkv.realize.recompute.cache_tokens``)."""
    return cache_tokens(range(op.local_tokens, op.span_tokens),
                        [(c.target_start, c.length) for c in op.copies], op.recompute,
                        op.prompt_tokens)


@dataclass(frozen=True)
class Realized:
    op: RealizeOp
    cache: KVCache | None
    error: str | None
    seconds: float
    recomputed: tuple[int, ...] = ()  # copied positions computed through every layer
    working_set: int = 0  # its estimated peak bytes (``op_working_set``)
    spans: tuple[Span, ...] = ()  # its busy chunks' clock marks (the cost gate's seconds)


@dataclass
class _Job:
    op: RealizeOp
    steps: Generator[int, None, tuple[KVCache, list[int]]]
    working_set: int  # estimated peak bytes (op_working_set)
    busy: float = 0.0  # seconds actually spent computing it
    spans: list[Span] = field(default_factory=list)  # device clock marks of its busy chunks


class SpanRealizer:
    def __init__(self, runner: Any, layout: PageLayout, layer_names: list[str],
                 kv_caches: dict[str, torch.Tensor], store: dict[str, torch.Tensor],
                 memory_bytes: int | None = None,
                 group_of: dict[str, int] | None = None) -> None:
        self.runner = runner
        self.layout = layout
        self.layer_names = layer_names  # decoder layer i -> its paged cache's name
        # decoder layer i -> its KV-cache group (a RealizeOp's ``groups[g]`` are its blocks)
        self.layer_groups = [(group_of or {}).get(name, 0) for name in layer_names]
        self.kv_caches = kv_caches
        self.store = store
        self._jobs: list[_Job] = []
        self.memory_bytes = memory_bytes  # realize_memory_bytes (None: unbounded, tests only)
        self.reduce = _tensor_parallel_sum()  # blend ranks by the deviation over all ranks
        self.clock = Clock(getattr(runner, "device", None))

    @classmethod
    def build(cls, model: Any, layout: PageLayout | None, kv_caches: dict[str, torch.Tensor],
              store: dict[str, torch.Tensor], config: SemkvConfig | None = None,
              context: Callable[[], AbstractContextManager[Any]] | None = None,
              group_of: dict[str, int] | None = None) -> SpanRealizer | str:
        """The engine's realizer, or why it has none (logged; reported to the scheduler).
        ``group_of``: each paged cache's KV-cache group (absent: group 0)."""
        from semkv_vllm.models import UnsupportedModelError, runner_for

        if model is None or layout is None:
            return _unavailable("engine model not found" if model is None
                                else "page layout unknown")
        try:
            # refuses non-linear rotary angles now, not per request
            runner = runner_for(model, context)
        except UnsupportedModelError as exc:
            return _unavailable(str(exc))
        if config is not None:
            check_probe_layers(config, runner.num_layers)  # start-up, not per request
            check_realize_memory_fits_device(config, runner.device)
        names = []
        for layer in runner.model.model.layers:
            name = getattr(layer.self_attn.attn, "layer_name", None)
            if name not in kv_caches:
                return _unavailable("a decoder layer has no paged cache")
            names.append(name)
        return cls(runner, layout, names, kv_caches, store,
                   None if config is None else int(config.realize_memory_bytes), group_of)

    # -- between steps (main thread) -------------------------------------------------------
    def submit(self, op: RealizeOp) -> None:
        needed = op_working_set(self.runner.geometry, op, self.layout.block_size)
        self._jobs.append(_Job(op, self._steps(op, needed), needed))

    def cancel(self, request_id: str) -> bool:
        """Drop the request's job (queued or running) without finishing it; True if there was
        one. Nothing is written or reported: the caller decides what the request gets."""
        jobs = [job for job in self._jobs if job.op.request_id == request_id]
        for job in jobs:
            self._jobs.remove(job)
            job.steps.close()  # releases the job's cache and activations now
        return bool(jobs)

    def advance(self, *, idle: bool = False, finish: bool = False) -> list[Realized]:
        """Advance the oldest jobs by one step's budget (all of them to their end when ``idle``
        or ``finish``); returns the realizations that ended, in submission order."""
        done: list[Realized] = []
        budget = TOKEN_LAYERS_PER_STEP
        for job in list(self._jobs):
            if budget <= 0 and not (idle or finish):
                break
            started, mark = time.perf_counter(), self.clock.mark()
            try:
                while idle or finish or budget > 0:
                    budget -= next(job.steps) + LAYER_OVERHEAD_TOKENS
            except StopIteration as end:
                job.spans.append((mark, self.clock.mark()))
                cache, recomputed = end.value
                done.append(self._ended(job, started, cache, tuple(recomputed), None))
            except Exception as exc:  # noqa: BLE001 - any failure becomes a recompute
                done.append(self._ended(job, started, None, (), type(exc).__name__))
            else:
                job.busy += time.perf_counter() - started
                job.spans.append((mark, self.clock.mark()))
        return done

    def _ended(self, job: _Job, started: float, cache: KVCache | None,
               recomputed: tuple[int, ...], error: str | None) -> Realized:
        self._jobs.remove(job)
        busy = job.busy + time.perf_counter() - started
        return Realized(job.op, cache, error, busy, recomputed, job.working_set,
                        tuple(job.spans))

    def finite(self, realized: Realized) -> bool:
        """Is every K and V value of the span finite? A NaN or inf written into the request's
        blocks would be read by every later token (greedy answers of token id 0): such a
        realization is reported invalid and recomputed instead (``nonfinite_kv``).

        NOTE: one float32 sum per layer and part, not an elementwise test (7x cheaper: ~3 ms for
        1,850 tokens of the bundled model's 30 layers): any NaN or inf makes the sum non-finite;
        a finite sum of ~1e38 would be refused too (safe: recomputed)."""
        op, cache = realized.op, realized.cache
        assert cache is not None
        lo, hi = op.local_tokens, op.span_tokens
        sums = [part[layer][0, :, lo:hi].sum(dtype=torch.float32)
                for part in (cache.keys, cache.values) for layer in range(len(part))]
        return not sums or bool(torch.isfinite(torch.stack(sums)).all())

    def write(self, realized: Realized) -> None:
        """The span's KV into the request's blocks (main thread, between steps)."""
        op, cache = realized.op, realized.cache
        assert cache is not None
        write_span(self.layout, [self.kv_caches[name] for name in self.layer_names],
                   [op.span_blocks(g) for g in self.layer_groups], cache, op.local_tokens,
                   op.span_tokens)

    def shutdown(self) -> None:
        self._jobs.clear()  # the engine is going away: nothing will read these blocks

    def run_now(self, op: RealizeOp) -> bool:
        """Realize ``op`` to its end and write it, at once (the start-up calibration); False,
        with nothing allocated, when its working set is over ``realize_memory_bytes``."""
        needed = op_working_set(self.runner.geometry, op, self.layout.block_size)
        if self.memory_bytes is not None and needed > self.memory_bytes:
            return False
        steps = self._steps(op, needed)
        while True:
            try:
                next(steps)
            except StopIteration as end:
                cache, _ = end.value
                break
        self.write(Realized(op, cache, None, 0.0))
        return True

    # -- one job, step by step -------------------------------------------------------------
    def _steps(self, op: RealizeOp, needed: int,
               ) -> Generator[int, None, tuple[KVCache, list[int]]]:
        runner = self.runner
        why = None if self.memory_bytes is None else over_budget(
            Budget(runner.geometry, self.memory_bytes, op.max_chunk_tokens), needed)
        if why is not None:  # before anything is allocated; the scheduler refuses these first
            raise RealizationOverBudget(why)
        cache: KVCache = runner.empty_cache(op_cache_tokens(op))
        bs = self.layout.block_size
        # One gather per layer for every copy (and one for the local prefix).
        slots = torch.as_tensor([s for c in op.copies for s in c.slots], dtype=torch.long)
        rows, positions, deltas = [], [], []
        base = 0
        for c in op.copies:
            first = base + c.donor_start - c.donor_first_block * bs
            rows.append(torch.arange(first, first + c.length))
            positions.append(torch.arange(c.target_start, c.target_start + c.length))
            deltas.append(torch.full((c.length,), c.target_start - c.donor_start))
            base += len(c.slots) * bs
        at = torch.cat([torch.arange(op.local_tokens), *positions])
        moved = torch.cat([torch.zeros(op.local_tokens, dtype=torch.long), *deltas])
        picked = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        rotator = runner.rotator if bool(moved.any()) else None
        reads = self._reads(op, slots, picked)
        # Layer by layer: one layer's donor K/V in memory beside the cache, never all of them.
        for layer, name in enumerate(self.layer_names):
            with torch.no_grad():
                k, v = reads.layer(self.kv_caches[name], self.store.get(name),
                                   self.layer_groups[layer])
                place_layer(cache, layer, rotator, at, k, v, moved)
                del k, v
            yield 0  # reads and re-rotation: charged the per-call overhead only
        fault_after = _fault_after(FAULT_AFTER_LAYERS)
        if fault_after is not None:
            self._fail_midway(cache, op, fault_after)
        # Gaps always, plus what the strategy selects, one layer call (chunk) per step.
        steps = recompute_steps(
            runner, cache, range(op.local_tokens, op.span_tokens),
            [(c.target_start, c.length) for c in op.copies], op.token_map(), op.recompute,
            op.prompt_tokens, reduce=self.reduce, max_tokens=op.max_chunk_tokens)
        calls = _fault_after(FAULT_AFTER_CALLS)
        done = yield from (steps if calls is None else _failing_after(steps, calls))
        return cache, done.recomputed

    def _reads(self, op: RealizeOp, slots: torch.Tensor, picked: torch.Tensor) -> SpanReads:
        """The op's reads: its copies, and each KV-cache group's local-prefix blocks."""
        runner, layer0, group0 = self.runner, self.layer_names[0], self.layer_groups[0]
        first: dict[int, str] = {}  # group -> its first layer's paged cache
        for name, group in zip(self.layer_names, self.layer_groups, strict=True):
            first.setdefault(group, name)

        def local(group: int) -> torch.Tensor:
            return torch.as_tensor(op.local_blocks(group), dtype=torch.long)

        reads = SpanReads(self.layout, self.kv_caches[layer0], self.store.get(layer0),
                          local(group0), slots, picked, op.local_tokens, runner.device,
                          runner.kv_heads, runner.head_dim, runner.dtype, group=group0)
        for group, name in first.items():
            if group != group0:
                reads.add_group(group, self.kv_caches[name], local(group))
        return reads

    def _fail_midway(self, cache: KVCache, op: RealizeOp, after: int) -> None:
        """Fault injection: compute the first layers for real, then fail."""
        layers = min(after, self.runner.num_layers)
        if op.gap_positions and layers:
            at = torch.as_tensor(op.gap_positions, dtype=torch.long, device=self.runner.device)
            ids = op.token_map()
            for _ in layer_calls(self.runner, cache,
                                 self.runner.embed([ids[p] for p in op.gap_positions]), at,
                                 range(layers), op.max_chunk_tokens):
                pass
        raise InjectedRealizationFault(f"injected after {layers} layers")


def check_realize_memory_fits_device(config: SemkvConfig, device: torch.device) -> None:
    """Refuse a ``realize_memory_bytes`` the accelerator cannot give beside vLLM's KV cache.

    Runs in ``register_kv_caches``, after vLLM allocated its KV cache on the device: what is
    free now is what a realization can take. A host realization is checked with the donor
    store (``engine_setup.check_store_fits_host``).
    NOTE: untested here (CPU only); CUDA devices report their free memory.
    """
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    wanted = int(config.realize_memory_bytes)
    if wanted > free:
        raise ConfigError(
            f"realize_memory_bytes={wanted} ({wanted / 2**30:.2f} GiB) is more than {device} "
            f"has free beside vLLM's KV cache ({free / 2**30:.2f} GiB); lower "
            f"realize_memory_bytes or vLLM's gpu_memory_utilization")


def _tensor_parallel_sum() -> Any:
    """vLLM's all-reduce over the tensor-parallel group when there is one (else None).

    Each rank holds some heads: blend's per-position deviation must be summed over all of them
    so that every rank selects the same positions (the projections all-reduce per call).
    NOTE: unexercised on the CPU engine (one rank).
    """
    try:
        from vllm.distributed import (
            get_tensor_model_parallel_world_size,
            tensor_model_parallel_all_reduce,
        )

        return tensor_model_parallel_all_reduce if get_tensor_model_parallel_world_size() > 1 \
            else None
    except Exception:  # noqa: BLE001 - no parallel state (a bare test runner): one rank
        return None


def _failing_after(steps: Generator[int, None, Any], calls: int) -> Generator[int, None, Any]:
    """Fault injection: ``steps`` for ``calls`` layer calls, then a failure."""
    for _ in range(calls):
        try:
            yield next(steps)
        except StopIteration as end:
            return end.value
    steps.close()
    raise InjectedRealizationFault(f"injected after {calls} recompute calls")


def _fault_after(name: str) -> int | None:
    from semkv.plugins import fault_injection_allowed

    value = os.environ.get(name)  # read per realization: a test may toggle it
    if value is None or not fault_injection_allowed():
        return None
    return int(value)


def _unavailable(why: str) -> str:
    # NOTE: a log line redacts strings of MAX_STRING characters or more as payload: the reason
    # is logged cut to fit (its start names the architecture and what is refused) and returned
    # whole (the scheduler reports it; ``semkv calibrate`` prints it).
    short = why if len(why) < MAX_STRING else why[: MAX_STRING - 2] + "…"
    log.warning("realization_unavailable", why=short)
    return why
