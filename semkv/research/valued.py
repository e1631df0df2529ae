"""``queryv`` (measurement only, research only): query-aware selection with each copied token's
attention score weighted by how far its reused values sit from fresh ones.

Issue #25 names the variant (tokens scored by the suffix's attention, optionally weighted by
value deviation). What a reused token puts wrong into what the question reads is, to first
order, the attention the question gives it times its value error: a token read often but
reused almost exactly needs no recompute; one read less but far off may. Protocol, on the
assembled cache of a research prefill:

1. Value probe (CacheBlend's layer probe, on a copy of the probed layers): the first
   ``probe_layers`` layers are computed for every prompt position; a copied position's weight
   is the norm of its fresh minus reused values in the last probe layer (summed over heads).
   Layer 0 cannot tell (its KV is context-free), hence the default of two layers.
2. ``query`` (``semkv.realize.query``, the engine's own selection) over the assembled cache,
   its attention score multiplied by that weight before ranking.

At ratio 1.0 every copied token is recomputed: the cold prefill. The probe's token-layers count
in ``PrefillResult.recompute_fraction``. Not a served strategy: it is measured against ``query``
in ``benchmarks/recompute_curves.py`` (docs/frontier.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from semkv.realize import KVCache, LayerRunner
from semkv.realize.query import query_select
from semkv.realize.recompute import (
    DEFAULT_PROBE_LAYERS,
    Recomputed,
    RecomputeKind,
    RecomputeStrategy,
    Runs,
    copied_positions,
)


def value_weights(lm: LayerRunner, cache: KVCache, target: Sequence[int], runs: Runs,
                  probe_layers: int = DEFAULT_PROBE_LAYERS) -> torch.Tensor:
    """Step 1: per cache position (CPU, fp32), the last probe layer's value error of a copied
    position; 0 elsewhere. ``cache`` is left as it was."""
    n = len(target)
    probe = min(probe_layers, lm.num_layers)
    scratch = KVCache([k.clone() for k in cache.keys[:probe]],
                      [v.clone() for v in cache.values[:probe]])
    reused = scratch.values[probe - 1][0, :, :n].clone()
    lm.run_layers(scratch, lm.embed(list(target)), torch.arange(n), range(probe))
    error = (scratch.values[probe - 1][0, :, :n] - reused).float().norm(dim=2).sum(dim=0)
    weight = torch.zeros(cache.capacity, dtype=torch.float32)
    copied = torch.tensor(copied_positions(runs), dtype=torch.long)
    weight[copied] = error.cpu()[copied]
    return weight


def valued_query(lm: LayerRunner, target: Sequence[int], runs: Runs, cache: KVCache,
                 ratio: float, query_tokens: int, probe_layers: int = DEFAULT_PROBE_LAYERS,
                 ) -> Recomputed:
    """The two steps over ``cache`` (the assembled prompt); the probe is the first pass."""
    n = len(target)
    weight = value_weights(lm, cache, target, runs, probe_layers)
    strategy = RecomputeStrategy(RecomputeKind.QUERY, fraction=ratio, query_tokens=query_tokens)
    steps = query_select(lm, cache, range(n), runs, dict(enumerate(target)), strategy, n,
                         None, None, weight=weight)
    while True:
        try:
            next(steps)
        except StopIteration as finished:
            done: Recomputed = finished.value
            break
    probe = range(min(probe_layers, lm.num_layers))
    return Recomputed(done.hidden, [(probe, list(range(n))), *done.passes], done.recomputed)
