"""Scheduler side: what the workers reported with a step's output (``SemkvWorkerMetadata``).

- their first step: whether every worker knows its page layout and can realize spans
  (``WorkerCapabilities``, the scheduler's ``workers``; decisions that need them wait);
- per request: the blocks really loaded (``loaded_tokens``; for a realized span also what the
  realization did inside it), or that its load failed (``load_failed``: vLLM recomputes it);
- the cost gate's samples (timed forwards and realizations): handed to the engine's
  ``EngineCost`` (``cost_gate.py``), whose rates price the next plans.

NOTE: vLLM frees requests that stop in a step before it hands the connector that step's worker
output, so the counters count confirmations whether or not the request is still known.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from semkv.metrics import CounterBag
from semkv_vllm.cost_gate import EngineCost
from semkv_vllm.metadata import SemkvWorkerMetadata
from semkv_vllm.request_state import RequestState
from semkv_vllm.worker_capabilities import WorkerCapabilities


def apply_worker_meta(worker_meta: Any, workers: WorkerCapabilities, *, cost_gate: Any,
                      stats: CounterBag, requests: Mapping[str, RequestState], block_size: int,
                      end_fetches: Callable[[RequestState], None]) -> None:
    """Handed what it updates: the workers' capabilities, the cost gate (an ``EngineCost`` learns
    from the samples), the counters, the requests' states (``end_fetches`` ends a realized
    span's fetches once its load is confirmed or failed)."""
    if not isinstance(worker_meta, SemkvWorkerMetadata):
        return
    if worker_meta.layout_known is not None:
        workers.layout_known = worker_meta.layout_known
    if worker_meta.can_realize is not None:
        workers.can_realize = worker_meta.can_realize
        workers.realize_why = worker_meta.realize_why
    if isinstance(cost_gate, EngineCost) and (worker_meta.forwards or worker_meta.realizations):
        cost_gate.observe(worker_meta)
    bs = block_size
    for rid, blocks in worker_meta.loaded_blocks.items():
        stats.inc("loaded_tokens", amount=blocks * bs)
        stats.observe("request_loaded_tokens", blocks * bs)
        st = requests.get(rid)
        if st is None:
            continue
        st.loaded_tokens = blocks * bs
        if st.span is not None:  # what the worker's realization did inside the span
            plan = st.span.plan
            stats.inc("span_tokens", "copied", plan.copied_tokens)
            stats.inc("span_tokens", "shifted", plan.shifted_tokens)
            stats.inc("span_tokens", "computed", plan.computed_tokens)
            st.recomputed_tokens = worker_meta.recomputed.get(rid, 0)
            stats.inc("span_tokens", "recomputed", st.recomputed_tokens)
            end_fetches(st)
    for rid in worker_meta.failed:
        st = requests.get(rid)
        if st is not None:
            st.load_failed = True
            end_fetches(st)
