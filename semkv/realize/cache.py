"""The explicit KV cache a layer runner reads and writes.

Protocol: per layer one key and one value tensor ``[1, kv_heads, capacity, head_dim]``, keys
after RoPE (at the position they sit at), token-major, in the runner's dtype and on its device.
Position p of the prompt lives at index p; positions nobody wrote hold zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    """Per layer keys and values ``[1, kv_heads, capacity, head_dim]`` (keys post-RoPE)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def zeros(cls, num_layers: int, kv_heads: int, head_dim: int, capacity: int,
              dtype: torch.dtype, device: torch.device | str) -> KVCache:
        shape = (1, kv_heads, capacity, head_dim)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(keys, [torch.zeros_like(k) for k in keys])

    @property
    def capacity(self) -> int:
        return int(self.keys[0].shape[2])

    def clone(self) -> KVCache:
        return KVCache([k.clone() for k in self.keys], [v.clone() for v in self.values])
