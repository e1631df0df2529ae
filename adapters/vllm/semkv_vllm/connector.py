"""``SemanticKVConnector``: semkv behind vLLM's KVConnector V1 API.

Operators select it with::

    --kv-transfer-config '{"kv_connector": "SemanticKVConnector",
        "kv_connector_module_path": "semkv_vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"provider": "chunks", "semantic_mode": "materialize_exact"}}'

One instance runs in the scheduler process (role SCHEDULER: discovery, admission, plans) and
one in every worker (role WORKER: block copies). See ``scheduler.py`` and ``worker.py`` for the
per-step protocol of each side, ``engine_setup.py`` for what is checked at start-up and
``engine_support.py`` for what an engine's requests can take (its KV-cache groups, its limits).

NOTE: configuration problems (unknown key, bad value, provider not installed, bad provider
config) raise at engine start-up, naming the problem; nothing starts half-configured.
NOTE: the connector is a best-effort cache: ``requires_kv_delivery`` is False, and every
failure at request time ends in normal prefill.
NOTE: with ``donor_store: lmcache`` an embedded LMCache connector (``lmcache_store.py``) stores
and moves the KV; every hook below is forwarded to it as well. With realized spans on too, a
second one in each worker fetches donors into semkv's host slots (``lmcache_fetch.py``); LMCache
never stores a request semkv served request-only, and loads only what semkv took from it.
NOTE: each request's blocks go back to vLLM once, after semkv's worker and the shared store are
both done with them: ``update_connector_output`` rewrites the step's finished sets first
(``finish_order.py``).
NOTE: vLLM 0.33's sleep mode is refused (``sleep_mode.py``): semkv keeps references to the KV
tensors it was handed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from semkv.breaker import Breaker
from semkv.config import SemkvConfig
from semkv.log import get_logger
from semkv.types import Mode
from semkv_vllm.class_gate import ClassGate
from semkv_vllm.commit_policy import ExternalKVCachePolicy
from semkv_vllm.cost_gate import EngineCost
from semkv_vllm.engine_setup import (
    build_provider,
    build_shared_store,
    check_semantic_setup,
    check_store_fits_host,
    forward_context,
    probe_layout,
    realizes_spans,
    store_capacity,
    store_geometry,
)
from semkv_vllm.engine_support import engine_support, kv_groups
from semkv_vllm.lmcache_lookup import LMCacheLookups
from semkv_vllm.metadata import SemkvMetadata, SemkvWorkerMetadata
from semkv_vllm.namespace import namespace_after_reset, namespace_from_vllm_config
from semkv_vllm.rope import RopeShift
from semkv_vllm.scheduler import SchedulerSide
from semkv_vllm.sleep_mode import SleepModeUnsupported
from semkv_vllm.span_admission import realize_budget
from semkv_vllm.stats import SemkvConnectorStats, SemkvPromMetrics
from semkv_vllm.vllm_compat import kv_cache_access, skips_external_kv
from semkv_vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = get_logger("semkv.vllm.connector")


class SemanticKVConnector(SleepModeUnsupported, KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.config = SemkvConfig.load(extra)
        check_semantic_setup(self.config, vllm_config)
        self._shared: Any = None  # donor_store=lmcache: LMCache's connector, same role
        self._shared_loads: Any = None
        self._shared_found: dict[str, int] = {}  # request id -> tokens LMCache can load
        self._shared_lookups: LMCacheLookups | None = None  # its deadline and breaker
        self._shared_meta: Any = None  # this step's LMCache metadata (worker side)
        self._deferred_save: Any = None  # KV on CPU: LMCache's store runs a step later
        if self.config.donor_store == "lmcache":
            self._shared, self._shared_loads = build_shared_store(
                self.config, vllm_config, role, kv_cache_config)
        semantic = (self.config.semantic_mode is Mode.MATERIALIZE_SEMANTIC
                    and bool(self.config.semantic_tiers))
        # donor_store=lmcache with realized spans: donors are fetched into host slots
        self._fetches = self._shared is not None and semantic and self.config.realize_spans
        rope = RopeShift.from_vllm_config(vllm_config) if semantic else None
        slots, per_slot = store_geometry(self.config, kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self.commit_policy_enforced = False  # set by CommitPolicyScheduler
        if role == KVConnectorRole.SCHEDULER:
            block_size = vllm_config.cache_config.block_size
            support = engine_support(self.config, vllm_config, kv_cache_config)
            said = support.log_fields(self.config)
            # one line: what this engine's requests get (each refusal is counted per request)
            (log.info if "why" not in said else log.warning)("semkv_engine_support", **said)
            provider = (None if self.config.semantic_mode is Mode.DISABLED
                        else build_provider(self.config, vllm_config, block_size))
            self._scheduler = SchedulerSide(
                self.config, block_size=block_size,
                namespace=namespace_from_vllm_config(vllm_config), num_slots=slots,
                bytes_per_slot=per_slot,
                support=support, provider=provider,
                can_shift=rope is not None,
                request_only_enforced=lambda: (
                    self.commit_policy_enforced
                    or not vllm_config.cache_config.enable_prefix_caching),
                shared_lookup=self._shared_lookup if self._shared is not None else None,
                fetch_lookups=self._fetch_lookups(),
                realize_budget=(realize_budget(self.config, vllm_config)
                                if semantic and self.config.realize_spans else None),
                class_gate=(ClassGate.for_engine(self.config, vllm_config)
                            if self.config.realize_spans and (
                                semantic or self.config.semantic_mode is Mode.DISCOVERY_ONLY)
                            else None),
                cost_gate=EngineCost.from_vllm_config(vllm_config))
            if self._shared is not None:
                self._shared_lookups = LMCacheLookups(
                    self.config.lmcache_lookup_timeout_ms / 1e3,
                    Breaker(self.config.lmcache_retry_s), self._scheduler.stats)
            log.info("semkv_connector_ready", mode=str(self.config.semantic_mode),
                     provider=self.config.provider, slots=slots, bytes_per_slot=per_slot,
                     block_size=block_size, **store_capacity(
                         self.config, slots, per_slot, block_size,
                         vllm_config.model_config.max_model_len))
        else:
            check_store_fits_host(self.config)
            self._worker = WorkerSide(slots, layerwise=self.config.layerwise_load, rope=rope,
                                      async_save=self.config.async_save,
                                      transfer_timeout_s=self.config.transfer_timeout_s,
                                      groups=kv_groups(kv_cache_config))
        self._semantic = semantic
        self._loads_async = (self.config.async_load or self._shared is not None
                             or realizes_spans(self.config))

    def realized_spans_refusal(self) -> str | None:
        """Why this engine's requests get no realized span (None: they can). The workers' part
        is known once they have reported with their first step (``semkv calibrate`` asks after
        its warm-up request and fails on an answer, before measuring anything)."""
        side = self._scheduler
        assert side is not None, "scheduler role only"
        if side.support.realize is not None:
            return side.support.realize.why
        if not (realizes_spans(self.config) and side.spans is not None):
            return ("realized spans are off in this configuration (realize_spans, "
                    "semantic_mode materialize_semantic, semantic_tiers with verified)")
        return side.workers_refusal()

    def _fetch_lookups(self) -> Any:
        if not self._fetches:
            return None
        from semkv_vllm.lmcache_fetch import FetchLookups

        return FetchLookups(self._shared.scheduler_adapter,
                            timeout_s=self.config.transfer_timeout_s)

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34 asks at config time how the workers reach the KV cache
        (``vllm_compat.kv_cache_access`` says what semkv answers, and why)."""
        from vllm.platforms import current_platform

        config = SemkvConfig.load(kv_transfer_config.kv_connector_extra_config or {})
        return kv_cache_access(config.donor_store, on_cuda=current_platform.is_cuda())

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.34: may vLLM hash blocks with an EAGLE-family drafter's lookahead tokens?
        Yes, vLLM's default for its own prefix cache: a False answer turns lookahead hashing
        off for the whole engine (every prefix hit then drops its last block). semkv serves no
        request of an engine that speculates (``engine_support``: speculative decoding), so
        nothing it loads depends on those hashes.

        NOTE: serving such engines (issue #70) must revisit this: the drafter's KV at a
        block's last position reads lookahead tokens, so a block semkv loads is only a
        lookahead-hashed block if that KV comes with it."""
        del kv_transfer_config  # the answer holds for every semkv configuration
        return True

    def may_load_async(self, request: Request) -> bool:
        """vLLM 0.34 (``--max-num-inflight-kv-loads``): may this request's hit load between
        steps? Where the engine loads asynchronously at all (``async_load``, LMCache, realized
        spans), unless vLLM discards the request's hit. Cheap: asked as requests queue."""
        return self._loads_async and not skips_external_kv(request)

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # -- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        if self._shared is not None:
            from semkv_vllm.lmcache_store import DeferredSave, holds_saves, init_cpu_amx

            init_cpu_amx()
            self._shared.register_kv_caches(kv_caches)
            if holds_saves(kv_caches):
                self._deferred_save = DeferredSave(self._shared)
            log.info("lmcache_saves", held_one_step=self._deferred_save is not None)
        if self.config.semantic_mode.materializes and (self._shared is None or self._fetches):
            self._worker.register_kv_caches(kv_caches)  # with LMCache: the fetches' slots
        if self._fetches:
            from semkv_vllm.lmcache_fetch import HostFetcher

            self._worker.fetcher = HostFetcher(
                self._vllm_config, self.config, self._kv_cache_config,
                namespace_from_vllm_config(self._vllm_config).digest)
            self._worker.fetcher.register(self._worker.store)
        if self._semantic:
            self._worker.layout = probe_layout(self._vllm_config, kv_caches)
            self._worker.report_layout = True
            log.info("page_layout", known=self._worker.layout is not None)
            if self.config.realize_spans:
                from semkv_vllm.models import find_engine_model
                from semkv_vllm.realization import SpanRealizer

                # NOTE: vLLM calls this hook from its model runner's initialize_kv_cache: the
                # engine's loaded model is one frame up (semkv_vllm.models explains why).
                built = SpanRealizer.build(
                    find_engine_model(), self._worker.layout, kv_caches, self._worker.store,
                    self.config, forward_context(self._vllm_config), self._worker.group_of)
                self._worker.realizer = built if isinstance(built, SpanRealizer) else None
                self._worker.realize_why = built if isinstance(built, str) else None
                self._worker.report_realize = True
                log.info("span_realization", available=self._worker.realizer is not None)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if self._deferred_save is not None:
            self._deferred_save.run()  # normally already run by handle_preemptions
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind(connector_metadata)
        if self._shared is not None and isinstance(connector_metadata, SemkvMetadata):
            self._shared_meta = connector_metadata.shared
            self._shared.bind_connector_metadata(connector_metadata.shared)
            self._shared_loads.bind(connector_metadata.shared)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear()
        if self._shared is not None:
            self._shared_meta = None
            self._shared.clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_load_kv()
        if self._shared is not None:
            self._shared.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)
        if self._shared is not None:
            self._shared.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        if self._shared is not None:
            self._shared.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        # semkv's own saves run after the forward in wait_for_save (whole blocks only)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save()
        if self._deferred_save is not None and self._shared_meta is not None:
            self._deferred_save.hold(self._shared_meta)
        elif self._shared is not None:
            self._shared.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        sending: set[str] = set()
        recving = self._worker.take_finished_recving(finished_req_ids)
        if self._shared is not None:
            shared_sending, shared_recving = self._shared.get_finished(finished_req_ids)
            sending |= shared_sending or set()
            self._shared_loads.finished |= shared_recving or set()
            recving |= shared_recving or set()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``'s, plus the loads that failed on an engine with several KV-cache
        groups (reported per request: vLLM then recomputes the request from its start)."""
        results = super().get_transfer_results(finished_req_ids)
        if self._worker is not None:
            results.failed_recving |= self._worker.take_failed_recving()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        invalid = self._worker.take_invalid_blocks()
        if self._shared is not None:
            shared = set(self._shared.get_block_ids_with_load_errors())
            self._shared_loads.errors |= shared
            invalid |= shared
        return invalid

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        meta = self._worker.take_worker_meta()
        if self._shared is not None:
            loaded, failed = self._shared_loads.take()
            if loaded or failed:
                meta = meta or SemkvWorkerMetadata()
                block = self._vllm_config.cache_config.block_size
                meta.loaded_blocks.update({rid: t // block for rid, t in loaded.items()})
                meta.failed |= failed
        return meta

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # NOTE: vLLM calls this first in every step, before freed blocks are zeroed or
        # rewritten: the last moment an in-flight save may still read them.
        if self._worker is not None:
            self._worker.drain_saves()
        if self._deferred_save is not None:
            self._deferred_save.run()
        if self._shared is not None and isinstance(kv_connector_metadata, SemkvMetadata):
            self._shared.handle_preemptions(kv_connector_metadata.shared)

    def get_kv_connector_stats(self) -> SemkvConnectorStats | None:
        side = self._scheduler or self._worker
        if side is None:
            return None
        if isinstance(side, WorkerSide):
            side.harvest_saves()
        bag = side.take_stats() if isinstance(side, SchedulerSide) else side.stats.take()
        return None if bag.is_empty() else SemkvConnectorStats(data=bag.to_dict())

    # -- scheduler side --------------------------------------------------------------------
    @contextmanager
    def _timed(self) -> Iterator[None]:
        """Adds the hook's wall time to the step's scheduler-side overhead."""
        started = time.perf_counter()
        try:
            yield
        finally:
            if self._scheduler is not None:
                self._scheduler.hook_seconds += time.perf_counter() - started

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.kv_cache_manager = kv_cache_manager
            pool = getattr(kv_cache_manager, "block_pool", None)
            null = getattr(getattr(pool, "null_block", None), "block_id", None)
            if isinstance(null, int):
                self._scheduler.null_block = null

    def on_new_request(self, request: Request) -> None:
        if self._scheduler is not None:
            with self._timed():
                self._scheduler.on_new_request(request)
        if self._shared is not None:
            self._shared.on_new_request(request)

    def _shared_lookup(self, request: Request, num_computed_tokens: int) -> int | None:
        """Tokens the shared store can load beyond the local prefix (asked first, below)."""
        return self._shared_found.get(request.request_id, 0)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        if self._shared is not None:
            # LMCache is asked about every request, as vLLM would (it tracks each request's
            # blocks from here on for its saves); semkv decides whether its answer is taken.
            def ask() -> int | None:
                tokens: int | None = self._shared.get_num_new_matched_tokens(
                    request, num_computed_tokens)[0]
                return tokens

            assert self._shared_lookups is not None  # its wait is bounded (lmcache_lookup.py)
            found = self._shared_lookups.found(request.request_id, ask)
            if found is None:
                return None, False  # its lookup is still running: vLLM asks again next step
            self._shared_found[request.request_id] = int(found)
        with self._timed():
            return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_kv_cache_policy(self, request_id: str,
                                     num_external_tokens: int) -> ExternalKVCachePolicy:
        """Side-effect free; consulted by ``CommitPolicyScheduler`` before every commit."""
        if self._scheduler is None:
            return ExternalKVCachePolicy.EXACT_COMMIT
        return ExternalKVCachePolicy(self._scheduler.cache_policy(request_id).value)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        shared = self._shared is not None and self._scheduler.loads_from_shared(
            request.request_id)
        with self._timed():
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
        if self._shared is not None:  # it also tracks every request's blocks for its saves
            # it loads only what semkv took from it (never into a realized span)
            self._shared.update_state_after_alloc(request, blocks,
                                                  num_external_tokens if shared else 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        with self._timed():
            meta = self._scheduler.build_connector_meta(scheduler_output)
            meta.step = self._scheduler.step_work(scheduler_output)  # cost gate
        if self._shared is not None:
            meta.shared = self._shared.build_connector_meta(scheduler_output)
            keep_out = self._scheduler.keeps_out_of_shared_store
            requests = getattr(meta.shared, "requests", None)
            if requests:  # request-only KV (and opted-out requests) never enter the store
                meta.shared.requests = [r for r in requests if r.direction != "STORE"
                                        or not keep_out(r.request_id)]
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            with self._timed():
                for rid in connector_output.finished_recving or ():  # read, written or not
                    self._scheduler.window_pins.release(rid)
                # NOTE: before vLLM reads the finished sets (finish_order.py says why)
                self._scheduler.finish_order.rewrite(connector_output)
                self._scheduler.update_connector_output(connector_output.kv_connector_worker_meta)
        if self._shared is not None:
            self._shared.update_connector_output(connector_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        delay_free = False
        if self._shared is not None:
            self._shared_found.pop(request.request_id, None)
            if self._shared_lookups is not None:
                self._shared_lookups.forget(request.request_id)
            # LMCache may still be saving the request's blocks: it frees them when done.
            delay_free, _ = self._shared.request_finished(request, block_ids)
        with self._timed():
            summary = self._scheduler.request_finished(request, shared_delays_free=delay_free)
        return delay_free, summary

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def reset_cache(self) -> bool | None:
        if self._scheduler is not None:
            self._scheduler.reset()
            # weights reloaded in place (what this reset follows) make another namespace
            self._scheduler.namespace = namespace_after_reset(
                self._scheduler.namespace, self._vllm_config, shared_kv=self._shared is not None)
        if self._shared is not None:
            self._shared.reset_cache()  # asks the server to drop what no one holds
        return True

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
        if self._deferred_save is not None:
            self._deferred_save.run_at_exit()  # the last step's store
        if self._shared is not None:
            self._shared.shutdown()

    # -- metrics ---------------------------------------------------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> SemkvConnectorStats:
        return SemkvConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> SemkvPromMetrics:
        return SemkvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _register_by_name() -> None:
    """Make ``SemanticKVConnector`` known to vLLM's connector registry by name.

    NOTE: operators load it by module path, which bypasses the registry; but vLLM's
    MultiConnector rebuilds each child's stats by class name in the API process, and fails
    for a child it cannot find there. Importing this module (which every path does) fixes that.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if SemanticKVConnector.__name__ not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(SemanticKVConnector.__name__, __name__,
                                              SemanticKVConnector.__name__)


_register_by_name()
