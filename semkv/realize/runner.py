"""``LayerRunner``: what the assembly and recompute strategies need from a model.

Protocol (hidden states are ``[1, tokens, hidden_size]``, the residual stream; positions are a
1-D long tensor, strictly increasing):

- ``num_layers``, ``kv_heads``, ``head_dim``, ``dtype``, ``device``: the cache geometry;
- ``rotator.rotate(keys [..., T, head_dim], deltas [T], layer)``: move one layer's post-RoPE
  keys by per-token position deltas (that layer's own rotary angles: families differ per layer,
  Gemma 3's window layers have another base; a layer without RoPE returns its keys);
- ``empty_cache(capacity)``: a zero ``KVCache`` for this model;
- ``embed(token_ids)``: the embeddings ``[1, T, hidden]``;
- ``run_layers(cache, hidden, positions, layers=None)``: run ``layers`` (all by default) for
  the tokens at ``positions`` only. Each layer first writes those tokens' fresh K/V into
  ``cache``, then lets them attend causally (key position <= query position) over every cached
  position up to the last query; positions not computed keep what the cache holds (reused,
  re-rotated donor KV). Returns the new hidden states of those tokens. With ``attention``
  (a float32 tensor of ``cache.capacity``), each layer also adds to it, per key position, the
  softmax weights its queries give that key, summed over heads and queries (the query-aware
  selection's score, ``semkv.realize.query``);
- ``logits(hidden)``: next-token logits ``[T, vocab]`` (fp32) from last-layer hidden states;
- ``forward(cache, token_ids, positions)``: embed, all layers, logits;
- ``full_prefill(token_ids, capacity=None, *, all_logits=True)``: every position computed, the
  reference; returns ``(cache, logits)``, logits ``[N, vocab]`` or ``[1, vocab]``.

With every position computed, ``run_layers`` is a plain prefill; decoding is the same call for
one new position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from semkv.realize.cache import KVCache


class KeyRotator(Protocol):
    def rotate(self, keys: torch.Tensor, deltas: torch.Tensor, layer: int) -> torch.Tensor:
        """``keys`` [..., T, head_dim] (post-RoPE) of ``layer`` moved by ``deltas`` [T]."""
        ...


def check_positions(positions: torch.Tensor, capacity: int) -> int:
    """``run_layers``' contract on ``positions`` (non-empty): strictly increasing, inside the
    cache. Returns the context length (last position + 1) the queries attend over."""
    if positions.numel() > 1 and bool((positions[1:] <= positions[:-1]).any()):
        raise ValueError("positions must increase strictly")
    context = int(positions[-1]) + 1
    if context > capacity:
        raise ValueError("positions reach past the cache capacity")
    return context


@runtime_checkable
class LayerRunner(Protocol):
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def rotator(self) -> KeyRotator: ...

    def empty_cache(self, capacity: int) -> KVCache: ...

    def embed(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor: ...

    def run_layers(self, cache: KVCache, hidden: torch.Tensor, positions: torch.Tensor,
                   layers: range | None = None, *,
                   attention: torch.Tensor | None = None) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def forward(self, cache: KVCache, token_ids: Sequence[int] | torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor: ...

    def full_prefill(self, token_ids: Sequence[int], capacity: int | None = None, *,
                     all_logits: bool = True) -> tuple[KVCache, torch.Tensor]: ...
