"""Which donor token serves which target position, and the target's KV assembled from them.

Protocol:

1. ``plan_reuse(target, donors)`` takes its decision from ``semkv.span_plan.decide_reuse``, the
   one the engine's span plans use (so both reuse the same positions): it maps the whole target
   against every donor with ``semkv.span_map.map_tokens`` (runs continue, anchors of 8 tokens
   jump to shifted copies), then, per target chunk of ``chunk_tokens``, keeps the donor with
   the most identical tokens in that chunk: one donor per chunk, several donors per target
   (reordered or mixed sources).
2. A position is *reused* when its mapped donor token is identical (or any mapped token, with
   ``reuse_mismatched``, the semantic approximation), it lies in a run of at least
   ``min_run_tokens`` such positions served by consecutive positions of one donor (isolated
   coincidental matches are not worth a load), and it is not the last prompt token (whose
   logits start the generation, so it is always computed).
3. ``assemble(plan, store, lm)`` writes each reused position's donor KV into a fresh cache, keys
   re-rotated by (target position - donor position); other positions are left zero, for the
   recompute strategy to fill.

NOTE: a ReusePlan holds positions and donor ids only, never token ids: it is safe to log.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from semkv.plan_class import PlanClass, classify
from semkv.realize import KVCache, LayerRunner
from semkv.research.donors import DEFAULT_CHUNK_TOKENS, DonorStore
from semkv.span_map import DEFAULT_ANCHOR_TOKENS
from semkv.span_plan import DEFAULT_MIN_RUN_TOKENS, NO_SOURCE, decide_reuse

__all__ = ["DEFAULT_MIN_RUN_TOKENS", "NO_SOURCE", "ReusePlan", "Segment", "assemble",
           "plan_reuse", "rank_donors"]


@dataclass(frozen=True)
class Segment:
    """A run of reused target positions served by consecutive positions of one donor."""

    target_start: int
    donor_id: str
    donor_start: int
    length: int

    @property
    def shift(self) -> int:
        return self.target_start - self.donor_start


@dataclass(frozen=True)
class ReusePlan:
    num_tokens: int
    donor_ids: tuple[str | None, ...]  # per target position: the serving donor, None if unmapped
    donor_positions: tuple[int, ...]  # NO_SOURCE where unmapped
    identical: tuple[bool, ...]  # the mapped donor token equals the target token
    segments: tuple[Segment, ...]  # the reused positions, as runs

    @property
    def reused(self) -> list[bool]:
        flags = [False] * self.num_tokens
        for seg in self.segments:
            flags[seg.target_start: seg.target_start + seg.length] = [True] * seg.length
        return flags

    @property
    def reused_tokens(self) -> int:
        return sum(seg.length for seg in self.segments)

    @property
    def shifted_tokens(self) -> int:
        return sum(seg.length for seg in self.segments if seg.shift)

    @property
    def mismatched_reused_tokens(self) -> int:
        return sum(not self.identical[seg.target_start + i]
                   for seg in self.segments for i in range(seg.length))

    def donors_used(self) -> list[str]:
        return sorted({seg.donor_id for seg in self.segments})

    @property
    def plan_class(self) -> PlanClass:
        """The engine's class of this shape (``semkv.plan_class``): the runs against every
        position not reused (all of them computed here)."""
        return classify(self.segments, self.num_tokens - self.reused_tokens)

    def summary(self) -> dict[str, int | str | list[str]]:
        """Counts only (safe to log)."""
        return {"tokens": self.num_tokens, "reused": self.reused_tokens,
                "shifted": self.shifted_tokens, "segments": len(self.segments),
                "mismatched_reused": self.mismatched_reused_tokens, "donors": self.donors_used(),
                "class": str(self.plan_class)}


def plan_reuse(
    target: Sequence[int],
    donors: Mapping[str, Sequence[int]],
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    min_run_tokens: int = DEFAULT_MIN_RUN_TOKENS,
    reuse_mismatched: bool = False,
    anchor_tokens: int = DEFAULT_ANCHOR_TOKENS,
) -> ReusePlan:
    """The reuse plan of ``target`` from ``donors`` (best donor per chunk; ties: first given)."""
    # The decision itself lives in the core, so the engine's span plans reuse the same positions.
    decision = decide_reuse(target, donors, chunk_tokens=chunk_tokens,
                            min_run_tokens=min_run_tokens, anchor_tokens=anchor_tokens,
                            reuse_mismatched=reuse_mismatched)
    segments = tuple(Segment(run.target_start, run.donor_id, run.donor_start, run.length)
                     for run in decision.runs if run.donor_id is not None)
    return ReusePlan(len(target), decision.donor_ids, decision.positions, decision.identical,
                     segments)


def rank_donors(
    target: Sequence[int], donors: Mapping[str, Sequence[int]], *,
    exclude: Sequence[str] = (), **plan_options: int | bool,
) -> list[tuple[str, int]]:
    """Donors by how many target tokens each alone could serve, most first (ties: by id)."""
    scores = [
        (d, plan_reuse(target, {d: ids}, **plan_options).reused_tokens)  # type: ignore[arg-type]
        for d, ids in donors.items() if d not in exclude
    ]
    return sorted(scores, key=lambda item: (-item[1], item[0]))


def assemble(
    plan: ReusePlan, store: DonorStore, lm: LayerRunner, *,
    capacity: int | None = None, rotate: bool = True,
) -> KVCache:
    """A cache holding every reused position's donor KV, keys moved to the target position.

    ``rotate=False`` leaves keys at their donor positions: wrong whenever a segment is shifted,
    and kept only as the control that shows what re-rotation is for.
    """
    cache = lm.empty_cache(max(plan.num_tokens, capacity or 0))
    by_donor: dict[str, tuple[list[int], list[int]]] = {}
    for seg in plan.segments:
        targets, sources = by_donor.setdefault(seg.donor_id, ([], []))
        targets.extend(range(seg.target_start, seg.target_start + seg.length))
        sources.extend(range(seg.donor_start, seg.donor_start + seg.length))
    for donor, (targets, sources) in by_donor.items():
        target_pos = torch.tensor(targets, dtype=torch.long)
        donor_pos = torch.tensor(sources, dtype=torch.long)
        keys, values = store.gather(donor, donor_pos)
        deltas = target_pos - donor_pos
        moved = bool(rotate and deltas.any())
        for layer in range(lm.num_layers):
            k = lm.rotator.rotate(keys[layer], deltas, layer) if moved else keys[layer]
            cache.keys[layer][:, :, target_pos] = k.to(cache.keys[layer].dtype)
            cache.values[layer][:, :, target_pos] = values[layer].to(cache.values[layer].dtype)
    return cache
