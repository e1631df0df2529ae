"""Scheduler side: whether a request's candidates become a realized span, and the engine-side
conditions any non-exact reuse needs (admission has judged the tokens; this judges the engine).

Called from ``SchedulerSide._decide`` with the request's candidates and the admitted match:

- ``realize``: a realized span from all candidates when it serves more than the match (an
  exact match it does not beat stays the answer); the plan's leases and pins are held in the
  request's ``SpanHold`` from here on;
- ``refuse_non_exact``: the reason a non-exact match or plan cannot be served on this engine
  (no request-only policy in force, pages or positions that cannot be edited), or None.

NOTE: with realization on, one donor's KV is never laid over differing target tokens: a
non-exact single-donor match that no plan beats falls back.
NOTE: a plan the gate policy does not serve (``uncertified_class``), the cost gate prices under
``realize_min_gain`` (``low_predicted_gain``), the engine's own limits refuse
(``realize_memory_bytes``: ``allocation_failed``; ``EngineSupport.realize``: tensor parallelism
``unsupported_request``, KV-cache groups ``unsupported_kv_groups``)
or that finds a donor gone (``donor_stale``) is reported as that refusal with the plan's class
(``RequestState.refused_span``), counted in ``realize_refused``, not as the admission's reason
for the single-donor match. An exact match the plan would have beaten is served instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from semkv.admission import Assessment, DonorView
from semkv.leases import LeaseTable
from semkv.metrics import CounterBag
from semkv.plan_class import plan_class
from semkv.span_plan import plan_span
from semkv.types import Candidate, FallbackReason, QualityTier, SemanticKVMatch
from semkv_vllm.engine_support import EngineSupport
from semkv_vllm.request_state import RequestState
from semkv_vllm.span_admission import SpanAdmission
from semkv_vllm.worker_capabilities import WorkerCapabilities


class SpanDecision:
    """Handed by ``SchedulerSide`` what the decisions read: span admission (None: no realized
    spans), the lease table (a superseded match's lease is released), the class gate and the
    counters (``count_would``), the block size and the least copied tokens a plan takes,
    ``span_view`` (a donor's tokens, other engines' fetchable ones included), whether
    request-only reuse is enforced, what the engine supports, the workers' capabilities, and
    whether this model's key positions can be moved (``can_shift``)."""

    def __init__(self, *, spans: SpanAdmission | None, leases: LeaseTable, class_gate: Any,
                 stats: CounterBag, block_size: int, min_copied_tokens: int,
                 span_view: Callable[[str], DonorView | None],
                 request_only_enforced: Callable[[], bool], support: EngineSupport,
                 workers: WorkerCapabilities, can_shift: bool) -> None:
        self.spans = spans
        self.leases = leases
        self.class_gate = class_gate
        self.stats = stats
        self.bs = block_size
        self.min_copied_tokens = min_copied_tokens
        self.span_view = span_view
        self.request_only_enforced = request_only_enforced
        self.support = support
        self.workers = workers
        self.can_shift = can_shift  # positions of this model's keys can be moved (RoPE)

    def realize(self, st: RequestState, local: int, candidates: list[Candidate],
                match: SemanticKVMatch) -> SemanticKVMatch | None:
        """The realized span's answer, a fallback, or None (``match`` stands)."""
        spans = self.spans
        assert spans is not None
        rid = st.request.request_id
        exact = match if match.is_hit and match.quality_tier is QualityTier.EXACT else None
        refusal = self.refuse_non_exact(st.assessment, realize=True)
        planned = (refusal if refusal is not None else spans.plan(
            rid, st.request.all_token_ids, local, candidates, self.span_view,
            st.namespace.digest, exact, st.recompute,
            st.options.reuse_until if st.options is not None else None,
            request_recompute=st.options is not None and st.options.recompute is not None))
        # a plan was made, then refused (a gate, the engine's limits, a stale donor): the
        # request falls back as that refusal (a plan is a tuple: not hashable)
        planned_now = refusal is None  # refused_class is the last plan's: this one's only now
        refused_class = (spans.refused_class
                         if planned_now and isinstance(planned, FallbackReason) else None)
        engine_refused = refused_class is not None
        if isinstance(planned, FallbackReason) and engine_refused:
            st.refused_span = (refused_class, planned)
        if not isinstance(planned, FallbackReason):
            if match.is_hit:
                self.leases.release(match.donor_lease_id or "")
            realized, st.span = planned
            return realized
        if exact is not None:
            return None  # the exact tier serves it
        if match.is_hit or engine_refused:
            if match.is_hit:
                self.leases.release(match.donor_lease_id or "")
            return SemanticKVMatch.fallback(rid, planned, local_prefix_tokens=local)
        return None

    def count_would(self, st: RequestState, local: int, candidates: list[Candidate]) -> None:
        """``discovery_only``: the class of the plan a realization would make, and whether the
        gate policy would serve it (``would_realize_spans`` / ``would_refuse_spans``). Nothing
        is held or loaded; the cost gate is not priced (no realization ran to learn from)."""
        if self.class_gate is None:
            return
        ns = st.namespace.digest
        donors: dict[str, Sequence[int]] = {}
        for c in candidates:
            v = self.span_view(c.donor_id)
            whole = 0 if v is None else len(v.token_ids) - len(v.token_ids) % self.bs
            if v is not None and c.namespace == ns and v.namespace == ns and whole > 0:
                donors[c.donor_id] = v.token_ids[:whole]
        plan = (plan_span(st.request.all_token_ids, donors, local_tokens=local,
                          block_size=self.bs, min_copied_tokens=self.min_copied_tokens,
                          namespace=ns)
                if donors else None)
        if plan is not None:
            cls = plan_class(plan)
            served = self.class_gate.served(cls, len(st.request.all_token_ids))
            self.stats.inc("would_realize_spans" if served
                           else "would_refuse_spans", cls.value)

    def refuse_non_exact(self, assessment: Assessment | None,
                         realize: bool = False) -> FallbackReason | None:
        if not self.request_only_enforced():
            return FallbackReason.RECOMPUTE_POLICY  # loaded KV could become exact cache state
        if realize:
            if self.support.realize is not None:
                return None  # planned: refused as the engine's limit, with its class
            return (None if self.workers.refusal() is None
                    else FallbackReason.UNSUPPORTED_REQUEST)
        if self.support.non_exact is not None:
            return self.support.non_exact.reason  # the engine's KV cache cannot take it
        span = assessment.span if assessment is not None else None
        if span is None or not self.workers.layout_known or (
                span.shifted and not self.can_shift):
            return FallbackReason.UNSUPPORTED_REQUEST  # pages or positions cannot be edited
        return None
