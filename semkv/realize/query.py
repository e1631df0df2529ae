"""Query-aware selection: the copied tokens the prompt's question reads, recomputed from layer 0.

The ``query``, ``first_k_query`` and ``query_valued`` strategies of ``semkv.realize.recompute``
(ProphetKV-like, training-free, the engine's own weights). Both runners call it through
``recompute_steps``: research realizes the whole prompt, the engine's worker one external span
with the prompt's tail after it supplied too (``needed_positions``, ``cache_tokens``).

Two stages over the assembled cache (copied runs placed, keys re-rotated):

1. Probe. The positions of ``positions`` that no run copies and that lie before the prompt's
   tail (``tail_positions``: everything after the last copied token, the question in RAG)
   are computed through every layer; then the tail is, over the assembled KV. The attention
   its last ``query_tokens`` queries give each cached position (softmax weights summed over
   heads, queries and layers; over tensor-parallel ranks with ``reduce``) scores the copied
   positions: what the answer reads, rather than what deviates most (CacheBlend's proxy,
   which spends the budget on salient tokens the question never reads: ProphetKV's
   "crowding-out"). ``query_valued`` first computes the first ``probe_layers`` layers for every
   position of ``positions`` (CacheBlend's probe: their fresh KV stays) and multiplies a copied
   position's score by its value error there (the norm of fresh minus reused values in the
   last probe layer, summed over heads and ranks): to first order, what a reused token puts
   wrong into what the question reads is the attention it gets times its value error.
2. Recompute. The top ``budget`` copied positions (``first_k_query``: always holding the
   first ``first_k`` of every run, the halo after a seam, which count against it; ties: the
   earlier position) are computed from layer 0 through every layer, together with every
   non-copied position of ``positions`` after the first of them (their stage-1 KV read the
   reused KV of a position now recomputed). Non-copied positions before the first selected
   one keep their stage-1 KV: they attend only to earlier positions, which did not change,
   so it is exactly what stage 2 would compute.

With fraction 1.0 every copied position and everything after the first copy is recomputed
over exact KV: the cold prefill (``tests/test_realize_query.py``).

NOTE: the probe writes the tail's KV into ``cache`` at the tail's positions. The engine's
worker writes back only ``positions`` (its span), so the probe leaves nothing in the request's
blocks: vLLM computes the tail itself after the span. A realization that fails midway writes
nothing at all (the request is recomputed cold).
NOTE: a plan that copies nothing has no tail to probe with and nothing to select: the
non-copied positions are computed through every layer, as ``none`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping

import torch

from semkv.realize.cache import KVCache
from semkv.realize.runner import LayerRunner
from semkv.realize.selection import (
    Passes,
    Recomputed,
    RecomputeStrategy,
    Runs,
    budget,
    copied_positions,
    first_k_positions,
    layer_calls,
    rank,
    tail_positions,
)


def _run(runner: LayerRunner, cache: KVCache, token_ids: Mapping[int, int], at: list[int],
         layers: range, max_tokens: int | None, attention: torch.Tensor | None = None,
         ) -> Generator[int, None, torch.Tensor | None]:
    if not at:
        return None
    index = torch.tensor(at, dtype=torch.long)
    hidden = yield from layer_calls(runner, cache, runner.embed([token_ids[p] for p in at]),
                                    index, layers, max_tokens, attention)
    return hidden


def value_error(runner: LayerRunner, cache: KVCache, positions: range, copied: list[int],
                token_ids: Mapping[int, int], probe_layers: int,
                reduce: Callable[[torch.Tensor], torch.Tensor] | None, max_tokens: int | None,
                ) -> Generator[int, None, torch.Tensor]:
    """``query_valued``'s weight per cache position (CPU, fp32): a copied position's value
    error in the last of the first ``probe_layers`` layers; 0 elsewhere. Those layers are
    computed for every position of ``positions`` in place, as blend's probe: their fresh KV
    stays (exact there)."""
    probe = min(probe_layers, runner.num_layers)
    lo, hi = positions.start, positions.stop
    reused = cache.values[probe - 1][0, :, lo:hi].clone()
    yield from _run(runner, cache, token_ids, list(positions), range(probe), max_tokens)
    error = (cache.values[probe - 1][0, :, lo:hi] - reused).float().norm(dim=2).sum(dim=0)
    del reused
    if reduce is not None:
        error = reduce(error)
    weight = torch.zeros(cache.capacity, dtype=torch.float32)
    at = torch.tensor(copied, dtype=torch.long)
    weight[at] = error.cpu()[at - lo]
    return weight


def query_select(runner: LayerRunner, cache: KVCache, positions: range, runs: Runs,
                 token_ids: Mapping[int, int], strategy: RecomputeStrategy, prompt_tokens: int,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None, max_tokens: int | None,
                 ) -> Generator[int, None, Recomputed]:
    """The two stages of the module docstring, one layer call per yield."""
    layers = range(runner.num_layers)
    copied = copied_positions(runs)
    copied_set = set(copied)
    if not copied:
        gaps = list(positions)
        hidden = yield from _run(runner, cache, token_ids, gaps, layers, max_tokens)
        return Recomputed(hidden, [(layers, gaps)], [])
    passes: Passes = []
    weight = None
    if strategy.kind.weighs:
        weight = yield from value_error(runner, cache, positions, copied, token_ids,
                                        strategy.probe_layers, reduce, max_tokens)
        passes.append((range(min(strategy.probe_layers, runner.num_layers)), list(positions)))
    tail = tail_positions(runs, prompt_tokens)
    before = [p for p in positions if p not in copied_set and p < tail.start]
    yield from _run(runner, cache, token_ids, before, layers, max_tokens)
    if before:
        passes.append((layers, before))
    scored = min(strategy.query_tokens, len(tail))
    lead, queries = list(tail[:len(tail) - scored]), list(tail[len(tail) - scored:])
    attention = torch.zeros(cache.capacity, dtype=torch.float32, device=runner.device)
    yield from _run(runner, cache, token_ids, lead, layers, max_tokens)
    hidden = yield from _run(runner, cache, token_ids, queries, layers, max_tokens, attention)
    if len(tail):
        passes.append((layers, list(tail)))
    if reduce is not None:
        attention = reduce(attention)
    score = attention.cpu()
    if weight is not None:
        score = score * weight
    forced = sorted(set(first_k_positions(runs, strategy.first_k))) if (
        strategy.kind.forces_first_k) else []
    held = set(forced)
    free = [p for p in copied if p not in held]
    take = max(0, budget(strategy, prompt_tokens, len(copied)) - len(forced))
    top = sorted(held | set(rank(score, 0, free, take)))
    if not top:
        return Recomputed(hidden, passes, [])
    first = top[0]
    chosen = sorted(set(top) | {p for p in positions if p not in copied_set and p > first})
    out = yield from _run(runner, cache, token_ids, chosen, layers, max_tokens)
    passes.append((layers, chosen))
    return Recomputed(out, passes, top)
