"""The fp8 KV floor: a tensor rounded through fp8 e4m3 with one scale, back in its dtype.

The floor operators accept (an fp8 KV cache) as one function for both runners: the engine's
``kv_floor`` request option rounds the blocks it placed (``semkv_vllm.options``), research
rounds a cold cache's layers (``benchmarks/recompute_curves.py``).
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0


def round_fp8(t: torch.Tensor) -> torch.Tensor:
    """``t`` through fp8 e4m3 with one scale (amax / 448), back in ``t``'s dtype."""
    scale = t.abs().amax().float().clamp_min(1e-12) / FP8_E4M3_MAX
    return ((t.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(t.dtype)
