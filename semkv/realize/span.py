"""Realizing one external span from a ``SpanPlan``: the semantics both runners share.

Protocol (``semkv.span_plan`` decides the plan; any ``LayerRunner`` executes it):

1. ``place(cache, rotator, positions, keys, values, deltas)`` writes copied donor KV into the
   cache at its target positions, keys re-rotated by ``deltas`` (target minus donor position,
   per token) with the model's own rotary angles.
2. Positions the plan does not copy are computed: ``compute(runner, cache, token_ids,
   positions)`` runs every layer for them at once, so each attends causally over everything
   realized at or before its position (copied KV, the exact local prefix, and the other
   computed positions' fresh KV).

The engine's worker (``semkv_vllm.realization``) fills the local prefix from the request's own
blocks, places the copies from its donor store and computes the span's gaps; vLLM computes the
tail after the span. ``realize_reference`` does the same for a research runner in one pass:
copies placed from donor caches, everything else (local prefix, gaps, tail) computed, logits of
the last prompt token returned. With the same plan both give the same next-token distribution
(``tests/test_engine_realization.py``).

NOTE: positions and counts only cross in and out; token ids stay with the caller.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from semkv.realize.cache import KVCache
from semkv.realize.runner import KeyRotator, LayerRunner
from semkv.span_plan import SpanPlan


def place(cache: KVCache, rotator: KeyRotator | None, positions: torch.Tensor,
          keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
          deltas: torch.Tensor) -> None:
    """Write per-layer donor ``keys``/``values`` ``[kv_heads, T, head_dim]`` at ``positions`` [T].

    ``deltas`` [T] = target position - donor position per token; any non-zero needs a rotator.
    """
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        place_layer(cache, layer, rotator, positions, k, v, deltas)


def place_layer(cache: KVCache, layer: int, rotator: KeyRotator | None,
                positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                deltas: torch.Tensor) -> None:
    """``place`` for one layer (the engine's worker reads and places donor KV layer by layer,
    so that only one layer's donor K/V is in memory beside the cache)."""
    if positions.numel() and int(positions.max()) >= cache.capacity:
        raise ValueError("a copied position lies past the cache capacity")
    shifted = bool(deltas.any())
    if shifted and rotator is None:
        raise ValueError("a shifted copy needs the model's key rotator")
    at = positions.to(cache.keys[layer].device)
    if shifted:
        keys = rotator.rotate(keys, deltas, layer)  # type: ignore[union-attr]
    cache.keys[layer][0, :, at] = keys.to(cache.keys[layer].dtype)
    cache.values[layer][0, :, at] = values.to(cache.values[layer].dtype)


def compute(runner: LayerRunner, cache: KVCache, token_ids: Sequence[int],
            positions: Sequence[int]) -> torch.Tensor | None:
    """Run every layer for ``token_ids`` at ``positions``; returns their last hidden states."""
    if not positions:
        return None
    at = torch.as_tensor(list(positions), dtype=torch.long, device=runner.device)
    with torch.no_grad():
        return runner.run_layers(cache, runner.embed(list(token_ids)), at)


def realize_reference(runner: LayerRunner, target_ids: Sequence[int], plan: SpanPlan,
                      donors: Mapping[str, KVCache]) -> tuple[KVCache, torch.Tensor]:
    """The whole prompt realized under ``plan`` by one runner: (cache, last-token logits).

    ``donors`` maps donor id -> that donor's cache (at its own positions). Every position the
    plan does not copy is computed: the local prefix, the gaps and the tail after the span.
    """
    n = len(target_ids)
    cache = runner.empty_cache(n)
    copied: set[int] = set()
    for seg in plan.segments:
        if seg.donor_id is None:
            continue
        src = donors[seg.donor_id]
        lo, hi = seg.donor_start, seg.donor_start + seg.length
        place(cache, runner.rotator, torch.arange(seg.target_start, seg.end),
              [k[0, :, lo:hi] for k in src.keys], [v[0, :, lo:hi] for v in src.values],
              torch.full((seg.length,), seg.target_start - seg.donor_start))
        copied.update(range(seg.target_start, seg.end))
    rest = [p for p in range(n) if p not in copied]
    hidden = compute(runner, cache, [target_ids[p] for p in rest], rest)
    assert hidden is not None and rest[-1] == n - 1  # the last prompt token is never copied
    return cache, runner.logits(hidden[:, -1:])[0]
