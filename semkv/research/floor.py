"""The next-token comparison the research benchmarks make against cold, and its fp8 floor.

- ``logits_kl(cold, other)``: full-vocabulary KL(cold || other) in nats, of two logit vectors;
- ``fp8_floor_logits(lm, target)``: the last prompt token's logits computed over the cold KV of
  every other token rounded through fp8 (``semkv.realize.fp8.round_fp8``, one scale per layer
  and K / V, as the engine's ``kv_floor``): the quality a reuse path must reach.

Used by ``benchmarks/recompute_curves.py`` and ``benchmarks/window_deviation.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def logits_kl(cold: torch.Tensor, other: torch.Tensor) -> float:
    p = torch.log_softmax(cold.double(), -1)
    q = torch.log_softmax(other.double(), -1)
    return float((p.exp() * (p - q)).sum())


def fp8_floor_logits(lm: Any, target: Sequence[int]) -> torch.Tensor:
    """The last token's logits over the cold KV of the others rounded through fp8."""
    from semkv.realize.fp8 import round_fp8
    from semkv.realize.recompute import RecomputeStrategy, recompute

    n = len(target)
    cache, _ = lm.full_prefill(list(target), all_logits=False)
    for part in (cache.keys, cache.values):
        for i, t in enumerate(part):
            part[i] = round_fp8(t)
    done = recompute(lm, cache, range(n), [(0, n - 1)], dict(enumerate(target)),
                     RecomputeStrategy(), n)
    assert done.hidden is not None
    return lm.logits(done.hidden[:, -1:])[-1]
