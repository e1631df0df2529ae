"""From an admitted decision to the worker's op, on the blocks vLLM allocated for it.

- A realized span (``RequestState.span``): its ``SpanHold`` writes the ``RealizeOp`` (with
  sliding-window or several KV-cache groups, on each group's blocks).
- Exact tier: store slot i into the block after the local prefix plus i (of every KV-cache
  group; a window group's null blocks are left alone).
- One donor over differing tokens (verified/semantic token swap): the assessment's segments,
  donor blocks from the first one the span reads.
- ``pin_slots``: a single-donor load's store slots, pinned at decision time (before any token
  is reported) so that no eviction rewrites them before the load.

NOTE: a non-exact op is request-only: the request never becomes a donor either (``may_save``).
"""

from __future__ import annotations

from collections.abc import Sequence

from semkv.types import QualityTier, SemanticKVMatch
from semkv_vllm.metadata import LoadOp, RealizeOp, block_groups
from semkv_vllm.request_state import RequestState
from semkv_vllm.store_index import StoreIndex


def pin_slots(st: RequestState, match: SemanticKVMatch, donor_keys: Sequence[bytes],
              index: StoreIndex, block_size: int) -> bool:
    """Pin the store slots a single-donor load reads (False: one is no longer stored)."""
    span = st.assessment.span if st.assessment is not None else None
    if match.quality_tier is QualityTier.EXACT or span is None:
        first, count = (match.local_prefix_tokens // block_size,
                        match.external_prefix_tokens // block_size)
    else:
        lo, hi = span.donor_range()
        first, count = lo // block_size, (hi - 1) // block_size - lo // block_size + 1
    found = [index.get(k) for k in donor_keys[first : first + count]]
    if any(f is None for f in found):
        return False
    st.pinned = [f[0] for f in found if f]
    st.generations = [f[1] for f in found if f]
    index.pin(st.pinned)
    return True


def realize_op(st: RequestState, block_ids: tuple[list[int], ...], *, null_block: int,
               pinned: dict[int, list[int]] | None = None) -> RealizeOp:
    """``block_ids``: the request's blocks of each KV-cache group. ``pinned``: None for one
    full-attention group (the op on its blocks); else every group's blocks go on the op, each
    window group's local prefix as pinned for it (``window_pins.py``; vLLM's table holds its
    null block where the window of the span's end has passed)."""
    assert st.span is not None
    rid, tokens = st.request.request_id, st.request.all_token_ids
    if pinned is None:
        op = st.span.op(rid, tokens, block_ids[0])
    else:
        bs = st.span.plan.block_size
        first, groups = block_groups(block_ids, 0, st.span.plan.span_tokens // bs, null_block,
                                     per_group=True)
        assert groups is not None
        for group, ids in pinned.items():
            groups[group][: st.span.plan.local_tokens // bs] = ids
        op = st.span.op(rid, tokens, first)
        op.groups = groups
    op.kv_floor = st.options.kv_floor if st.options is not None else None
    st.may_save, st.request_only = False, True
    return op


def load_op(st: RequestState, block_ids: tuple[list[int], ...], block_size: int, *,
            asynchronous: bool, null_block: int, per_group: bool = False) -> LoadOp:
    """``block_ids``: the request's blocks of each KV-cache group (vLLM's ``get_block_ids``);
    ``per_group``: the engine has a window group or several (``EngineSupport.per_group``)."""
    d = st.decision
    assert d is not None
    first = d.local_prefix_tokens // block_size
    targets, groups = block_groups(block_ids, first, d.external_prefix_tokens // block_size,
                                   null_block, per_group=per_group)
    op = LoadOp(st.request.request_id, list(st.pinned), list(st.generations), targets,
                asynchronous=asynchronous,
                kv_floor=st.options.kv_floor if st.options is not None else None,
                groups=groups)
    span = st.assessment.span if st.assessment is not None else None
    if d.quality_tier is not QualityTier.EXACT and span is not None:
        op.segments = list(span.segments)
        op.donor_first_block = span.donor_range()[0] // block_size
        op.target_start = span.target_start
        st.may_save, st.request_only = False, True
    return op
