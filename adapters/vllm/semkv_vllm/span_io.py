"""A realization's reads and writes of engine pages (``realization.SpanRealizer``).

- ``SpanReads``: per op, where every layer's local-prefix K/V (the request's own blocks, those
  of the layer's KV-cache group) and copied K/V (pinned donor-store slots) live;
  ``layer(kv, store, group)`` returns one layer's, token ordered as the op places them.
- ``write_span``: the realized span's K/V into the request's blocks (each layer's own),
  layer by layer.

NOTE: ``NO_BLOCK`` (vLLM's null block in a window group's table) is never written; read, its
rows are zeros, never the null block's contents.

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
from dataclasses import dataclass

import torch

from semkv.realize import KVCache
from semkv_vllm.metadata import NO_BLOCK
from semkv_vllm.page_layout import PageLayout, flat


def _page_numel(t: torch.Tensor) -> int:
    return int(t[0].numel())


@dataclass(frozen=True)
class _Local:
    """One KV-cache group's local-prefix blocks: where their rows are, which rows are holes."""

    blocks: torch.Tensor  # NO_BLOCK replaced by a readable block (its rows are holes)
    index: tuple[torch.Tensor, torch.Tensor] | None  # one-pass offsets (None: page path)
    holes: torch.Tensor | None  # rows of NO_BLOCK blocks, read as zeros (None: no hole)


class SpanReads:
    """One op's local-prefix rows and copied donor rows, gathered per layer.

    ``local`` holds KV-cache group ``group``'s local-prefix blocks (``kv``: one of its layers'
    tensors); ``add_group`` registers another group's. ``NO_BLOCK`` there (a window group's
    block out of every span token's window) reads as zeros: never attended to, never garbage.
    """

    def __init__(self, layout: PageLayout, kv: torch.Tensor, store: torch.Tensor | None,
                 local: torch.Tensor, slots: torch.Tensor, picked: torch.Tensor,
                 local_tokens: int, device: torch.device, heads: int, head_dim: int,
                 dtype: torch.dtype, group: int = 0) -> None:
        self.layout, self.device = layout, device
        self.slots, self.picked = slots, picked
        self.local_tokens = local_tokens
        self.empty = torch.zeros(0, heads, head_dim, dtype=dtype, device=device)
        self.shape = (heads, head_dim)
        self._local: dict[int, _Local] = {}
        self.add_group(group, kv, local)
        self.copy_index = None
        if store is not None and slots.numel() and flat(store) is not None:
            self.copy_index = layout.token_index(slots, picked, _page_numel(store))

    @property
    def local_index(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._local[0].index

    def add_group(self, group: int, kv: torch.Tensor, local: torch.Tensor) -> None:
        """``group``'s local-prefix blocks (``kv``: one of its layers' tensors)."""
        missing = local == NO_BLOCK
        holes = None
        if bool(missing.any()):
            block = self.layout.block_size
            holes = missing.repeat_interleave(block)[: self.local_tokens].to(self.device)
            local = local.masked_fill(missing, 0)  # any readable block: its rows are zeroed
        index = None
        if local.numel() and flat(kv) is not None:
            rows = torch.arange(self.local_tokens)
            index = self.layout.token_index(local, rows, _page_numel(kv))
        self._local[group] = _Local(local, index, holes)

    def _gather(self, t: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor],
                ) -> tuple[torch.Tensor, torch.Tensor]:
        view = flat(t)
        assert view is not None
        k_at, v_at = (i.to(t.device) for i in index)
        return (view.index_select(0, k_at).view(-1, *self.shape).to(self.device),
                view.index_select(0, v_at).view(-1, *self.shape).to(self.device))

    def _local_rows(self, kv: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        local = self._local[group]
        if local.index is not None:
            k, v = self._gather(kv, local.index)
        else:
            k, v = self.layout.read(kv.index_select(0, local.blocks.to(kv.device)))
            k, v = k.to(self.device), v.to(self.device)
        if local.holes is not None:
            k, v = k.masked_fill(local.holes[:, None, None], 0), \
                v.masked_fill(local.holes[:, None, None], 0)
        return k, v

    def layer(self, kv: torch.Tensor, store: torch.Tensor | None, group: int = 0,
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's local-prefix then copied K/V, ``[kv_heads, T, head_dim]`` each (``kv``:
        the layer's paged tensor, of KV-cache group ``group``)."""
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        if self._local[group].blocks.numel():
            parts.append(self._local_rows(kv, group))
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


def write_span(layout: PageLayout, kv_caches: Sequence[torch.Tensor],
               block_ids: Sequence[Sequence[int]], cache: KVCache, lo: int, hi: int) -> None:
    """``cache``'s positions ``[lo, hi)`` (whole blocks) into every layer's paged tensor
    (``kv_caches[i]``: decoder layer i's) at its blocks ``block_ids[i]``, whole pages assembled
    by ``PageLayout.write``; a ``NO_BLOCK`` page (vLLM's null block there) is not written."""
    kept: dict[tuple[int, ...], tuple[list[int], torch.Tensor | None]] = {}
    for layer, kv in enumerate(kv_caches):
        ids = tuple(block_ids[layer])
        if ids not in kept:
            kept[ids] = _written(ids, layout.block_size)
        blocks, rows = kept[ids]
        if not blocks:
            continue
        keys = cache.keys[layer][0, :, lo:hi].transpose(0, 1)
        values = cache.values[layer][0, :, lo:hi].transpose(0, 1)
        if rows is not None:
            keys, values = keys[rows], values[rows]
        layout.write(kv, blocks, keys.to(kv.device), values.to(kv.device))


def _written(ids: tuple[int, ...], block: int) -> tuple[list[int], torch.Tensor | None]:
    """The blocks a span write fills, and its rows of the span (None: every row)."""
    if NO_BLOCK not in ids:
        return list(ids), None
    pages = [i for i, b in enumerate(ids) if b != NO_BLOCK]
    rows = (torch.as_tensor(pages, dtype=torch.long)[:, None] * block
            + torch.arange(block)).flatten()
    return [ids[i] for i in pages], rows
