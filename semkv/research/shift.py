"""``shift`` (measurement only, research only): query-aware selection, then each copied run's
mean K/V deviation added to the copied tokens it did not recompute.

Issue #25 names the idea (systems that correct each chunk's mean K/V shift for the tokens they
do not recompute). Protocol, on the assembled cache of a research prefill:

1. ``query`` at ``ratio`` (``semkv.realize.query``, the engine's own selection) recomputes the
   copied tokens the question reads most, from layer 0.
2. Per copied run (one donor, consecutive donor positions) and per layer, the recomputed
   tokens' fresh K/V minus their reused K/V is averaged over those tokens; keys in the
   un-rotated frame (each key turned back by its own position with the model's rotary angles,
   so that deltas at different positions add up), values as they are. The run's other copied
   tokens get that mean added (keys rotated forward to their positions). A run with fewer
   than ``MIN_SAMPLES`` recomputed tokens is left as copied.
3. The prompt's tail after the last copied token (the question) is computed again over the
   corrected cache: in the engine it is vLLM's prefill after the span, so this is where a
   correction would act. The gaps computed in step 1 keep what they computed.

At ratio 1.0 nothing copied is left to correct: the cold prefill. Not a served strategy: it
is measured against ``query`` in ``benchmarks/recompute_curves.py`` (docs/frontier.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from semkv.realize import KVCache, LayerRunner
from semkv.realize.recompute import (
    RecomputeKind,
    RecomputeStrategy,
    Runs,
    copied_positions,
    recompute,
    tail_positions,
)
from semkv.realize.span import compute

MIN_SAMPLES = 2  # recomputed tokens of a run needed to estimate its mean deviation


def shift_unselected(runner: LayerRunner, cache: KVCache, runs: Runs, recomputed: set[int],
                     old_keys: Sequence[torch.Tensor], old_values: Sequence[torch.Tensor],
                     copied: Sequence[int]) -> int:
    """Step 2 of the module docstring. ``old_keys``/``old_values`` per layer
    ``[kv_heads, len(copied), head_dim]``: the reused K/V of ``copied`` (increasing) before any
    recompute. Returns how many copied tokens were moved."""
    column = {p: i for i, p in enumerate(copied)}
    moved = 0
    for start, length in runs:
        run = range(start, start + length)
        picked = [p for p in run if p in recomputed]
        left = [p for p in run if p not in recomputed]
        if len(picked) < MIN_SAMPLES or not left:
            continue
        at = torch.tensor(picked, dtype=torch.long)
        to = torch.tensor(left, dtype=torch.long)
        cols = torch.tensor([column[p] for p in picked], dtype=torch.long)
        for layer in range(runner.num_layers):
            keys, values = cache.keys[layer][0], cache.values[layer][0]
            dv = (values[:, at] - old_values[layer][:, cols]).mean(dim=1, keepdim=True)
            # the rotation is linear: turning the difference back is turning both back
            dk = runner.rotator.rotate(keys[:, at] - old_keys[layer][:, cols], -at, layer)
            dk = dk.mean(dim=1, keepdim=True).expand(-1, len(left), -1)
            values[:, to] += dv
            keys[:, to] += runner.rotator.rotate(dk.contiguous(), to, layer)
        moved += len(left)
    return moved


def shifted_query(lm: LayerRunner, target: Sequence[int], copied_runs: Runs, cache: KVCache,
                  ratio: float, query_tokens: int,
                  ) -> tuple[torch.Tensor, list[tuple[range, list[int]]]]:
    """The three steps over ``cache`` (the assembled prompt): the last prompt token's hidden
    state after the corrected tail, and the passes computed (for research's counts)."""
    n = len(target)
    copied = copied_positions(copied_runs)
    index = torch.tensor(copied, dtype=torch.long)
    layers = range(lm.num_layers)
    old_keys = [cache.keys[i][0][:, index] for i in layers]  # indexing by a tensor copies
    old_values = [cache.values[i][0][:, index] for i in layers]
    tokens = dict(enumerate(target))
    done = recompute(lm, cache, range(n), copied_runs, tokens,
                     RecomputeStrategy(RecomputeKind.QUERY, fraction=ratio,
                                       query_tokens=query_tokens), n)
    assert done.hidden is not None  # the last prompt token is never copied: always computed
    moved = shift_unselected(lm, cache, copied_runs, set(done.recomputed), old_keys,
                             old_values, copied)
    del old_keys, old_values
    if not moved:
        return done.hidden[:, -1:], done.passes
    tail = list(tail_positions(copied_runs, n))
    hidden = compute(lm, cache, [tokens[p] for p in tail], tail)
    assert hidden is not None  # the tail holds at least the last prompt token
    return hidden[:, -1:], [*done.passes, (layers, tail)]
