"""From an admitted decision to the worker's op, on the blocks vLLM allocated for it.

- A realized span (``RequestState.span``): its ``SpanHold`` writes the ``RealizeOp``.
- Exact tier: store slot i into the block after the local prefix plus i.
- One donor over differing tokens (verified/semantic token swap): the assessment's segments,
  donor blocks from the first one the span reads.

NOTE: a non-exact op is request-only: the request never becomes a donor either (``may_save``).
"""

from __future__ import annotations

from collections.abc import Sequence

from semkv.types import QualityTier
from semkv_vllm.metadata import LoadOp, RealizeOp
from semkv_vllm.request_state import RequestState


def realize_op(st: RequestState, block_ids: Sequence[int]) -> RealizeOp:
    assert st.span is not None
    op = st.span.op(st.request.request_id, st.request.all_token_ids, block_ids)
    op.kv_floor = st.options.kv_floor if st.options is not None else None
    st.may_save, st.request_only = False, True
    return op


def load_op(st: RequestState, block_ids: Sequence[int], block_size: int, *,
            asynchronous: bool) -> LoadOp:
    d = st.decision
    assert d is not None
    first = d.local_prefix_tokens // block_size
    targets = list(block_ids[first : first + d.external_prefix_tokens // block_size])
    op = LoadOp(st.request.request_id, list(st.pinned), list(st.generations), targets,
                asynchronous=asynchronous,
                kv_floor=st.options.kv_floor if st.options is not None else None)
    span = st.assessment.span if st.assessment is not None else None
    if d.quality_tier is not QualityTier.EXACT and span is not None:
        op.segments = list(span.segments)
        op.donor_first_block = span.donor_range()[0] // block_size
        op.target_start = span.target_start
        st.may_save, st.request_only = False, True
    return op
