"""Whole-block copies between engine KV pages and the donor store.

Every layer's KV tensor is block-major (dim 0 indexes blocks), whatever the page interior looks
like: CPU pages are not token-major (K is stored column-major per head, AMX packs tiles), so
only whole-block copies between identical layouts are exact there. The donor store mirrors the
engine's page shape exactly, so a copy is a gather along dim 0 on one side and a scatter along
dim 0 on the other.

On CUDA the store lives in pinned host memory: gather on the source device, one transfer,
scatter on the destination device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _index(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(ids), dtype=torch.long, device=device)


def copy_blocks(src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor,
                dst_ids: Sequence[int]) -> None:
    """``dst[dst_ids] = src[src_ids]`` for whole blocks, across devices when needed."""
    if len(src_ids) != len(dst_ids):
        raise ValueError("source and destination block lists differ in length")
    if not src_ids:
        return
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(
            f"page mismatch: {tuple(src.shape[1:])}/{src.dtype} vs "
            f"{tuple(dst.shape[1:])}/{dst.dtype}"
        )
    if src.device == dst.device:
        # One pass over the data: copy each run of consecutive blocks as one slice (a gather
        # into a temporary and a scatter from it would read and write everything twice).
        for s, d, n in _runs(src_ids, dst_ids):
            dst[d : d + n].copy_(src[s : s + n])
        return
    gathered = src.index_select(0, _index(src_ids, src.device))
    gathered = gathered.to(dst.device, non_blocking=dst.device.type == "cuda")
    dst.index_copy_(0, _index(dst_ids, dst.device), gathered)


def _runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of maximal runs consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def allocate_store(like: torch.Tensor, num_slots: int) -> torch.Tensor:
    """A host tensor of ``num_slots`` pages shaped like ``like``'s pages.

    NOTE: ``torch.empty`` reserves address space only; pages are committed when first written,
    so an unused budget costs no memory.
    """
    pin = like.device.type == "cuda"
    return torch.empty((num_slots, *like.shape[1:]), dtype=like.dtype, device="cpu",
                       pin_memory=pin)
