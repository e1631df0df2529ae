"""Cache-commit policy enforcement for vLLM 0.32, which has no per-request commit hook.

vLLM commits every full block of a request into its exact prefix cache through one choke
point, ``KVCacheCoordinator.cache_blocks`` (called by ``allocate_slots`` on the synchronous path
inside ``schedule()``, before any connector hook runs, and by ``cache_blocks`` after an async
load). ``CommitPolicyScheduler`` wraps that one call and asks the connector first::

    connector.get_external_kv_cache_policy(request_id, num_external_tokens)
        -> ExternalKVCachePolicy.EXACT_COMMIT | ExternalKVCachePolicy.REQUEST_ONLY

A REQUEST_ONLY request commits nothing: neither the externally loaded span nor any block
computed on top of it ever becomes exact prefix-cache state, on the sync and the async path,
so no later request can hit a block whose KV is approximate. Blocks the request took from the
prefix cache itself (its local exact prefix) were committed by their own computation and stay.

Select it with ``--scheduler-cls semkv_vllm.commit_policy.CommitPolicyScheduler``. The name
gives the scheduler vLLM would have chosen itself, with the policy applied: ``AsyncScheduler``
when async scheduling is on (vLLM's default), ``Scheduler`` when it is off. vLLM instantiates the
named class; its ``__new__`` reads ``scheduler_config.async_scheduling`` and builds the matching
one, so an engine keeps async scheduling (the scheduler's CPU time hidden behind the forward
pass). ``AsyncScheduler`` also commits after each step's output (``_update_request_with_output``
-> ``KVCacheManager.cache_blocks``), through the same coordinator call, so one wrap covers it.

NOTE: the decision is made before anything is committed, so there is no residual window (the
eviction alternative through ``KVCacheManager.evict_blocks`` leaves one: an identical request
scheduled in the same step can hit the block before it is evicted).
NOTE: ``get_external_kv_cache_policy`` must be side-effect free; it is called once per commit.
NOTE: vLLM still logs its generic warning for any scheduler class outside ``vllm.`` ("If you
have subclassed Scheduler instead of AsyncScheduler, you will see degraded performance"); with
async scheduling on, the class built here is an ``AsyncScheduler``.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from semkv.types import CachePolicy


class ExternalKVCachePolicy(str, Enum):
    """The per-request commit policy the upstream RFC asks for (mirrors semkv.CachePolicy)."""

    EXACT_COMMIT = CachePolicy.EXACT_COMMIT.value
    REQUEST_ONLY = CachePolicy.REQUEST_ONLY.value


class CommitPolicyMixin:
    """Wraps the coordinator's ``cache_blocks`` once the scheduler is built (mixed in before a
    vLLM scheduler class)."""

    kv_cache_manager: Any
    connector: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        coordinator = self.kv_cache_manager.coordinator
        commit = coordinator.cache_blocks
        connector = _policy_connector(self.connector)
        ask = getattr(connector, "get_external_kv_cache_policy", None)
        if ask is None:
            return  # no connector, or one without a policy: vLLM's behaviour, unchanged

        def cache_blocks(request: Any, num_computed_tokens: int) -> None:
            if ask(request.request_id, num_computed_tokens) is ExternalKVCachePolicy.REQUEST_ONLY:
                return
            commit(request, num_computed_tokens)

        coordinator.cache_blocks = cache_blocks
        if connector is not None and hasattr(connector, "commit_policy_enforced"):
            connector.commit_policy_enforced = True


class SyncCommitPolicyScheduler(CommitPolicyMixin, Scheduler):
    """The policy over vLLM's synchronous ``Scheduler`` (async scheduling off)."""


class CommitPolicyScheduler(CommitPolicyMixin, AsyncScheduler):
    """The policy over the scheduler vLLM would choose: this class (an ``AsyncScheduler``) when
    async scheduling is on, ``SyncCommitPolicyScheduler`` when it is off."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is CommitPolicyScheduler and not _async_scheduling(args, kwargs):
            # not an instance of cls, so Python does not call __init__ a second time
            return SyncCommitPolicyScheduler(*args, **kwargs)
        return super().__new__(cls)


def _async_scheduling(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``scheduler_config.async_scheduling`` of the ``vllm_config`` vLLM passes (by keyword in
    the engine core, first positionally in the base class's signature)."""
    config = kwargs.get("vllm_config", args[0] if args else None)
    return bool(getattr(getattr(config, "scheduler_config", None), "async_scheduling", False))


def _policy_connector(connector: Any) -> Any:
    """The connector that answers the policy: itself, or a child of vLLM's MultiConnector."""
    if connector is None or hasattr(connector, "get_external_kv_cache_policy"):
        return connector
    children = [c for c in getattr(connector, "sub_connectors", ())
                if hasattr(c, "get_external_kv_cache_policy")]
    if len(children) > 1:
        raise ValueError("more than one child connector declares a cache-commit policy")
    return children[0] if children else None
