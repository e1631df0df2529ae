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

Select it with ``--scheduler-cls semkv_vllm.commit_policy.CommitPolicyScheduler``.

NOTE: the decision is made before anything is committed, so there is no residual window (the
eviction alternative through ``KVCacheManager.evict_blocks`` leaves one: an identical request
scheduled in the same step can hit the block before it is evicted).
NOTE: ``get_external_kv_cache_policy`` must be side-effect free; it is called once per commit.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from semkv.types import CachePolicy


class ExternalKVCachePolicy(str, Enum):
    """The per-request commit policy the upstream RFC asks for (mirrors semkv.CachePolicy)."""

    EXACT_COMMIT = CachePolicy.EXACT_COMMIT.value
    REQUEST_ONLY = CachePolicy.REQUEST_ONLY.value


class CommitPolicyScheduler(Scheduler):
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


def _policy_connector(connector: Any) -> Any:
    """The connector that answers the policy: itself, or a child of vLLM's MultiConnector."""
    if connector is None or hasattr(connector, "get_external_kv_cache_policy"):
        return connector
    children = [c for c in getattr(connector, "sub_connectors", ())
                if hasattr(c, "get_external_kv_cache_policy")]
    if len(children) > 1:
        raise ValueError("more than one child connector declares a cache-commit policy")
    return children[0] if children else None
