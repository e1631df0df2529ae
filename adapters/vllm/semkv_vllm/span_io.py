"""A realization's reads and writes of engine pages (``realization.SpanRealizer``).

- ``SpanReads``: per op, where every layer's local-prefix K/V (the request's own blocks) and
  copied K/V (pinned donor-store slots) live; ``layer(kv, store)`` returns one layer's, token
  ordered as the op places them.
- ``write_span``: the realized span's K/V into the request's blocks, layer by layer.

Reads build their element offsets once per op (``PageLayout.token_index``: every layer's tensor
has the same shape and the same slots or blocks), then gather each layer's tokens in one pass;
tensors that are not one contiguous block-major array (a GPU backend's permuted view) take the
page path (whole pages gathered, then read through the layout). Writes assemble whole pages by
one gather and copy them in (``PageLayout.write``).

NOTE: issue #25's profile put a fifth of a realized request's time in these reads (with the
re-rotation) and writes; the page path copied every page out, picked the tokens, and copied
written pages back in (single-threaded, 30 layers of an 1,856-token span with 1,280 tokens read
from the store: reads 165 -> 67 ms, writes 170 -> ~125 ms; ``tests/test_span_io.py`` pins
both against the page path).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from semkv.realize import KVCache
from semkv_vllm.page_layout import PageLayout, flat


def _page_numel(t: torch.Tensor) -> int:
    return int(t[0].numel())


class SpanReads:
    """One op's local-prefix rows and copied donor rows, gathered per layer."""

    def __init__(self, layout: PageLayout, kv: torch.Tensor, store: torch.Tensor | None,
                 local_blocks: torch.Tensor, slots: torch.Tensor, picked: torch.Tensor,
                 local_tokens: int, device: torch.device, heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        self.layout, self.device = layout, device
        self.local_blocks, self.slots, self.picked = local_blocks, slots, picked
        self.empty = torch.zeros(0, heads, head_dim, dtype=dtype, device=device)
        self.shape = (heads, head_dim)
        self.local_index = self.copy_index = None
        if local_blocks.numel() and flat(kv) is not None:
            rows = torch.arange(local_tokens)
            self.local_index = layout.token_index(local_blocks, rows, _page_numel(kv))
        if store is not None and slots.numel() and flat(store) is not None:
            self.copy_index = layout.token_index(slots, picked, _page_numel(store))

    def _gather(self, t: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor],
                ) -> tuple[torch.Tensor, torch.Tensor]:
        view = flat(t)
        assert view is not None
        k_at, v_at = (i.to(t.device) for i in index)
        return (view.index_select(0, k_at).view(-1, *self.shape).to(self.device),
                view.index_select(0, v_at).view(-1, *self.shape).to(self.device))

    def layer(self, kv: torch.Tensor, store: torch.Tensor | None,
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's local-prefix then copied K/V, ``[kv_heads, T, head_dim]`` each."""
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        if self.local_blocks.numel():
            if self.local_index is not None:
                parts.append(self._gather(kv, self.local_index))
            else:
                k, v = self.layout.read(kv.index_select(0, self.local_blocks.to(kv.device)))
                parts.append((k.to(self.device), v.to(self.device)))
        if self.slots.numel():
            assert store is not None
            if self.copy_index is not None:
                parts.append(self._gather(store, self.copy_index))
            else:
                k, v = self.layout.read(store.index_select(0, self.slots).to(self.device))
                at = self.picked.to(self.device)
                parts.append((k[at], v[at]))
        if not parts:  # nothing copied, no local prefix: every span token is a gap
            return self.empty.transpose(0, 1), self.empty.transpose(0, 1)
        k = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        v = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        return k.transpose(0, 1), v.transpose(0, 1)


def write_span(layout: PageLayout, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
               cache: KVCache, lo: int, hi: int) -> None:
    """``cache``'s positions ``[lo, hi)`` (whole blocks) into ``block_ids`` of every layer's
    paged tensor (``kv_caches[i]``: decoder layer i's), whole pages assembled by
    ``PageLayout.write``."""
    for layer, kv in enumerate(kv_caches):
        keys = cache.keys[layer][0, :, lo:hi].transpose(0, 1).to(kv.device)
        values = cache.values[layer][0, :, lo:hi].transpose(0, 1).to(kv.device)
        layout.write(kv, block_ids, keys, values)
