"""Worker side: the state the worker shares with its helpers, one object per concern.

``WorkerSide`` owns both; ``SpanJobs`` (realized spans) is handed them, never the worker:

- ``WorkerReports``: what the worker reports with its next step, collected by synchronous
  loads and realized spans alike: to vLLM (``finished_recving``, ``invalid_blocks``,
  ``failed_recving``) and to the scheduler (``loaded``, ``recomputed``, ``failed``, in
  ``SemkvWorkerMetadata``);
- ``SlotGenerations``: which generation of a donor each store slot holds (written by saves and
  fetches; a load or realization whose slots moved on is refused).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WorkerReports:
    # to vLLM, taken each step (``get_finished`` / ``get_block_ids_with_load_errors``)
    finished_recving: set[str] = field(default_factory=set)  # async loads / realizations done
    invalid_blocks: set[int] = field(default_factory=set)  # one group: blocks to recompute
    failed_recving: set[str] = field(default_factory=set)  # several groups: per request
    # to the scheduler, with the next worker metadata
    loaded: dict[str, int] = field(default_factory=dict)  # request -> blocks loaded
    recomputed: dict[str, int] = field(default_factory=dict)  # realized: copied tokens recomputed
    failed: set[str] = field(default_factory=set)

    def record_failure(self, request_id: str, block_ids: list[int], *, per_request: bool,
                       received: bool) -> None:
        """A load or realization that failed: its blocks for vLLM to recompute (one KV-cache
        group), or the request (``per_request``: vLLM maps block ids back to requests for one
        group only); never confirmed loaded; reported received when vLLM waits for it."""
        if per_request:
            self.failed_recving.add(request_id)
        else:
            self.invalid_blocks.update(block_ids)
        self.failed.add(request_id)
        self.loaded.pop(request_id, None)
        if received:
            self.finished_recving.add(request_id)

    def take_finished_recving(self) -> set[str]:
        done, self.finished_recving = self.finished_recving, set()
        return done

    def take_failed_recving(self) -> set[str]:
        failed, self.failed_recving = self.failed_recving, set()
        return failed

    def take_invalid_blocks(self) -> set[int]:
        invalid, self.invalid_blocks = self.invalid_blocks, set()
        return invalid


class SlotGenerations:
    """Per donor-store slot, the generation it holds (-1: unusable until saved again)."""

    def __init__(self, num_slots: int) -> None:
        self.generation = [0] * num_slots

    def current(self, slots: list[int], generations: list[int]) -> bool:
        """Do these slots still hold the generations the scheduler planned with?"""
        return all(self.generation[s] == g for s, g in zip(slots, generations, strict=True))

    def mark(self, slots: list[int], generations: list[int], *, ok: bool = True) -> None:
        """Slots written (saved or fetched) with these generations; ``ok`` False: failed."""
        for slot, generation in zip(slots, generations, strict=False):
            self.generation[slot] = generation if ok else -1
