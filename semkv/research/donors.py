"""Donor KV: computed once per donor prompt, cached in memory, served chunk by chunk.

Protocol: ``DonorStore(lm, chunk_tokens=64)``; ``add(donor_id, token_ids)`` runs a full prefill
of the donor (its KV is what a serving engine would have cached after running that request) and
keeps it; ``chunk(donor_id, i)`` is the KV of the donor's i-th chunk of ``chunk_tokens`` tokens
(views, no copy) and ``gather(donor_id, positions)`` the KV of arbitrary donor positions, which is
what assembly uses: a target may take any donor span, at any offset, from several donors.

Keys are stored as the donor computed them, rotated for the donor's positions; assembly moves
them (``RopeRotator``). NOTE: the store holds prompts' token ids and KV in memory only; its repr
shows ids and sizes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from semkv.research.layers import KVCache, LayerwiseModel

DEFAULT_CHUNK_TOKENS = 64


@dataclass(frozen=True)
class DonorKV:
    token_ids: tuple[int, ...]
    cache: KVCache  # capacity == len(token_ids)


@dataclass(frozen=True)
class ChunkKV:
    """One donor chunk: donor positions ``[start, end)`` and their per-layer KV (views)."""

    donor_id: str
    start: int
    end: int
    keys: list[torch.Tensor]  # per layer [1, kv_heads, end - start, head_dim]
    values: list[torch.Tensor]


class DonorStore:
    """Donor prompts' KV, computed on ``add`` and kept in memory."""

    def __init__(self, lm: LayerwiseModel, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be positive")
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        self._donors: dict[str, DonorKV] = {}

    def __repr__(self) -> str:  # ids and sizes only
        sizes = {d: len(e.token_ids) for d, e in self._donors.items()}
        return f"DonorStore(chunk_tokens={self.chunk_tokens}, donors={sizes})"

    def __contains__(self, donor_id: object) -> bool:
        return donor_id in self._donors

    def __iter__(self) -> Iterator[str]:
        return iter(self._donors)

    def __len__(self) -> int:
        return len(self._donors)

    def add(self, donor_id: str, token_ids: Sequence[int]) -> None:
        """Prefill the donor once; adding the same id again with the same tokens is a no-op."""
        ids = tuple(int(t) for t in token_ids)
        known = self._donors.get(donor_id)
        if known is not None:
            if known.token_ids != ids:
                raise ValueError(f"donor {donor_id!r} was added with other tokens")
            return
        if not ids:
            raise ValueError("a donor needs at least one token")
        cache, _ = self.lm.full_prefill(ids, all_logits=False)
        self._donors[donor_id] = DonorKV(ids, cache)

    def tokens(self, donor_id: str) -> tuple[int, ...]:
        return self._donors[donor_id].token_ids

    def token_map(self) -> dict[str, tuple[int, ...]]:
        """Every donor's token ids, the input ``plan_reuse`` takes."""
        return {d: e.token_ids for d, e in self._donors.items()}

    def num_chunks(self, donor_id: str) -> int:
        n = len(self._donors[donor_id].token_ids)
        return -(-n // self.chunk_tokens)

    def chunk(self, donor_id: str, index: int) -> ChunkKV:
        entry = self._donors[donor_id]
        if not 0 <= index < self.num_chunks(donor_id):
            raise IndexError(index)
        start = index * self.chunk_tokens
        end = min(start + self.chunk_tokens, len(entry.token_ids))
        return ChunkKV(
            donor_id, start, end,
            [k[:, :, start:end] for k in entry.cache.keys],
            [v[:, :, start:end] for v in entry.cache.values],
        )

    def gather(self, donor_id: str, positions: torch.Tensor
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer KV ``[1, kv_heads, len(positions), head_dim]`` of these donor positions."""
        entry = self._donors[donor_id]
        idx = positions.to(dtype=torch.long, device=entry.cache.keys[0].device)
        return ([k[:, :, idx] for k in entry.cache.keys],
                [v[:, :, idx] for v in entry.cache.values])
