"""Scheduler side: what the workers reported with a step's output (``SemkvWorkerMetadata``).

- their first step: whether every worker knows its page layout and can realize spans
  (``SchedulerSide.layout_known`` / ``can_realize``; decisions that need them wait until then);
- per request: the blocks really loaded (``loaded_tokens``; for a realized span also what the
  realization did inside it), or that its load failed (``load_failed``: vLLM recomputes it);
- the cost gate's samples (timed forwards and realizations): handed to the engine's
  ``EngineCost`` (``cost_gate.py``), whose rates price the next plans.

NOTE: vLLM frees requests that stop in a step before it hands the connector that step's worker
output, so the counters count confirmations whether or not the request is still known.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from semkv_vllm.cost_gate import EngineCost
from semkv_vllm.metadata import SemkvWorkerMetadata

if TYPE_CHECKING:
    from semkv_vllm.scheduler import SchedulerSide


def apply_worker_meta(side: SchedulerSide, worker_meta: Any) -> None:
    if not isinstance(worker_meta, SemkvWorkerMetadata):
        return
    if worker_meta.layout_known is not None:
        side.layout_known = worker_meta.layout_known
    if worker_meta.can_realize is not None:
        side.can_realize = worker_meta.can_realize
        side.realize_why = worker_meta.realize_why
    if isinstance(side.cost_gate, EngineCost) and (worker_meta.forwards
                                                   or worker_meta.realizations):
        side.cost_gate.observe(worker_meta)
    for rid, blocks in worker_meta.loaded_blocks.items():
        side.stats.inc("loaded_tokens", amount=blocks * side.bs)
        side.stats.observe("request_loaded_tokens", blocks * side.bs)
        st = side.requests.get(rid)
        if st is None:
            continue
        st.loaded_tokens = blocks * side.bs
        if st.span is not None:  # what the worker's realization did inside the span
            plan = st.span.plan
            side.stats.inc("span_tokens", "copied", plan.copied_tokens)
            side.stats.inc("span_tokens", "shifted", plan.shifted_tokens)
            side.stats.inc("span_tokens", "computed", plan.computed_tokens)
            st.recomputed_tokens = worker_meta.recomputed.get(rid, 0)
            side.stats.inc("span_tokens", "recomputed", st.recomputed_tokens)
            side.end_fetches(st)
    for rid in worker_meta.failed:
        st = side.requests.get(rid)
        if st is not None:
            st.load_failed = True
            side.end_fetches(st)
