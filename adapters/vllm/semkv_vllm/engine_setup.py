"""Engine start-up for the connector: store size, provider, engine checks, page layout.

Everything here runs once, in ``SemanticKVConnector.__init__`` or ``register_kv_caches``, and
raises (naming the problem) rather than start half-configured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from semkv.config import ConfigError, SemkvConfig
from semkv.log import get_logger
from semkv.lookup import TOKEN_LIMIT, GuardedProvider
from semkv.provider import ProviderCapabilities, ProviderContext
from semkv.types import Mode, QualityTier
from semkv_vllm.namespace import namespace_from_vllm_config
from semkv_vllm.page_layout import PageLayout, backend_writer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = get_logger("semkv.vllm.connector")


def store_geometry(config: SemkvConfig, kv_cache_config: KVCacheConfig) -> tuple[int, int]:
    """(slots, bytes per slot): one slot holds one block of every layer."""
    per_slot = sum(
        group.kv_cache_spec.page_size_bytes * len(group.layer_names)
        for group in kv_cache_config.kv_cache_groups
    )
    slots = int(config.donor_store_bytes) // max(per_slot, 1)
    if config.semantic_mode.materializes and slots < 1:
        raise ValueError(
            f"donor_store_bytes={int(config.donor_store_bytes)} holds no block "
            f"(one block of every layer takes {per_slot} bytes)"
        )
    return max(slots, 1), per_slot


def store_capacity(config: SemkvConfig, slots: int, per_slot: int, block_size: int,
                   max_model_len: int) -> dict[str, int]:
    """The start-up line's sizing fields: how many tokens of this model the host store holds
    (``donor_store_bytes`` over one block of every layer); a warning when that is less than
    one prompt of ``max_model_len`` (its donors would evict one another before reuse)."""
    tokens = slots * block_size
    if config.semantic_mode.materializes and config.donor_store == "host" and (
            tokens < max_model_len):
        log.warning("donor_store_small", store_tokens=tokens, max_model_len=max_model_len,
                    why="donor_store_bytes holds fewer tokens than one prompt of max_model_len",
                    fix=f"donor_store_bytes >= {max_model_len * per_slot // block_size} bytes")
    return {"store_tokens": tokens, "bytes_per_token": per_slot // max(block_size, 1)}


def host_memory_available() -> tuple[int, str]:
    """Bytes this process can still take, and how that was read (for the error message).

    The least of the host's MemAvailable and the cgroup's remaining limit (containers).
    """
    import psutil

    available = int(psutil.virtual_memory().available)
    how = f"MemAvailable {available / 2**30:.2f} GiB"
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                left = int(limit) - int(f.read().strip())
            how += f", cgroup limit {int(limit) / 2**30:.2f} GiB with {left / 2**30:.2f} GiB left"
            available = min(available, left)
    except (OSError, ValueError):
        pass  # no cgroup v2 memory controller: the host figure stands
    return max(available, 0), how


def realizes_spans(config: SemkvConfig) -> bool:
    """Does this configuration realize spans (``realize_memory_bytes`` then applies)?"""
    return (config.semantic_mode is Mode.MATERIALIZE_SEMANTIC and config.realize_spans
            and QualityTier.VERIFIED in config.semantic_tiers)


def check_store_fits_host(config: SemkvConfig, *, realize_on_host: bool | None = None) -> None:
    """Refuse a donor store, plus the realization's bound where realizations run on the host,
    larger than the host can give, before any request is taken.

    ``realize_on_host`` (None: read from vLLM's platform): a realization's dense KV lives where
    the model's weights do; on an accelerator ``realization.check_realize_memory_fits_device``
    checks ``realize_memory_bytes`` against the device once vLLM has taken its KV cache.
    NOTE: run in the worker role at construction, before the worker allocates the store (the
    scheduler process would see memory the worker already took and refuse a fitting store).
    """
    store = (int(config.donor_store_bytes) if config.semantic_mode.materializes
             and config.donor_store == "host" else 0)
    realize = 0
    if realizes_spans(config):
        if realize_on_host is None:
            from vllm.platforms import current_platform

            realize_on_host = current_platform.is_cpu()
        realize = int(config.realize_memory_bytes) if realize_on_host else 0
    if store + realize == 0:
        return
    available, how = host_memory_available()
    if store > available:
        raise ConfigError(
            f"donor_store_bytes={store} ({store / 2**30:.2f} GiB) is more than this host can "
            f"give the donor store: {available / 2**30:.2f} GiB available ({how}); lower "
            f"donor_store_bytes (it is per worker, beside vLLM's own KV cache)")
    if store + realize > available:
        raise ConfigError(
            f"realize_memory_bytes={realize} ({realize / 2**30:.2f} GiB) on top of "
            f"donor_store_bytes={store} ({store / 2**30:.2f} GiB) is more than this host can "
            f"give: {available / 2**30:.2f} GiB available ({how}); lower realize_memory_bytes "
            f"(one realization's working set per worker: longer spans fall back) or "
            f"donor_store_bytes")


def lookup_budget_ms(config: SemkvConfig, capabilities: ProviderCapabilities) -> float:
    """The lookup budget: the operator's ``lookup_timeout_ms`` where set, else the larger of
    its default and what the provider says one lookup needs (``capabilities.lookup_ms``)."""
    if "lookup_timeout_ms" in config.model_fields_set or capabilities.lookup_ms is None:
        return config.lookup_timeout_ms
    return max(config.lookup_timeout_ms, capabilities.lookup_ms)


def build_provider(config: SemkvConfig, vllm_config: VllmConfig,
                    block_size: int) -> GuardedProvider:
    from semkv.plugins import get_provider_class

    cls = get_provider_class(config.provider)
    budget_ms = lookup_budget_ms(config, cls.capabilities)
    mc = vllm_config.model_config
    context = ProviderContext(
        block_size=block_size,
        detokenize=make_detokenizer(mc.tokenizer, mc.tokenizer_revision, mc.trust_remote_code),
        lookup_timeout_ms=budget_ms,
    )
    provider = cls.from_config(config.provider_config, context)
    log.info("lookup_budget", provider=config.provider, lookup_timeout_ms=budget_ms,
             source="config" if budget_ms == config.lookup_timeout_ms else "provider")
    # another engine's donors' token ids are read from a shared store: the model's ids only
    try:
        vocab = int(mc.get_vocab_size())
    except Exception:  # noqa: BLE001 - no vocabulary size to read: any 32-bit id
        vocab = TOKEN_LIMIT
    return GuardedProvider(provider, timeout_s=budget_ms / 1e3, token_limit=vocab)


def request_only_possible(vllm_config: VllmConfig) -> bool:
    """Can REQUEST_ONLY be enforced: prefix caching off, or the commit-policy scheduler on."""
    if not vllm_config.cache_config.enable_prefix_caching:
        return True
    from semkv_vllm.commit_policy import CommitPolicyMixin

    try:
        cls = vllm_config.scheduler_config.get_scheduler_cls()
    except Exception:  # noqa: BLE001 - an unresolvable class is vLLM's error to raise
        return False
    return isinstance(cls, type) and issubclass(cls, CommitPolicyMixin)


def check_semantic_setup(config: SemkvConfig, vllm_config: VllmConfig) -> None:
    if config.semantic_mode is Mode.MATERIALIZE_SEMANTIC and config.semantic_tiers and (
            not request_only_possible(vllm_config)):
        raise ConfigError(
            "semantic_mode=materialize_semantic needs REQUEST_ONLY enforcement: start vLLM with "
            "--scheduler-cls semkv_vllm.commit_policy.CommitPolicyScheduler (or with prefix "
            "caching off), or set semantic_tiers to [] to load the exact tier only")


def probe_layout(vllm_config: VllmConfig, kv_caches: dict[str, Any]) -> PageLayout | None:
    """Learn the page interior from the first attention layer's own cache-write kernel."""
    layers = vllm_config.compilation_config.static_forward_context
    for name, kv in kv_caches.items():
        writer = backend_writer(layers.get(name))
        if writer is None:
            continue
        try:
            return PageLayout.probe(writer, tuple(kv.shape[1:]), kv.dtype, kv.device)
        except Exception as exc:  # noqa: BLE001 - unknown layout: token-level loads refused
            log.warning("page_layout_probe_failed", error_type=type(exc).__name__)
            return None
    return None


def forward_context(vllm_config: VllmConfig) -> Callable[[], AbstractContextManager[Any]]:
    """The engine's forward context without attention metadata, for the layer runners: modules
    such as vLLM's fused MoE find their layer through it (``semkv_vllm.models.base``)."""
    from vllm.forward_context import set_forward_context

    return lambda: set_forward_context(None, vllm_config)


def build_shared_store(config: SemkvConfig, vllm_config: VllmConfig, role: KVConnectorRole,
                        kv_cache_config: KVCacheConfig) -> tuple[Any, Any]:
    """LMCache's connector in this role, on semkv's namespace (``lmcache_store.py``)."""
    from semkv_vllm.lmcache_store import (
        LoadTracker,
        check_setup,
        inner_vllm_config,
        lmcache_connector_class,
    )

    check_setup(config, vllm_config)
    digest = namespace_from_vllm_config(vllm_config).digest
    inner = lmcache_connector_class()(inner_vllm_config(vllm_config, config, digest), role,
                                      kv_cache_config)
    log.info("lmcache_donor_store", url=config.lmcache_server_url, role=str(role))
    return inner, LoadTracker()



def make_detokenizer(tokenizer_path: str, revision: str | None,
                     trust_remote_code: bool) -> Callable[[Sequence[int]], str]:
    """Lazy detokenizer for providers that need text (loaded on first use)."""
    tokenizer: Any = None

    def detokenize(token_ids: Sequence[int]) -> str:
        nonlocal tokenizer
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(
                tokenizer_path, revision=revision, trust_remote_code=trust_remote_code)
        return str(tokenizer.decode(list(token_ids), skip_special_tokens=False))

    return detokenize
