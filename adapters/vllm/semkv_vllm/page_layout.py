"""Token-level access to KV pages whose interior is not token-major (vLLM CPU, and others).

A page is one block of one layer: logical shape ``[num_kv_heads, block_size, 2 * head_size]``,
but the attention backend decides where each value really lives (CPU VEC kernels store K
column-major per head; GPU FlashAttention is token-major). Rather than hard-coding layouts,
``PageLayout.probe`` asks the engine's own cache-write kernel (the attention implementation's
``do_kv_cache_update``) to write numbered keys and values into a scratch page and reads back
where each number landed. A layout is accepted only when that mapping is a bijection onto the
page (every K and V element written exactly once, nothing else touched); anything else (packed
or quantized tiles) yields None and token-level edits are refused.

NOTE: numbers are written in base-64 digits, one pass per digit, so the probe is exact even in
bf16/fp16 pages (integers up to 256 are exact there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

# (key [T, H, D], value [T, H, D], scratch page tensor [1, H, B, 2D], slot mapping [T]) -> None
CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
_BASE = 64


@dataclass(frozen=True)
class PageLayout:
    """Flat page offsets of every (token, head, channel) of K and of V in one page."""

    k_offsets: torch.Tensor  # [block_size, heads, head_size] long
    v_offsets: torch.Tensor

    @property
    def block_size(self) -> int:
        return int(self.k_offsets.shape[0])

    @classmethod
    def token_major(cls, page_shape: Sequence[int]) -> PageLayout:
        """The logical view taken literally: ``page[h, t, :D]`` is K, ``page[h, t, D:]`` is V."""
        heads, block, width = page_shape
        d = width // 2
        flat = torch.arange(heads * block * width).view(heads, block, width).transpose(0, 1)
        return cls(flat[..., :d].contiguous(), flat[..., d:].contiguous())

    @classmethod
    def probe(cls, write: CacheWriter, page_shape: Sequence[int], dtype: torch.dtype,
              device: torch.device | str = "cpu") -> PageLayout | None:
        heads, block, width = page_shape
        d = width // 2
        n = block * heads * d
        slots = torch.arange(block, device=device)
        offsets = []
        for part in (0, 1):  # 0: K, 1: V
            code = torch.zeros(heads * block * width, dtype=torch.long)
            touched = torch.zeros_like(code, dtype=torch.bool)
            scale, ids = 1, torch.arange(n).view(block, heads, d)
            while True:
                digit = ((ids // scale) % _BASE + 1).to(dtype)
                zeros = torch.zeros_like(digit)
                page = torch.zeros((1, *page_shape), dtype=dtype, device=device)
                k, v = (digit, zeros) if part == 0 else (zeros, digit)
                write(k.to(device), v.to(device), page, slots)
                flat = page.reshape(-1).to("cpu", torch.float32)
                written = flat != 0
                if scale == 1:
                    touched = written
                elif not torch.equal(written, touched):
                    return None
                code += (flat.round().long() - 1).clamp_min(0) * scale
                scale *= _BASE
                if scale >= n:
                    break
            where = torch.nonzero(touched).flatten()
            if where.numel() != n:
                return None
            located = torch.full((n,), -1, dtype=torch.long)
            values = code[where]
            if values.min() < 0 or values.max() >= n:
                return None
            located[values] = where
            if (located < 0).any():
                return None
            offsets.append(located.view(block, heads, d))
        if set(offsets[0].flatten().tolist()) & set(offsets[1].flatten().tolist()):
            return None
        return cls(offsets[0], offsets[1])

    def read(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``pages`` [N, H, B, 2D] as token-major [N * B, H, D] tensors."""
        flat = pages.reshape(pages.shape[0], -1)
        k = flat[:, self.k_offsets.to(flat.device).flatten()]
        v = flat[:, self.v_offsets.to(flat.device).flatten()]
        shape = (pages.shape[0] * self.block_size, *self.k_offsets.shape[1:])
        return k.reshape(shape), v.reshape(shape)

    @cached_property
    def _source(self) -> torch.Tensor:
        """Per page element, its index in one block's K then V, token-major (the inverse of
        the offsets: a bijection, as ``probe`` and ``token_major`` guarantee)."""
        k, v = self.k_offsets.flatten(), self.v_offsets.flatten()
        inverse = torch.empty(k.numel() + v.numel(), dtype=torch.long)
        inverse[k] = torch.arange(k.numel())
        inverse[v] = torch.arange(k.numel(), k.numel() + v.numel())
        return inverse

    def write(self, kv: torch.Tensor, block_ids: Sequence[int], keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """Store token-major ``keys``/``values`` [len(block_ids) * B, H, D] into whole blocks.

        NOTE: every element of the blocks is written (the layout is a bijection onto the
        page), so the pages are assembled by one gather, never read first."""
        n = len(block_ids)
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=kv.device)
        both = torch.cat([keys.reshape(n, -1), values.reshape(n, -1)], dim=1).to(kv.dtype)
        pages = both.index_select(1, self._source.to(kv.device))
        kv.index_copy_(0, idx, pages.view(n, *kv.shape[1:]))


    def token_index(self, blocks: torch.Tensor, rows: torch.Tensor,
                    page_numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Element offsets, in a contiguous block-major tensor flattened (``flat``), of the K
        and of the V of token ``rows``: row r is token ``r % block_size`` of block
        ``blocks[r // block_size]``; each ordered (row, head, channel), token-major.

        Built once per realization and used for every layer (each layer's tensor has the same
        shape), so a layer's tokens are read or written in one gather or scatter pass instead
        of copying whole pages out and back."""
        bs = self.block_size
        base = blocks.to(torch.long)[rows // bs] * page_numel
        within = rows % bs
        k = (base[:, None] + self.k_offsets.reshape(bs, -1)[within]).reshape(-1)
        v = (base[:, None] + self.v_offsets.reshape(bs, -1)[within]).reshape(-1)
        return k, v


def flat(kv: torch.Tensor) -> torch.Tensor | None:
    """``kv`` as one flat view when its elements are laid out contiguously (vLLM's CPU pages,
    the donor store), else None: the caller reads and writes whole pages instead."""
    return kv.view(-1) if kv.is_contiguous() else None


def backend_writer(layer: object) -> CacheWriter | None:
    """The attention layer's own cache-write kernel, as a ``CacheWriter`` (None if it has none)."""
    impl = getattr(layer, "impl", None)
    update = getattr(impl, "do_kv_cache_update", None)
    if update is None:
        return None

    def write(key: torch.Tensor, value: torch.Tensor, page: torch.Tensor,
              slots: torch.Tensor) -> None:
        update(layer, key, value, page, slots)

    return write
