"""Admission: turn a provider's candidates into one typed decision for one request.

Protocol: an engine adapter calls ``Admission.decide`` with the target's tokens, its local exact
prefix (whole blocks), the provider's candidates and a way to see each donor (``DonorView``)
and to lease it. Admission re-verifies every candidate against real tokens, classifies its
tier, applies the gates in a fixed order, and returns a ``SemanticKVMatch`` that is either a hit
(holding a fresh lease) or a fallback naming the first gate that stopped the best candidate.

NOTE: admission never trusts a provider's span or similarity: every candidate is re-verified
against real token ids by ``semkv.verify`` (exact prefix, longest identical run, similarity),
and the tier is decided from that.
NOTE: the exact tier wins whenever it passes its gates; only then are non-identical spans
mapped (``semkv.span_map``): identical tokens at another offset are the verified tier, spans
with token differences the semantic tier. Both are request-only, gated per tier by config.
NOTE: the lease is acquired last, only for the winning candidate, so a rejected request holds
nothing.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from semkv.config import SemkvConfig
from semkv.gates import full_prompt_cap, reuse_tokens_gate, tier_gate
from semkv.leases import Lease, UnknownDonorError
from semkv.namespace import Namespace, namespace_gate
from semkv.span_map import SpanMap, map_span
from semkv.types import (
    CachePolicy,
    Candidate,
    FallbackReason,
    Materialization,
    Mode,
    QualityTier,
    SemanticKVMatch,
)
from semkv.verify import Verification, verify


@dataclass(frozen=True)
class DonorView:
    """What admission may know of a donor: its namespace, tokens and how much KV is stored."""

    donor_id: str
    namespace: str
    token_ids: Sequence[int]
    stored_tokens: int  # leading tokens whose KV can be materialized right now


def as_tokens(tokens: Sequence[int]) -> array[int]:
    """Token ids as a compact machine array (8 bytes each instead of ~36 in a tuple)."""
    return tokens if isinstance(tokens, array) and tokens.typecode == "q" else array("q", tokens)


@dataclass(frozen=True)
class Assessment:
    """One candidate, verified: what tier it is and how many external tokens it could serve."""

    candidate: Candidate
    tier: QualityTier
    external_tokens: int
    reason: FallbackReason | None
    verification: Verification | None = None
    span: SpanMap | None = None  # non-identical tiers: which donor position serves each token


class Admission:
    def __init__(self, config: SemkvConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size

    def assess(
        self,
        target: Sequence[int],
        local_prefix_tokens: int,
        candidate: Candidate,
        donor: DonorView | None,
        namespace: Namespace,
        *,
        synchronous: bool,
    ) -> Assessment:
        """Verify one candidate; ``reason`` is None when every gate passes for this mode."""
        bs = self.block_size
        if donor is None:
            return Assessment(candidate, QualityTier.SEMANTIC, 0, FallbackReason.DONOR_STALE)
        if namespace_gate(namespace, donor.namespace) or candidate.namespace != donor.namespace:
            return Assessment(candidate, QualityTier.SEMANTIC, 0, FallbackReason.NAMESPACE_MISMATCH)
        # Only the stored part of a donor can be materialized; verify against that part.
        v = verify(target, donor.token_ids[: donor.stored_tokens], bs, candidate)
        # Exact tier: identical tokens from position 0, in whole stored blocks.
        external = v.exact_prefix_tokens - local_prefix_tokens
        if external > 0:
            allowed = full_prompt_cap(len(target), local_prefix_tokens, external, bs,
                                      synchronous=synchronous)
            reason = reuse_tokens_gate(allowed, self.config.min_reuse_tokens)
            if reason is None:
                reason = tier_gate(self.config.semantic_mode, QualityTier.EXACT)
            exact = Assessment(candidate, QualityTier.EXACT, allowed, reason, v)
            if reason is None or not self._maps_spans() or (
                    self.config.semantic_mode is Mode.DISCOVERY_ONLY):
                return exact  # discovery reports an exact span as exact, not as a longer map
        else:
            reason = (
                FallbackReason.EXACT_PREFIX_SUFFICIENT
                if local_prefix_tokens > 0
                else FallbackReason.NOT_PREFIX_ANCHORED
            )
            exact = Assessment(candidate, v.tier, 0, reason, v)
            if not self._maps_spans():
                return exact
        mapped = self._assess_span(target, local_prefix_tokens, candidate, donor, v,
                                   synchronous=synchronous)
        return mapped if mapped is not None else exact

    def _maps_spans(self) -> bool:
        """Non-identical spans are worth mapping when they may be loaded or are counted."""
        mode = self.config.semantic_mode
        return mode is Mode.DISCOVERY_ONLY or (
            mode is Mode.MATERIALIZE_SEMANTIC and bool(self.config.semantic_tiers))

    def _assess_span(self, target: Sequence[int], local: int, candidate: Candidate,
                     donor: DonorView, v: Verification, *, synchronous: bool) -> Assessment | None:
        cap = full_prompt_cap(len(target), local, len(target), self.block_size,
                              synchronous=synchronous)
        span = map_span(target, donor.token_ids[: donor.stored_tokens], local, self.block_size,
                        max_tokens=cap, min_agreement=self.config.min_similarity)
        if span is None:
            return None
        tier = span.tier
        if tier is QualityTier.EXACT:
            return None  # the exact path above already judged this span
        least = (self.config.verified_min_reuse_tokens if tier is QualityTier.VERIFIED
                 else self.config.semantic_min_reuse_tokens)
        reason = reuse_tokens_gate(span.num_tokens, least) or self._tier_allowed(tier)
        return Assessment(candidate, tier, span.num_tokens, reason, v, span)

    def _tier_allowed(self, tier: QualityTier) -> FallbackReason | None:
        reason = tier_gate(self.config.semantic_mode, tier)
        if reason is None and tier not in self.config.semantic_tiers:
            return FallbackReason.RECOMPUTE_POLICY
        return reason

    def decide(
        self,
        request_id: str,
        target: Sequence[int],
        local_prefix_tokens: int,
        candidates: Sequence[Candidate],
        donors: Callable[[str], DonorView | None],
        acquire: Callable[[str], Lease],
        namespace: Namespace,
        *,
        synchronous: bool = True,
    ) -> tuple[SemanticKVMatch, Assessment | None]:
        """The decision, and the best assessment (also for discovery-only accounting)."""
        mode = self.config.semantic_mode
        if mode is Mode.DISABLED:
            return SemanticKVMatch.fallback(request_id, FallbackReason.PROVIDER_DISABLED), None
        if not namespace.is_complete:
            return self._fallback(request_id, FallbackReason.NAMESPACE_MISMATCH,
                                  local_prefix_tokens), None
        if not candidates:
            return self._fallback(request_id, FallbackReason.PROVIDER_MISS,
                                  local_prefix_tokens), None
        assessed = [
            self.assess(target, local_prefix_tokens, c, donors(c.donor_id), namespace,
                        synchronous=synchronous)
            for c in candidates
        ]
        best = max(assessed, key=lambda a: (a.reason is None, a.tier is QualityTier.EXACT,
                                            a.external_tokens))
        if best.reason is not None:
            return self._fallback(request_id, best.reason, local_prefix_tokens,
                                  would_reuse_tokens=best.external_tokens,
                                  tier=str(best.tier)), best
        try:
            lease = acquire(best.candidate.donor_id)
        except UnknownDonorError:
            return self._fallback(request_id, FallbackReason.DONOR_STALE, local_prefix_tokens), best
        match = SemanticKVMatch(
            request_id=request_id,
            donor_id=best.candidate.donor_id,
            donor_lease_id=lease.lease_id,
            similarity=(1.0 if best.tier is QualityTier.EXACT
                        else best.span.agreement if best.span is not None
                        else best.candidate.similarity),
            local_prefix_tokens=local_prefix_tokens,
            external_prefix_tokens=best.external_tokens,
            donor_prefix_tokens=local_prefix_tokens + best.external_tokens,
            donor_offset_tokens=best.span.donor_range()[0] if best.span is not None else 0,
            materialization=Materialization.SYNC if synchronous else Materialization.ASYNC,
            quality_tier=best.tier,
            cache_policy=(
                CachePolicy.EXACT_COMMIT if best.tier is QualityTier.EXACT
                else CachePolicy.REQUEST_ONLY
            ),
        )
        return match, best

    @staticmethod
    def _fallback(
        request_id: str, reason: FallbackReason, local: int, **metadata: object
    ) -> SemanticKVMatch:
        return SemanticKVMatch.fallback(request_id, reason, local_prefix_tokens=local, **metadata)
