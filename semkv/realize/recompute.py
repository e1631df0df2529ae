"""Selective recompute: which copied positions are computed fresh on top of reused KV, and how.

One realization semantics, two runners: ``semkv.research.recompute.prefill`` (the whole prompt,
research's transformers runner) and the engine's worker (``semkv_vllm.realization``, one
external span, the engine's own modules) both call ``recompute`` with any ``LayerRunner``.

Protocol: ``recompute(runner, cache, positions, copied, token_ids, strategy, prompt_tokens)``

- ``cache`` already holds every position before ``positions`` (the engine's exact local
  prefix; nothing in research, whose range starts at 0) and, at the ``copied`` runs
  ``(target_start, length)`` inside ``positions``, the reused KV (keys re-rotated);
- every position of ``positions`` (a contiguous range) that no run copies is a gap: computed
  through every layer, whatever the strategy;
- ``strategy`` adds copied positions:
  - ``none``: none; every copied token keeps its reused KV in every layer;
  - ``first_k``: the first ``first_k`` positions of every copied run (EPIC-like: a chunk's first
    tokens absorb most of the attention its missing preceding context would have drawn);
  - ``blend`` (CacheBlend-like): the first ``probe_layers`` layers are computed for EVERY
    position of the range (fresh KV there for all); copied positions are ranked by the
    deviation of the reused K/V from those fresh ones (per probe layer the squared difference
    of K and V over the squared norm of the fresh K and V, summed over the probe layers;
    ties: the earlier position); the top ``budget`` continue through the remaining layers
    from their probe-layer hidden states, together with the gaps.
  - ``first_k_blend``: ``blend`` whose selection always holds the first ``first_k`` positions
    of every copied run (the tokens right after a gap or a change of donor: a halo), the
    ``budget`` then filled from the rest by deviation.
  - ``query`` / ``first_k_query`` (ProphetKV-like, ``semkv.realize.query``): the prompt's
    tail after the last copied token (the question) runs over the assembled KV; the copied
    positions its last ``query_tokens`` queries attend to most (summed over layers and heads)
    are recomputed from layer 0 (``first_k_query``: holding the first ``first_k`` of every
    run, as ``first_k_blend``). The tail's token ids are needed too: ``needed_positions``
    and the cache's capacity (``cache_tokens``) take the prompt's length.
- ``fraction`` (blend, query) is a fraction of the PROMPT's tokens, the whole sequence being
  prefilled (local prefix, span and tail), as in the calibration of issue #17:
  ``budget = min(copied tokens, round(fraction * prompt_tokens))``. Positions computed anyway
  (gaps, research's non-reused positions, the tail, the last prompt token) are not charged to
  it; fraction 1.0 recomputes every copied token.
- ``token_ids`` maps position -> token id for at least ``needed_positions(...)``.

Returns ``Recomputed``: the final pass's hidden states, the passes ``(layers, positions)`` (the
input of research's FLOPs estimate) and the copied positions computed through every layer.

NOTE: ``recompute_steps`` is the same computation one layer per step: the engine's worker
advances it between engine steps on its own main thread (``semkv_vllm.realization``).
NOTE: ``max_tokens`` runs each layer over its positions in chunks of at most that many, in
increasing position order: exactly the unchunked computation (a token attends only to positions
at or before its own, which earlier chunks of the same layer have already written), with a
tokens x context mask and activations bounded by the chunk. The engine passes vLLM's
``max_num_batched_tokens``; research keeps None (a layer at once).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping

import torch

from semkv.realize.cache import KVCache
from semkv.realize.query import query_select
from semkv.realize.runner import LayerRunner
from semkv.realize.selection import (
    DEFAULT_FIRST_K,
    DEFAULT_FRACTION,
    DEFAULT_PROBE_LAYERS,
    DEFAULT_QUERY_TOKENS,
    Passes,
    Recomputed,
    RecomputeKind,
    RecomputeStrategy,
    Runs,
    budget,
    cache_tokens,
    copied_positions,
    covers,
    deviation,
    first_k_positions,
    layer_calls,
    needed_positions,
    rank,
    tail_positions,
    uncovered_positions,
)

# The selection vocabulary lives in ``semkv.realize.selection`` (``semkv.realize.query`` imports
# it too, without a cycle); this module re-exports it as the strategies' public home.
__all__ = [
    "DEFAULT_FIRST_K",
    "DEFAULT_FRACTION",
    "DEFAULT_PROBE_LAYERS",
    "DEFAULT_QUERY_TOKENS",
    "Passes",
    "RecomputeKind",
    "RecomputeStrategy",
    "Recomputed",
    "Runs",
    "budget",
    "covers",
    "cache_tokens",
    "copied_positions",
    "deviation",
    "first_k_positions",
    "layer_calls",
    "needed_positions",
    "rank",
    "recompute",
    "recompute_steps",
    "tail_positions",
    "uncovered_positions",
]


def recompute(runner: LayerRunner, cache: KVCache, positions: range, copied: Runs,
              token_ids: Mapping[int, int], strategy: RecomputeStrategy, prompt_tokens: int,
              *, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
              max_tokens: int | None = None) -> Recomputed:
    """Compute the gaps of ``positions`` and the copied positions ``strategy`` selects."""
    steps = recompute_steps(runner, cache, positions, copied, token_ids, strategy,
                            prompt_tokens, reduce=reduce, max_tokens=max_tokens)
    while True:
        try:
            next(steps)
        except StopIteration as finished:
            result: Recomputed = finished.value
            return result


def recompute_steps(runner: LayerRunner, cache: KVCache, positions: range, copied: Runs,
                    token_ids: Mapping[int, int], strategy: RecomputeStrategy,
                    prompt_tokens: int, *,
                    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    max_tokens: int | None = None,
                    ) -> Generator[int, None, Recomputed]:
    """``recompute`` one layer call at a time (one layer over at most ``max_tokens``
    positions): yields the tokens each call computed; returns the result. The engine's worker
    advances it between steps on its main thread (no thread runs beside vLLM's forward);
    running it to the end is exactly ``recompute``."""
    if max_tokens is not None and max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    copied_set = set(copied_positions(copied))
    if not copied_set <= set(positions):
        raise ValueError("a copied run lies outside the realized positions")
    gaps = [p for p in positions if p not in copied_set]
    if strategy.kind.queries and len(positions):
        return (yield from query_select(runner, cache, positions, copied, token_ids, strategy,
                                        prompt_tokens, reduce, max_tokens))
    if strategy.kind.probes and len(positions):
        return (yield from _blend(runner, cache, positions, copied, sorted(copied_set), gaps,
                                  token_ids, strategy, prompt_tokens, reduce, max_tokens))
    chosen = set(gaps)
    if strategy.kind.forces_first_k:
        chosen |= set(first_k_positions(copied, strategy.first_k))
    at = sorted(chosen)
    layers = range(runner.num_layers)
    if not at:
        return Recomputed(None, [(layers, [])], [])
    hidden = yield from layer_calls(runner, cache, runner.embed([token_ids[p] for p in at]),
                                    torch.tensor(at, dtype=torch.long), layers, max_tokens)
    return Recomputed(hidden, [(layers, at)], [p for p in at if p in copied_set])


def _blend(runner: LayerRunner, cache: KVCache, positions: range, runs: Runs,
           copied: list[int], gaps: list[int], token_ids: Mapping[int, int],
           strategy: RecomputeStrategy, prompt_tokens: int,
           reduce: Callable[[torch.Tensor], torch.Tensor] | None, max_tokens: int | None,
           ) -> Generator[int, None, Recomputed]:
    lo, hi = positions.start, positions.stop
    probe = min(strategy.probe_layers, runner.num_layers)
    old_k = [cache.keys[layer][0, :, lo:hi].clone() for layer in range(probe)]
    old_v = [cache.values[layer][0, :, lo:hi].clone() for layer in range(probe)]
    everyone = list(positions)
    hidden = yield from layer_calls(runner, cache,
                                    runner.embed([token_ids[p] for p in everyone]),
                                    torch.arange(lo, hi), range(probe), max_tokens)
    passes: Passes = [(range(probe), everyone)]
    if probe == runner.num_layers:  # the probe already computed every layer for everyone
        return Recomputed(hidden, passes, copied)
    score = deviation(cache, old_k, old_v, lo, hi, reduce)
    del old_k, old_v
    forced = sorted(set(first_k_positions(runs, strategy.first_k))) if (
        strategy.kind.forces_first_k) else []
    held = set(forced)
    free = [p for p in copied if p not in held]
    take = max(0, budget(strategy, prompt_tokens, len(copied)) - len(forced))
    top = sorted(set(forced) | set(rank(score, lo, free, take)))
    chosen = sorted(set(gaps) | set(top))
    rest = range(probe, runner.num_layers)
    passes.append((rest, chosen))
    if not chosen:
        return Recomputed(None, passes, [])
    index = torch.tensor(chosen, dtype=torch.long)
    steps = layer_calls(runner, cache, hidden[:, index - lo], index, rest, max_tokens)
    del hidden  # every position's probe hidden states: only the chosen ones continue
    out = yield from steps
    return Recomputed(out, passes, top)
