"""What an engine's requests can take from semkv, read once at start-up from its configuration.

``engine_support(config, vllm_config, kv_cache_config)`` is called in the scheduler role of
``SemanticKVConnector.__init__``; the connector logs ``EngineSupport.log_fields`` in one line
(``semkv_engine_support``) and hands the result to ``SchedulerSide`` (each request refused by
the engine's reason, counted) and ``SpanAdmission`` (each plan refused as the engine's limit,
before the gates). ``kv_groups`` gives the workers each KV-cache group's layer names.

NOTE: a ``Limit``'s ``why`` stays short: a log line redacts longer strings as payload.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from semkv.config import SemkvConfig
from semkv.types import FallbackReason
from semkv_vllm.engine_setup import realizes_spans

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class Limit:
    """Why this engine's requests cannot take one kind of reuse. A refused request or plan is
    counted as ``reason`` (a realized span's plan also as ``realize_refused{counter}``)."""

    reason: FallbackReason
    counter: str
    why: str


@dataclass(frozen=True)
class EngineSupport:
    """What this engine's requests can take from semkv (None: they can; else why not).

    ``exact``: any donor KV at all (every request prefills normally, nothing is stored);
    ``non_exact``: KV laid over other tokens or positions (token-level edits, shifted or
    realized spans); ``realize``: realized spans (each plan refused, its exact prefix kept).
    ``groups``: the engine's KV-cache groups (several: per-group copies, loads asynchronous);
    ``windows``: each group's sliding window (None: full attention).
    NOTE: read once at start-up from the engine's configuration; the workers' own limits (page
    layout, the model's family) come with their first step (``WorkerCapabilities``).
    """

    exact: Limit | None = None
    non_exact: Limit | None = None
    realize: Limit | None = None
    groups: int = 1
    windows: tuple[int | None, ...] = (None,)

    @property
    def per_group(self) -> bool:
        """Do ops carry each group's blocks (several groups, or a window group's dropped
        blocks), their failures reported per request?"""
        return len(self.windows) > 1 or any(self.windows)

    def log_fields(self, config: SemkvConfig) -> dict[str, str]:
        """The start-up line: what this engine gets, and why not."""
        wants_realize = realizes_spans(config)
        realize = ("off" if not wants_realize else
                   "no" if (self.exact or self.realize) else "yes")
        why = self.exact or (self.realize if wants_realize else None)
        fields = {"exact_tier": "no" if self.exact else "yes", "realized_spans": realize}
        return fields | ({"why": why.why, "refused_as": why.reason.value}
                         if why is not None else {})


def kv_groups(kv_cache_config: KVCacheConfig) -> list[list[str]]:
    """The layer names of each KV-cache group (a group's layers share its block ids)."""
    return [list(group.layer_names) for group in kv_cache_config.kv_cache_groups]


def _kv_groups_limits(kv_cache_config: KVCacheConfig, block_size: int, config: SemkvConfig,
                      ) -> tuple[Limit | None, Limit | None, Limit | None]:
    """(exact, non-exact, realize) limits of the engine's KV-cache groups.

    One group of full-attention layers: none. Full-attention and sliding-window groups of the
    engine's block size (vLLM's hybrid manager: Gemma 3, gpt-oss; or every layer windowed): the
    exact tier copies and realized spans read and write each group's own blocks (a window
    group's out-of-window blocks are vLLM's null block, never written); token-level edits of
    KV address one group only. Anything else (Mamba, chunked local attention, other block
    sizes, LMCache's connector): nothing.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
    if len(specs) == 1 and type(specs[0]) in (FullAttentionSpec, MLAAttentionSpec):
        return None, None, None
    kinds = Counter(_spec_kind(spec) for spec in specs)
    listed = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    # NOTE: short (a log line redacts longer strings as payload); the reason says the rest
    limit = Limit(FallbackReason.UNSUPPORTED_KV_GROUPS, "kv_groups",
                  f"{len(specs)} KV-cache group(s) ({listed})")
    copyable = all(type(spec) in (FullAttentionSpec, SlidingWindowSpec)
                   and spec.block_size == block_size for spec in specs)
    if not copyable or config.donor_store == "lmcache":  # LMCache's connector: one group
        return limit, limit, limit
    return None, limit, None


def _spec_kind(spec: Any) -> str:
    window = getattr(spec, "sliding_window", None)
    name = type(spec).__name__.removesuffix("Spec")
    return f"{name} {window}" if window else name


def engine_support(config: SemkvConfig, vllm_config: VllmConfig,
                   kv_cache_config: KVCacheConfig) -> EngineSupport:
    """What this engine's requests can take from semkv, read from its configuration."""
    whole = None
    if vllm_config.speculative_config is not None:
        whole = "speculative decoding"
    elif vllm_config.model_config.is_encoder_decoder:
        whole = "encoder-decoder model"
    exact, non_exact, groups = (
        (Limit(FallbackReason.UNSUPPORTED_REQUEST, "engine", whole),) * 3 if whole is not None
        else _kv_groups_limits(kv_cache_config, vllm_config.cache_config.block_size, config))
    tp = vllm_config.parallel_config.tensor_parallel_size
    # NOTE: realized spans are refused under tensor parallelism: each rank would realize its
    # own heads, and one rank's failure, stale slot or deadline would leave the other ranks'
    # all-reduces unpaired (hang or wrong sums).
    realize = groups or (Limit(FallbackReason.UNSUPPORTED_REQUEST, "tensor_parallel",
                               f"tensor_parallel_size={tp}: realized spans run on one rank")
                         if tp > 1 else None)
    return EngineSupport(exact=exact, non_exact=non_exact, realize=realize,
                         groups=len(kv_cache_config.kv_cache_groups),
                         windows=kv_windows(kv_cache_config))


def kv_windows(kv_cache_config: KVCacheConfig) -> tuple[int | None, ...]:
    """Each KV-cache group's sliding window, where vLLM drops its out-of-window blocks."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return tuple(group.kv_cache_spec.sliding_window
                 if isinstance(group.kv_cache_spec, SlidingWindowSpec) else None
                 for group in kv_cache_config.kv_cache_groups)
