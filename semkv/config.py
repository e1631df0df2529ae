"""semkv's one validated configuration.

Sources, highest priority first:
1. ``SEMKV_<KEY>`` environment variables (e.g. ``SEMKV_SEMANTIC_MODE=discovery_only``;
   ``SEMKV_PROVIDER_CONFIG`` takes JSON);
2. an optional YAML file, named by ``config_file`` or ``SEMKV_CONFIG_FILE``;
3. the mapping handed in by the engine (vLLM's ``kv_connector_extra_config``);
4. the defaults below, which never materialize anything.

NOTE: every problem (unknown key, bad value, unknown ``SEMKV_*`` variable) raises
``ConfigError`` at start-up, naming the key and the closest valid one.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import ByteSize, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from semkv.types import Mode, QualityTier

ENV_PREFIX = "SEMKV_"
# SEMKV_* variables that are not config keys (read elsewhere, documented in the operator guide).
NON_CONFIG_ENV = frozenset(
    {"SEMKV_CONFIG_FILE", "SEMKV_LOAD_PLUGINS", "SEMKV_LOG_LEVEL", "SEMKV_CACHE_DIR",
     "SEMKV_ALLOW_FAULT_INJECTION", "SEMKV_FAULT_REALIZE_AFTER_LAYERS",
     "SEMKV_FAULT_STALL_FETCHES"}
)


class ConfigError(ValueError):
    """A configuration problem found at start-up. The message names the offending key."""


class SemkvConfig(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        frozen=True,
        validate_default=True,
    )

    provider: str = Field(default="chunks", min_length=1, description="Provider name to use.")
    semantic_mode: Mode = Field(default=Mode.DISCOVERY_ONLY, description="How far reuse goes.")
    min_similarity: float = Field(
        default=0.9, ge=0.0, le=1.0,
        description="Semantic tier: least fraction of reused tokens identical to the target's.")
    min_reuse_tokens: int = Field(default=128, ge=1, description="Exact tier: fewest tokens.")
    verified_min_reuse_tokens: int = Field(default=256, ge=1,
                                           description="Verified tier: fewest tokens.")
    semantic_min_reuse_tokens: int = Field(default=512, ge=1,
                                           description="Semantic tier: fewest tokens.")
    # The verified tier by default: realized spans, served only for the plan classes the gate
    # policy certifies for the engine's model (gate_policy). The semantic tier (one donor's KV
    # over differing tokens) measured at the response-cache baseline (docs/semantic-tier.md):
    # experimental, never on unless named here.
    semantic_tiers: frozenset[QualityTier] = Field(
        default=frozenset({QualityTier.VERIFIED}),
        description=("Non-exact tiers materialize_semantic may load (exact is always allowed): "
                     "verified (realized spans, gated by class); semantic is experimental."))
    realize_spans: bool = Field(default=True, description=(
        "materialize_semantic's verified tier realizes the span: identical tokens copied from "
        "one or more donors (keys re-rotated), every other span token computed through the "
        "engine's model between engine steps, served for the classes gate_policy certifies. "
        "False (experimental, no class gate): one donor's KV over the span (token swap), "
        "measured at the response-cache baseline."))
    # Selective recompute inside a realized span (semkv.realize.recompute). first_k (k 16): on
    # the measured frontier (docs/frontier.md) the cheapest strategy at the fp8-KV floor's mean
    # KL for cross-instruction and paraphrased lead-in reuse, 4.6x TTFT at 1K tokens.
    recompute_strategy: Literal["none", "first_k", "blend", "first_k_blend", "query",
                                "first_k_query", "query_valued"] = Field(
        default="first_k", description=(
            "Realized spans: which copied tokens are recomputed through the model. first_k: "
            "the first recompute_first_k of every copied segment; blend: the copied tokens "
            "whose K/V deviate most on the first recompute_probe_layers layers; query: the "
            "copied tokens the prompt's tail (its last recompute_query_tokens) attends to "
            "most over the assembled KV, recomputed from layer 0; query_valued: query's attention "
            "weighted by each copied token's value error on the first "
            "recompute_probe_layers layers; first_k_blend, first_k_query: that selection "
            "always holding first_k's tokens."))
    recompute_fraction: float = Field(default=0.15, ge=0.0, le=1.0, description=(
        "blend, query: copied tokens recomputed, as a fraction of the prompt's tokens "
        "(capped at the copied tokens; gaps and the tail are computed anyway and not "
        "charged)."))
    recompute_first_k: int = Field(default=16, ge=1, description=(
        "first_k: tokens recomputed at the start of every copied segment."))
    recompute_probe_layers: int = Field(default=2, ge=1, description=(
        "blend, query_valued: first layers computed for every span token to rank the copied "
        "ones (below the model's layer count, checked at worker start-up)."))
    recompute_query_tokens: int = Field(default=64, ge=1, description=(
        "query: the prompt's last tokens whose attention over the assembled KV ranks the "
        "copied ones (the whole tail after the last copied token is run)."))
    request_options: bool = Field(default=True, description=(
        "Read a request's kv_transfer_params['semkv_options'] (semkv.request_options): its "
        "opt-outs (lookup, save, reuse_until: less reuse, always safe), and the overrides "
        "request_overrides names; off: every option is ignored and counted."))
    request_overrides: frozenset[Literal["recompute", "kv_floor", "text"]] = Field(
        default=frozenset(), description=(
            "Request options a client may send that could reuse more, recompute less or change "
            "the KV (recompute, kv_floor, text); others are dropped and counted "
            "(request_options_refused). A recompute override still never recomputes less than "
            "the gate policy's strategy for the plan's class."))
    summary_to_client: bool = Field(default=False, description=(
        "Return each request's reuse summary (provenance, tier, donor, span, token counts) to "
        "its client in the response's kv_transfer_params['semkv']. Off: a response carries no "
        "reuse field (a client could otherwise test whether another tenant sent a document); "
        "the record stays in the metrics and the server's log."))
    block_aligned_only: bool = True
    lookup_timeout_ms: float = Field(default=50.0, gt=0.0, le=60_000.0)
    max_donors: int = Field(default=10_000, ge=1, description=(
        "Donors remembered at most (least recently used dropped first, never a leased one)."))
    index_memory_bytes: ByteSize = Field(default=ByteSize(256 << 20), ge=4 << 20, description=(
        "Host memory of the discovery state beside the donor store's KV: donors' token ids "
        "and block keys, the exact prefix index, the provider's index and caches, the anchor "
        "cache (a quarter). Past it the least recently used donors are dropped "
        "(semkv.index_memory)."))
    donor_store_bytes: ByteSize = Field(default=ByteSize(1 << 30), ge=1 << 20)
    async_lookup: bool = False
    async_load: bool = False
    async_save: bool = Field(default=True, description=(
        "Copy finished prompt blocks into the donor store on a background thread, off the "
        "step's critical path (drained before the next step touches the KV cache)."))
    layerwise_load: bool = Field(default=False, description="Copy donor KV layer by layer.")
    donor_store: Literal["host", "lmcache"] = Field(
        default="host",
        description="Where donor KV lives: semkv's host memory, or a shared LMCache server.")
    lmcache_server_url: str = Field(
        default="tcp://127.0.0.1:5555", pattern=r"^[a-z]+://[^:/]+:\d+$",
        description="donor_store=lmcache: the LMCache multiprocess server (scheme://host:port).")
    lmcache_lookup_timeout_ms: float = Field(default=2_000.0, gt=0.0, le=300_000.0, description=(
        "donor_store=lmcache: how long a request waits for the server's prefix lookup before "
        "it goes on without LMCache (lookup_errors lmcache_timeout); LMCache's own limit is "
        "lmcache.mp.mq_timeout, 300 s."))
    lmcache_retry_s: float = Field(default=1.0, ge=0.0, le=3_600.0, description=(
        "donor_store=lmcache: after a lookup timed out, lookups the server cannot answer at "
        "once are not waited for during this long (doubled per timeout in a row, at most "
        "30 s; lookup_errors lmcache_breaker_open)."))
    realize_memory_bytes: ByteSize = Field(default=ByteSize(1 << 30), ge=1 << 20, description=(
        "Realized spans: the most memory one realization may hold at once (its dense span KV "
        "plus one chunk's activations) per worker; larger plans fall back, counted."))
    transfer_timeout_s: float = Field(default=120.0, gt=0.0, le=3600.0, description=(
        "Realized spans and shared-store loads: how long a realization or a donor fetch may "
        "take before its span is reported invalid and vLLM recomputes it (load_failed). A "
        "deadline for what is stuck, not a speed gate: a long prompt's realization on a "
        "busy CPU engine can take tens of seconds."))
    gate_policy: str = Field(default="auto", min_length=1, description=(
        "Realized spans: which plan classes are served, and how (semkv.gate_policy). auto: "
        "the policy semkv ships for the engine's model, if any (else non-exact plans are "
        "refused as uncertified_class and counted); a path: a policy file semkv calibrate "
        "wrote for this model; ungated: every class, with the engine's strategy (measurement "
        "only)."))
    realize_min_gain: float = Field(default=1.2, ge=0.0, le=100.0, description=(
        "Realized spans, the cost gate: the least predicted TTFT gain over a cold prefill of "
        "the same prompt (rates the engine measured on its own prefills and realizations); "
        "a plan predicted below it falls back (low_predicted_gain), counted. 0: off "
        "(measurement only)."))
    provider_config: dict[str, Any] = Field(default_factory=dict)
    config_file: Path | None = Field(default=None, description="Optional YAML file.")

    @field_validator("gate_policy")
    @classmethod
    def _policy_file_exists(cls, value: str) -> str:
        if value not in ("auto", "ungated") and not Path(value).is_file():
            raise ValueError(f"no such policy file {value!r} (auto, ungated, or a file "
                             "semkv calibrate wrote)")
        return value

    @model_validator(mode="after")
    def _overrides_need_options(self) -> SemkvConfig:
        if self.request_overrides and not self.request_options:
            raise ValueError("request_overrides: needs request_options (on by default), which "
                             "is off")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        yaml_file = _yaml_path(init_settings())
        sources: list[PydanticBaseSettingsSource] = [env_settings]
        if yaml_file is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=yaml_file))
        sources.append(init_settings)
        return tuple(sources)

    @classmethod
    def load(cls, extra_config: Mapping[str, Any] | None = None) -> SemkvConfig:
        """Build the effective config or raise ``ConfigError`` naming the problem."""
        extra = dict(extra_config or {})
        env = os.environ
        _reject_unknown_env(env)
        _reject_unknown_keys(extra, where="kv_connector_extra_config")
        yaml_file = _yaml_path(extra) or env.get("SEMKV_CONFIG_FILE")
        if yaml_file is not None:
            path = Path(yaml_file)
            if not path.is_file():
                raise ConfigError(f"config_file: no such file {str(path)!r}")
            extra["config_file"] = path
            _reject_unknown_keys(_read_yaml(path), where=str(path))
        try:
            return cls(**extra)
        except ValidationError as exc:
            raise ConfigError(_describe(exc)) from None


def check_probe_layers(config: SemkvConfig, num_layers: int) -> None:
    """``recompute_probe_layers`` against the model the worker runs (start-up)."""
    if config.recompute_probe_layers >= num_layers:
        raise ConfigError(
            f"recompute_probe_layers: {config.recompute_probe_layers} must be below the "
            f"model's {num_layers} layers (blend continues the top fraction through the rest)")


def valid_keys() -> list[str]:
    return list(SemkvConfig.model_fields)


def _yaml_path(values: Mapping[str, Any]) -> Path | None:
    value = values.get("config_file")
    return Path(value) if value else None


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config_file {str(path)!r}: expected a mapping of keys to values")
    return data


def _closest(key: str) -> str:
    match = difflib.get_close_matches(key.lower(), valid_keys(), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _reject_unknown_keys(values: Mapping[str, Any], *, where: str) -> None:
    for key in values:
        if key not in SemkvConfig.model_fields:
            raise ConfigError(
                f"unknown semkv config key {key!r} in {where}{_closest(str(key))}; "
                f"valid keys: {', '.join(valid_keys())}"
            )


def _reject_unknown_env(environ: Mapping[str, str]) -> None:
    for name in environ:
        if not name.startswith(ENV_PREFIX) or name in NON_CONFIG_ENV:
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key not in SemkvConfig.model_fields:
            raise ConfigError(f"unknown semkv environment variable {name!r}{_closest(key)}")


def _describe(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"]) or "<config>"
        problems.append(f"{key}: {error['msg']} (got {error.get('input')!r})")
    return "invalid semkv config: " + "; ".join(problems)
