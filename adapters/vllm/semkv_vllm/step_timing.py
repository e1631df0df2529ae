"""Worker side of the cost gate: how long the engine's forward and each realization took.

vLLM's model runner (``kv_connector_model_runner_mixin._get_kv_connector_output``, 0.32 and
0.33) binds the step's connector metadata right before the model's forward and calls
``wait_for_save`` right after it (``start_load_kv`` either before the forward, for a step with
a synchronous load, or after it). The forward is what lies between ``bind`` and
``wait_for_save``, less semkv's own ``start_load_kv`` (``excluded``). Only steps whose metadata
carries their work (``SemkvMetadata.step``: the scheduler attaches it to steps that prefill) are
timed, the first of them excepted (``WARMUP_FORWARDS``: the engine's first forward pays one-off
initialization, not its rates). A realization's seconds are its busy chunks
(``SpanRealizer.advance``) and its block write (``span_jobs.py``).

``Clock`` measures device work: the host clock on CPU (every op there is synchronous), CUDA
events on a GPU, read once they have completed (``query``), so nothing waits for the device: a
sample whose events are still pending is reported by a later step.
NOTE: the CUDA path is unrun here (no GPU was lent to this project; docs/cuda-build.md).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from semkv.cost import RealizeWork, StepWork

WARMUP_FORWARDS = 1  # timed forwards not reported at first (module docstring)
MAX_PENDING = 64  # samples whose device events are still pending (the oldest are dropped)
Span = tuple[Any, Any]  # (start mark, end mark)


class Clock:
    def __init__(self, device: torch.device | None = None) -> None:
        self.cuda = device is not None and device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, spans: Sequence[Span]) -> float | None:
        """Summed seconds of the spans; None while a CUDA event is still pending."""
        if not self.cuda:
            return float(sum(end - start for start, end in spans))
        if not all(end.query() for _, end in spans):
            return None
        return float(sum(start.elapsed_time(end) for start, end in spans)) / 1e3

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class Timings:
    """The forward of the step being run, and samples not yet reported."""

    def __init__(self) -> None:
        self.clock = Clock()
        self._open: tuple[StepWork, Any, list[Span]] | None = None  # work, start, excluded
        self._warmup = WARMUP_FORWARDS
        self._forwards: list[tuple[StepWork, list[Span], list[Span]]] = []
        self._realizations: list[tuple[RealizeWork, list[Span]]] = []

    def begin(self, work: StepWork | None) -> None:
        """``bind_connector_metadata``: the forward starts (timed when ``work`` is known)."""
        self._open = None if work is None else (work, self.clock.mark(), [])

    @contextmanager
    def excluded(self) -> Iterator[None]:
        """semkv's own work inside the timed window (``start_load_kv``)."""
        if self._open is None:
            yield
            return
        start = self.clock.mark()
        try:
            yield
        finally:
            if self._open is not None:
                self._open[2].append((start, self.clock.mark()))

    def end(self) -> None:
        """``wait_for_save``: the forward is over."""
        if self._open is None:
            return
        work, start, excluded = self._open
        self._open = None
        if self._warmup > 0:
            self._warmup -= 1
            return
        self._forwards = [*self._forwards, (work, [(start, self.clock.mark())], excluded)][
            -MAX_PENDING:]

    def cancel(self) -> None:
        """The step's metadata is cleared without a ``wait_for_save``: nothing to report."""
        self._open = None

    def realized(self, work: RealizeWork, spans: Sequence[Span]) -> None:
        self._realizations = [*self._realizations, (work, list(spans))][-MAX_PENDING:]

    def take(self) -> tuple[list[tuple[StepWork, float]], list[tuple[RealizeWork, float]]]:
        """The samples whose times are known (the others stay for a later report)."""
        forwards, waiting = [], []
        for work, spans, excluded in self._forwards:
            total, minus = self.clock.seconds(spans), self.clock.seconds(excluded)
            if total is None or minus is None:
                waiting.append((work, spans, excluded))
            elif total - minus > 0.0:
                forwards.append((work, total - minus))
        self._forwards = waiting
        realizations, pending = [], []
        for rwork, rspans in self._realizations:
            seconds = self.clock.seconds(rspans)
            if seconds is None:
                pending.append((rwork, rspans))
            elif seconds > 0.0:
                realizations.append((rwork, seconds))
        self._realizations = pending
        return forwards, realizations
