"""The shared vocabulary of semkv.

Every value here crosses process boundaries (vLLM's API server, engine core and workers), so
all of them are frozen, fully typed, and round-trip through both ``pickle`` and JSON
(``model_dump_json`` / ``model_validate_json``).

NOTE: none of these types may carry prompt text, token ids or embeddings. Spans are counts and
offsets only; the token ids stay inside the scheduler and the provider.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _StrEnum(str, Enum):
    def __str__(self) -> str:
        return str(self.value)


class Mode(_StrEnum):
    """How far semkv may go for a request."""

    DISABLED = "disabled"  # no provider is imported; zero cost
    DISCOVERY_ONLY = "discovery_only"  # look up and count, never load
    MATERIALIZE_EXACT = "materialize_exact"  # load token-identical spans only
    MATERIALIZE_SEMANTIC = "materialize_semantic"  # also non-identical spans, request-only

    @property
    def materializes(self) -> bool:
        """Does this mode load donor KV (and so keep a donor store)?"""
        return self in (Mode.MATERIALIZE_EXACT, Mode.MATERIALIZE_SEMANTIC)


class QualityTier(_StrEnum):
    """What the reused span is, relative to the target's own tokens."""

    EXACT = "exact"  # identical tokens at identical positions, same namespace, block aligned
    VERIFIED = "verified"  # identical tokens, but taken from another offset in the donor
    SEMANTIC = "semantic"  # the donor span differs from the target tokens


class CachePolicy(_StrEnum):
    """Whether loaded KV may become exact prefix-cache state of the engine."""

    EXACT_COMMIT = "exact_commit"
    REQUEST_ONLY = "request_only"


class Materialization(_StrEnum):
    NONE = "none"
    SYNC = "sync"
    ASYNC = "async"


class FallbackReason(_StrEnum):
    """Why a request ended in normal prefill (DESIGN.md's sixteen; two gates of realized
    spans; the engine's KV-cache groups)."""

    EXACT_PREFIX_SUFFICIENT = "exact_prefix_sufficient"
    PROVIDER_DISABLED = "provider_disabled"
    PROVIDER_TIMEOUT = "provider_timeout"
    PROVIDER_ERROR = "provider_error"
    PROVIDER_MISS = "provider_miss"
    LOW_SIMILARITY = "low_similarity"
    LOW_REUSE_TOKENS = "low_reuse_tokens"
    NAMESPACE_MISMATCH = "namespace_mismatch"
    UNSUPPORTED_REQUEST = "unsupported_request"
    UNSUPPORTED_KV_GROUPS = "unsupported_kv_groups"  # the engine's KV-cache groups (hybrid models)
    NOT_PREFIX_ANCHORED = "not_prefix_anchored"
    NOT_BLOCK_ALIGNED = "not_block_aligned"
    DONOR_STALE = "donor_stale"
    ALLOCATION_FAILED = "allocation_failed"
    LOAD_FAILED = "load_failed"
    INVALID_BLOCKS = "invalid_blocks"
    RECOMPUTE_POLICY = "recompute_policy"
    UNCERTIFIED_CLASS = "uncertified_class"  # the gate policy does not serve the plan's class
    LOW_PREDICTED_GAIN = "low_predicted_gain"  # the cost gate: not predicted faster than cold


class Provenance(_StrEnum):
    """The class of reuse that actually happened for one request."""

    EXACT_LOCAL_PREFIX_HIT = "exact_local_prefix_hit"
    EXACT_EXTERNAL_KV_HIT = "exact_external_kv_hit"
    REQUEST_ONLY_SEMANTIC_REUSE = "request_only_semantic_reuse"
    SEMANTIC_CANDIDATE_REJECTED = "semantic_candidate_rejected"
    FALLBACK_RECOMPUTE = "fallback_recompute"


# Which tiers each mode may materialize. Discovery-only and disabled load nothing.
TIERS_ALLOWED_BY_MODE: dict[Mode, frozenset[QualityTier]] = {
    Mode.DISABLED: frozenset(),
    Mode.DISCOVERY_ONLY: frozenset(),
    Mode.MATERIALIZE_EXACT: frozenset({QualityTier.EXACT}),
    Mode.MATERIALIZE_SEMANTIC: frozenset(QualityTier),
}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)


class Candidate(_Frozen):
    """One donor a provider proposes for a target request (provider output).

    The span says: ``num_tokens`` tokens of the donor starting at ``donor_start`` may serve the
    target's tokens starting at ``target_start``. Providers that cannot say where the shared
    span lies report ``num_tokens=0`` and leave the span to the verifier.
    """

    donor_id: str = Field(min_length=1)
    namespace: str = Field(min_length=1)
    similarity: float = Field(ge=0.0, le=1.0)
    donor_start: int = Field(default=0, ge=0)
    target_start: int = Field(default=0, ge=0)
    num_tokens: int = Field(default=0, ge=0)
    signals: dict[str, float] = Field(default_factory=dict)

    @field_validator("similarity")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("similarity must be finite")
        return value


class SemanticKVMatch(_Frozen):
    """The admission decision for one request: a match or a typed fallback."""

    request_id: str
    donor_id: str | None = None
    donor_lease_id: str | None = None
    similarity: float = Field(default=0.0, ge=0.0, le=1.0)
    local_prefix_tokens: int = Field(default=0, ge=0)
    external_prefix_tokens: int = Field(default=0, ge=0)
    donor_prefix_tokens: int = Field(default=0, ge=0)
    donor_offset_tokens: int = Field(default=0, ge=0)
    materialization: Materialization = Materialization.NONE
    quality_tier: QualityTier | None = None
    cache_policy: CachePolicy = CachePolicy.EXACT_COMMIT
    fallback_reason: FallbackReason | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _match_or_fallback(self) -> SemanticKVMatch:
        if self.fallback_reason is None:
            if self.donor_id is None or self.donor_lease_id is None or self.quality_tier is None:
                raise ValueError("a match needs donor_id, donor_lease_id and quality_tier")
            if self.external_prefix_tokens == 0:
                raise ValueError("a match must report external tokens")
        elif self.external_prefix_tokens != 0 or self.donor_lease_id is not None:
            raise ValueError("a fallback reports no external tokens and holds no lease")
        if self.quality_tier not in (None, QualityTier.EXACT) and (
            self.cache_policy is not CachePolicy.REQUEST_ONLY
        ):
            raise ValueError("non-exact tiers are request-only")
        return self

    @property
    def is_hit(self) -> bool:
        return self.fallback_reason is None

    @classmethod
    def fallback(
        cls,
        request_id: str,
        reason: FallbackReason,
        *,
        local_prefix_tokens: int = 0,
        **metadata: Any,
    ) -> SemanticKVMatch:
        return cls(
            request_id=request_id,
            fallback_reason=reason,
            local_prefix_tokens=local_prefix_tokens,
            metadata=metadata,
        )


class SemanticLoadPlan(_Frozen):
    """What the worker must copy for one request: donor blocks into engine-owned blocks."""

    request_id: str
    donor_id: str
    lease_id: str
    local_tokens: int = Field(ge=0)
    external_tokens: int = Field(gt=0)
    block_ids: tuple[tuple[int, ...], ...]  # per KV-cache group, only the blocks to fill
    donor_offset_tokens: int = Field(default=0, ge=0)
    block_aligned: bool = True

    @model_validator(mode="after")
    def _aligned(self) -> SemanticLoadPlan:
        if not self.block_ids or any(len(g) == 0 for g in self.block_ids):
            raise ValueError("a load plan names at least one block per KV-cache group")
        return self
