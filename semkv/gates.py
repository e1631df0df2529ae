"""Admission gates: pure functions, each answering "may this candidate pass?".

Every gate returns ``None`` when the candidate passes and the ``FallbackReason`` that rejects
it otherwise, so admission can report exactly which gate stopped a request. The full-prompt cap
is the one gate that shapes a number instead of rejecting: it returns how many external tokens
may be reported.

NOTE: the namespace gate lives in ``semkv.namespace`` beside the type it guards.
"""

from __future__ import annotations

from semkv.types import TIERS_ALLOWED_BY_MODE, FallbackReason, Mode, QualityTier


def tier_gate(mode: Mode, tier: QualityTier) -> FallbackReason | None:
    if mode in (Mode.DISABLED,):
        return FallbackReason.PROVIDER_DISABLED
    if tier not in TIERS_ALLOWED_BY_MODE[mode]:
        return FallbackReason.RECOMPUTE_POLICY
    return None


def similarity_gate(similarity: float, min_similarity: float) -> FallbackReason | None:
    if not similarity >= min_similarity:  # also rejects NaN
        return FallbackReason.LOW_SIMILARITY
    return None


def reuse_tokens_gate(external_tokens: int, min_reuse_tokens: int) -> FallbackReason | None:
    if external_tokens <= 0 or external_tokens < min_reuse_tokens:
        return FallbackReason.LOW_REUSE_TOKENS
    return None


def block_alignment_gate(
    start: int, num_tokens: int, block_size: int, *, required: bool = True
) -> FallbackReason | None:
    """A span is aligned when it starts and ends on block boundaries."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if required and (start % block_size or num_tokens % block_size):
        return FallbackReason.NOT_BLOCK_ALIGNED
    return None


def prefix_anchor_gate(target_start: int, local_prefix_tokens: int) -> FallbackReason | None:
    """vLLM's connector API only takes a span that continues the local prefix."""
    if target_start != local_prefix_tokens:
        return FallbackReason.NOT_PREFIX_ANCHORED
    return None


def full_prompt_cap(
    num_prompt_tokens: int,
    local_prefix_tokens: int,
    external_tokens: int,
    block_size: int,
    *,
    synchronous: bool = True,
) -> int:
    """How many external tokens may be reported, in whole blocks.

    NOTE: vLLM does not clamp synchronous external hits; a sync answer covering the whole prompt
    trips an assertion. So a sync answer always leaves at least one prompt token to compute.
    Async loads are clamped by the engine after the load, but the cap still keeps them whole.
    """
    if min(num_prompt_tokens, local_prefix_tokens, external_tokens) < 0 or block_size <= 0:
        raise ValueError("token counts must be >= 0 and block_size > 0")
    limit = num_prompt_tokens - local_prefix_tokens - (1 if synchronous else 0)
    allowed = max(0, min(external_tokens, limit))
    end = local_prefix_tokens + allowed
    return max(0, end - end % block_size - local_prefix_tokens)
