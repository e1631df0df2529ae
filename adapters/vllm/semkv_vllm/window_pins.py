"""Scheduler side: the local prefix-cache blocks a realization reads in sliding-window groups,
held from its decision to the worker's report.

A realized span's first tokens attend to the local prefix's last window. vLLM's
``allocate_slots`` counts the span as computed, and a window group keeps only the blocks inside
the window of the request's computed tokens: local-hit blocks further back are neither touched
nor kept (vLLM's null block in the request's table, ``add_local_computed_blocks``). They stay
in the prefix cache, but on the free queue: any allocation may take them before the worker
reads them. ``WindowPins``:

- ``pin(request, local, kv_cache_manager)`` when a realization is decided
  (``get_num_new_matched_tokens``): vLLM's own lookup of the local hit
  (``find_longest_cache_hit``, which counts nothing), every real block of it in a window group
  touched (``block_pool.touch``: off the free queue);
- ``local_ids(request_id)``: each window group's local blocks, for the op (``NO_BLOCK`` where
  the group held none: out of every span token's window);
- ``release(request_id)`` (``block_pool.free_blocks``) once the worker reported the
  realization (``finished_recving``: written, failed or cancelled), or its decision was
  dropped before an op was sent.

NOTE: full-attention groups need none: vLLM touches their whole local hit itself.
NOTE: a pinned block keeps its hash: it is still vLLM's prefix-cache state, only unevictable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from semkv_vllm.metadata import NO_BLOCK


@dataclass(frozen=True)
class _Held:
    pool: Any  # the block pool the blocks were touched in (freed there)
    blocks: list[Any]  # the touched blocks (vLLM's KVCacheBlock)
    ids: dict[int, list[int]]  # window group -> its local-prefix block ids (NO_BLOCK: none)


class WindowPins:
    def __init__(self, windows: Sequence[int | None], block_size: int) -> None:
        self.groups = [g for g, window in enumerate(windows) if window]
        self.block_size = block_size
        self._held: dict[str, _Held] = {}

    def pin(self, request: Any, local: int, kv_cache_manager: Any) -> bool:
        """Hold ``request``'s local hit in every window group of ``kv_cache_manager`` (vLLM's,
        None before it is bound); False when its cache no longer gives that hit (nothing
        held)."""
        self.release(request.request_id)
        if not self.groups or local == 0:
            return True
        if kv_cache_manager is None:
            return False
        hit, found, _ = kv_cache_manager.coordinator.find_longest_cache_hit(
            request.block_hashes, local)
        if found != local:
            return False
        count = local // self.block_size
        blocks = {g: list(hit[g][:count]) for g in self.groups}
        if any(len(b) != count for b in blocks.values()):
            return False
        real = [b for group in blocks.values() for b in group if not b.is_null]
        kv_cache_manager.block_pool.touch(real)
        self._held[request.request_id] = _Held(kv_cache_manager.block_pool, real, {
            g: [NO_BLOCK if b.is_null else b.block_id for b in group]
            for g, group in blocks.items()})
        return True

    def local_ids(self, request_id: str) -> dict[int, list[int]]:
        """Each window group's local-prefix block ids as pinned (empty: nothing pinned)."""
        held = self._held.get(request_id)
        return dict(held.ids) if held is not None else {}

    def release(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None and held.blocks:
            held.pool.free_blocks(held.blocks)

    def __len__(self) -> int:
        """Requests holding pins."""
        return len(self._held)
