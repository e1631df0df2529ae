"""Scheduler side: what the workers said they can do, with their first step's output.

``SchedulerSide`` owns one ``WorkerCapabilities``; ``worker_feedback.apply_worker_meta``
updates it from each ``SemkvWorkerMetadata``. ``None``: that worker report has not come yet
(decisions that need it wait, or refuse, until then).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkerCapabilities:
    layout_known: bool | None = None  # every worker has a known page layout
    can_realize: bool | None = None  # every worker can realize spans
    realize_why: str | None = None  # why not, when a worker cannot

    @property
    def reported(self) -> bool:
        return self.layout_known is not None or self.can_realize is not None

    def refusal(self) -> str | None:
        """Why the workers cannot realize spans (None: they can; so far unreported counts as
        cannot). A worker that can realize re-rotates with its runner's own per-layer tables
        (built, or refused, at its start-up): the scheduler's ``can_shift`` is about KV edits
        only."""
        if self.layout_known is None or self.can_realize is None:
            return "the workers have not reported what they can do yet"
        if not self.layout_known:
            return "the attention backend's page layout is unknown"
        if not self.can_realize:
            return self.realize_why or "the workers cannot realize spans"
        return None
