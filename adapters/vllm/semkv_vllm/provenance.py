"""Counting decisions and outcomes: the stats and the per-request provenance summary.

``count_decision`` runs once per decision (``get_num_new_matched_tokens``); ``account`` once
per request, in ``request_finished``. Its summary is logged as the ``provenance`` event and,
with ``summary_to_client``, returned to the client in ``kv_transfer_params["semkv"]``.

NOTE: counts, tiers and ids only: never prompt text, token ids or embeddings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from semkv.metrics import CounterBag
from semkv.plan_class import plan_class
from semkv.types import FallbackReason, Provenance, QualityTier, SemanticKVMatch
from semkv_vllm.request_state import RequestState


def count_decision(stats: CounterBag, d: SemanticKVMatch, prompt_tokens: int) -> None:
    stats.inc("lookup_requests")
    if d.is_hit:
        stats.inc("lookup_hits", d.quality_tier)
        stats.observe("request_external_tokens", d.external_prefix_tokens)
        stats.observe("request_similarity", d.similarity)
        stats.observe("request_reuse_ratio", d.external_prefix_tokens / max(prompt_tokens, 1))
    elif d.fallback_reason is FallbackReason.PROVIDER_MISS:
        stats.inc("lookup_misses")
    elif d.fallback_reason not in (FallbackReason.PROVIDER_ERROR,
                                   FallbackReason.PROVIDER_TIMEOUT):
        stats.inc("lookup_rejected", d.fallback_reason)  # errors: lookup_errors


def account(stats: CounterBag, st: RequestState) -> dict[str, Any]:
    """Count the request's outcome; return its provenance summary."""
    d = st.decision
    local = d.local_prefix_tokens if d is not None else 0
    if d is not None and d.is_hit and st.planned and not st.load_failed:
        tier = d.quality_tier or QualityTier.EXACT
        outcome = (Provenance.EXACT_EXTERNAL_KV_HIT if tier is QualityTier.EXACT
                   else Provenance.REQUEST_ONLY_SEMANTIC_REUSE)
        stats.inc("materialize_success", tier)
        stats.inc("external_tokens", tier, d.external_prefix_tokens)
        if st.span is not None:
            stats.inc("realized_spans", plan_class(st.span.plan))
        elif st.refused_span is not None and tier is QualityTier.EXACT:
            refusal = st.refused_span[1]  # the exact prefix served after that refusal
            stats.inc("refused_kept_exact", refusal)
            stats.inc("refused_kept_exact_tokens", refusal, d.external_prefix_tokens)
        reason = None
    else:
        if st.load_failed and not st.errored:  # under policy fail vLLM computes nothing
            stats.inc("materialize_recompute", FallbackReason.LOAD_FAILED)
        reason = (FallbackReason.LOAD_FAILED if st.load_failed
                  else d.fallback_reason if d is not None and d.fallback_reason
                  else FallbackReason.PROVIDER_MISS if d is not None
                  else FallbackReason.PROVIDER_DISABLED)
        tier = None
        a = st.assessment
        if a is not None and a.external_tokens > 0:
            stats.inc("would_reuse_tokens", a.tier, a.external_tokens)
        if a is not None and a.tier is not QualityTier.EXACT and not st.load_failed:
            outcome = Provenance.SEMANTIC_CANDIDATE_REJECTED
        elif local > 0:
            outcome = Provenance.EXACT_LOCAL_PREFIX_HIT
        else:
            outcome = Provenance.FALLBACK_RECOMPUTE
        stats.inc("fallbacks", reason)
    stats.inc("provenance", outcome)
    would = st.assessment.external_tokens if st.assessment is not None and tier is None else 0
    return {
        "provenance": str(outcome),
        "would_reuse_tokens": would,
        "tier": str(tier) if tier else None,
        "fallback_reason": str(reason) if reason else None,
        "local_prefix_tokens": local,
        "external_tokens": d.external_prefix_tokens if d is not None else 0,
        # 0 when the request stopped in the very step of its load (see update_connector_output)
        "confirmed_loaded_tokens": st.loaded_tokens,
        "donor_id": d.donor_id if d is not None else None,
        # served tokens identical to the target's own (1.0 for exact/verified hits)
        "similarity": d.similarity if d is not None and tier is not None else None,
        # a realized span: tokens copied (of which shifted and recomputed), computed inside it,
        # donors used, the class of its plan (semkv.plan_class), the cost gate's predicted
        # TTFT gain over a cold prefill (None: not priced)
        "span": ({**st.span.plan.summary(), "recomputed": st.recomputed_tokens,
                  "class": str(plan_class(st.span.plan)),
                  "predicted_gain": d.metadata.get("predicted_gain") if d is not None else None}
                 if st.span is not None and tier is not None else None),
        # non-exact reuse refused: the plan's class (None: one donor's span) and the reason;
        # an exact prefix served after it is this summary's tier and external_tokens
        "span_refused": ({"class": None if st.refused_span[0] is None
                          else str(st.refused_span[0]), "reason": str(st.refused_span[1])}
                         if st.refused_span is not None else None),
    }


def export_guard_counters(stats: CounterBag, counts: Mapping[str, int],
                          exported: dict[str, int]) -> None:
    """The provider guard's error counters (cumulative) as deltas since the last export."""
    for kind, value in counts.items():
        delta = value - exported.get(kind, 0)
        if delta:
            stats.inc("lookup_errors", kind, delta)
            exported[kind] = value
