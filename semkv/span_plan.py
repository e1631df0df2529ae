"""Segmented, multi-donor plans for one external span: which donor fills which target tokens.

vLLM gives a request one external span, ``[local_tokens, span_tokens)`` after its local exact
prefix. Inside it the worker realizes the target's own KV segment by segment (DESIGN.md,
"Non-prefix reuse inside one external span")::

    | local exact prefix | copy(d1, shifted) gap copy(d2) gap ... | computed tail |
    0                    local_tokens                  span_tokens         len(target)

Protocol:

1. ``decide_reuse(target, donors)`` is THE reuse decision, shared by the engine and by
   ``semkv.research.assembly.plan_reuse`` so that both reuse the same positions: the whole
   target is mapped against every donor with ``semkv.span_map.map_tokens`` (continued where
   that walk runs off a short donor, so its passage is found even late in the target) that
   holds one of the target's k-grams at a sampled position that no donor mapped before it
   holds (``_brings_new_anchor``: every run of 23 or more shared tokens has one; research's
   mismatched reuse maps every donor); per
   target chunk of ``chunk_tokens`` the donor with the most identical tokens serves the chunk
   (ties: the first donor given); a position is reusable when its mapped donor token is
   identical (or mapped at all, with ``reuse_mismatched``, research only) and it is not the
   last prompt token; reusable positions served by consecutive positions of one donor form
   runs, kept when at least ``min_run_tokens`` long (isolated coincidences are not worth a
   load).
2. ``plan_span(target, donors, local_tokens=..., block_size=...)`` (scheduler side, identical
   tokens only) clips those runs to the span: it starts at the local exact prefix and ends at
   the last block boundary before the last prompt token (vLLM always computes that token; its
   logits start the generation). Every span position no run serves is a gap, computed through
   the model. None when fewer than ``min_copied_tokens`` tokens would be copied.
3. The ``SpanPlan`` crosses to the worker, which copies each donor segment (keys re-rotated by
   ``target_start - donor_start``) and computes each gap.

NOTE: plans hold positions, lengths and donor ids only, never token ids: safe to log and to
send across processes (JSON and pickle). numpy only: no torch, no vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from semkv.anchor_cache import AnchorIndex
from semkv.span_map import (
    DEFAULT_ANCHOR_TOKENS,
    Bools,
    Ints,
    TargetGrams,
    anchor_index,
    token_array,
    walk_donor,
)

DEFAULT_CHUNK_TOKENS = 64  # the same default as semkv.research.donors.DEFAULT_CHUNK_TOKENS
DEFAULT_MIN_RUN_TOKENS = 4
NO_SOURCE = -1  # donor position of a target position that no donor maps


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SpanSegment(_Frozen):
    """Target ``[target_start, target_start + length)``: copied from a donor, or a gap.

    A copied segment reads the donor's positions ``[donor_start, donor_start + length)``
    (identical tokens); a gap (``donor_id=None``, ``donor_start=0``) is computed.
    """

    target_start: int = Field(ge=0)
    length: int = Field(gt=0)
    donor_id: str | None = Field(default=None, min_length=1)
    donor_start: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _gap_has_no_donor_offset(self) -> SpanSegment:
        if self.donor_id is None and self.donor_start != 0:
            raise ValueError("a gap segment has donor_start 0")
        return self

    @property
    def end(self) -> int:
        return self.target_start + self.length

    @property
    def is_gap(self) -> bool:
        return self.donor_id is None

    @property
    def shifted(self) -> bool:
        """Copied from another position: keys need re-rotation by ``target_start - donor_start``."""
        return self.donor_id is not None and self.donor_start != self.target_start


class SpanPlan(_Frozen):
    """How the worker realizes the external span ``[local_tokens, span_tokens)``."""

    block_size: int = Field(gt=0)
    local_tokens: int = Field(ge=0)
    span_tokens: int = Field(gt=0)  # the span's end: a block boundary
    segments: tuple[SpanSegment, ...] = Field(min_length=1)  # in target order, contiguous

    @model_validator(mode="after")
    def _covers_the_span(self) -> SpanPlan:
        bs = self.block_size
        if self.local_tokens % bs or self.span_tokens % bs:
            raise ValueError(
                f"local_tokens ({self.local_tokens}) and span_tokens ({self.span_tokens}) must "
                f"be multiples of block_size ({bs})")
        if self.span_tokens <= self.local_tokens:
            raise ValueError(
                f"span_tokens ({self.span_tokens}) must exceed local_tokens ({self.local_tokens})")
        at = self.local_tokens
        for i, seg in enumerate(self.segments):
            if seg.target_start != at:
                problem = "overlaps the previous one" if seg.target_start < at else "leaves a hole"
                raise ValueError(
                    f"segment {i} starts at {seg.target_start}, expected {at}: it {problem}")
            at = seg.end
        if at != self.span_tokens:
            raise ValueError(f"segments end at {at}, not at span_tokens ({self.span_tokens})")
        return self

    @property
    def num_tokens(self) -> int:
        return self.span_tokens - self.local_tokens

    @property
    def copied_tokens(self) -> int:
        return sum(s.length for s in self.segments if not s.is_gap)

    @property
    def shifted_tokens(self) -> int:
        return sum(s.length for s in self.segments if s.shifted)

    @property
    def computed_tokens(self) -> int:
        """Gap tokens inside the span (the tail after ``span_tokens`` is not counted)."""
        return sum(s.length for s in self.segments if s.is_gap)

    def gap_positions(self) -> list[int]:
        """The span positions no donor serves (computed inside the span), in order."""
        return [p for s in self.segments if s.is_gap for p in range(s.target_start, s.end)]

    @property
    def donors(self) -> tuple[str, ...]:
        """The donors copied from, in order of first use."""
        return tuple(dict.fromkeys(s.donor_id for s in self.segments if s.donor_id is not None))

    def summary(self) -> dict[str, int]:
        """Counts only (safe to log)."""
        return {"local": self.local_tokens, "span": self.span_tokens,
                "copied": self.copied_tokens, "shifted": self.shifted_tokens,
                "computed": self.computed_tokens, "donors": len(self.donors),
                "segments": len(self.segments)}


@dataclass(frozen=True)
class ReuseDecision:
    """Per target position: the serving donor (None), its position (NO_SOURCE), identity."""

    donor_ids: tuple[str | None, ...]
    positions: tuple[int, ...]
    identical: tuple[bool, ...]
    runs: tuple[SpanSegment, ...]  # the reused positions, as copied segments in target order


@dataclass(frozen=True)
class _Choice:
    """``decide_reuse``'s arrays: per target position the serving donor's index in ``names``
    (-1: none), its position (NO_SOURCE), identity; and the runs."""

    names: list[str]
    donor: Ints
    positions: Ints
    identical: Bools
    runs: tuple[SpanSegment, ...]


def _map_donor(target: Sequence[int] | Ints, donor: Sequence[int] | Ints, k: int,
               grams: Ints | TargetGrams, anchors: AnchorIndex | None = None,
               ) -> tuple[Ints, Bools]:
    """``map_tokens`` over the whole target, continued past the point where it ran off the donor.

    ``map_tokens`` stops for good at the first position after its walk passed the donor's end
    that starts no anchor. A short donor (one passage) whose text comes late in the target
    (after other donors' passages) would then never be reached; so from there on each target
    position is looked up again (NO_SOURCE until an anchor matches, then the usual walk).
    Positions before that point are exactly ``map_tokens``'s. ``grams``: the target's k-grams
    (``k = max(1, anchor_tokens)``) as ``gram_keys``, built once for all donors; ``anchors``:
    the donor's ``anchor_index`` when the caller already looked it up.
    """
    n = len(target)
    if not len(donor):
        return np.full(n, NO_SOURCE, np.int64), np.zeros(n, np.bool_)
    return walk_donor(target, donor, 0, n, k, grams, resume_with=NO_SOURCE, anchors=anchors)


def _best_donor_per_chunk(n: int, maps: list[tuple[Ints, Bools]], chunk_tokens: int,
                          ) -> tuple[Ints, Ints, Bools]:
    """Per target chunk the donor with the most identical tokens (ties: the first given);
    per position its index in ``maps`` (-1 where it maps nothing), position and identity."""
    if not maps:
        return np.full(n, -1, np.int64), np.full(n, NO_SOURCE, np.int64), np.zeros(n, np.bool_)
    chunks = -(-n // chunk_tokens)
    same = np.zeros((len(maps), chunks * chunk_tokens), np.bool_)
    for row, (_, flags) in zip(same, maps, strict=True):
        row[:n] = flags
    best = same.reshape(len(maps), chunks, chunk_tokens).sum(axis=2).argmax(axis=0)
    chosen = np.repeat(best, chunk_tokens)[:n]
    positions = np.full(n, NO_SOURCE, np.int64)
    identical = np.zeros(n, np.bool_)
    for i in np.unique(best).tolist():  # only the donors that serve a chunk are read
        served = chosen == i
        positions[served] = maps[i][0][served]
        identical[served] = same[i, :n][served]
    mapped = positions != NO_SOURCE  # unmapped stays None: no KV serves that position
    return np.where(mapped, chosen, -1), positions, identical & mapped


def _runs(names: list[str], donor: Ints, positions: Ints, usable: Bools,
          min_run: int) -> tuple[SpanSegment, ...]:
    """Usable positions served by consecutive positions of one donor, at least ``min_run``."""
    n = len(usable)
    if not n:
        return ()
    goes_on = np.zeros(n + 1, np.bool_)  # position p continues the run of p - 1
    goes_on[1:n] = (usable[1:] & usable[:-1] & (donor[1:] == donor[:-1])
                    & (positions[1:] == positions[:-1] + 1))
    starts = np.flatnonzero(usable & ~goes_on[:n])
    ends = np.flatnonzero(usable & ~goes_on[1:])  # the last position of each run
    keep = ends - starts + 1 >= min_run
    # NOTE: built without re-validation: every field comes from the arrays checked above
    # (positive lengths, non-negative positions, a named donor).
    return tuple(SpanSegment.model_construct(target_start=a, length=b - a + 1,
                                             donor_id=names[d], donor_start=q)
                 for a, b, d, q in zip(starts[keep].tolist(), ends[keep].tolist(),
                                       donor[starts[keep]].tolist(),
                                       positions[starts[keep]].tolist(), strict=True))


def _brings_new_anchor(held: Bools, covered: Bools) -> bool:
    """Does a donor hold one of the target's sampled k-grams that no donor mapped before it
    holds? Any run of ``ANCHOR_STRIDE + k - 1`` (23) or more tokens it shares with the target
    holds a sampled k-gram; when a donor mapped before it holds that k-gram too, that donor's
    walk maps the same position to an identical token (an anchor is taken where tokens
    differ), so this donor could add at most the ends of such runs. Most candidates share
    only the prompt template with a target, which the first of them already brings (issue
    #25: planning time)."""
    return bool((held & ~covered).any())


def _choose(target: Sequence[int], donors: Mapping[str, Sequence[int]], chunk_tokens: int,
            min_run_tokens: int, anchor_tokens: int, reuse_mismatched: bool,
            namespace: str = "") -> _Choice:
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be positive")
    ids = token_array(target)  # e.g. vLLM's ConstantList
    n = len(ids)
    k = max(1, anchor_tokens)
    grams = TargetGrams.of(ids, k)  # one target's k-gram keys, for every donor
    names: list[str] = []
    maps: list[tuple[Ints, Bools]] = []
    covered = np.zeros(len(grams.sampled), np.bool_)  # sampled keys a mapped donor holds
    for d, tokens in donors.items():
        anchors = anchor_index(tokens, k, namespace) if len(tokens) else AnchorIndex.empty()
        if not reuse_mismatched:
            held = grams.sampled_held(anchors)
            if not _brings_new_anchor(held, covered):
                continue
            covered |= held
        names.append(d)
        maps.append(_map_donor(ids, tokens, k, grams, anchors))
    donor, positions, identical = _best_donor_per_chunk(n, maps, chunk_tokens)
    usable = identical | (reuse_mismatched & (donor >= 0))
    if n:  # the last prompt token is never reused: its logits start the generation
        usable[n - 1] = False
    runs = _runs(names, donor, positions, usable, max(1, min_run_tokens))
    return _Choice(names, donor, positions, identical, runs)


def decide_reuse(
    target: Sequence[int],
    donors: Mapping[str, Sequence[int]],
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    min_run_tokens: int = DEFAULT_MIN_RUN_TOKENS,
    anchor_tokens: int = DEFAULT_ANCHOR_TOKENS,
    reuse_mismatched: bool = False,
) -> ReuseDecision:
    """Which donor position serves each target position, and the runs worth copying (step 1)."""
    c = _choose(target, donors, chunk_tokens, min_run_tokens, anchor_tokens, reuse_mismatched)
    named: list[str | None] = [*c.names, None]  # index -1: no donor
    return ReuseDecision(tuple(named[i] for i in c.donor.tolist()), tuple(c.positions.tolist()),
                         tuple(c.identical.tolist()), c.runs)


def span_end(num_tokens: int, local_tokens: int, block_size: int,
             max_span_tokens: int | None = None) -> int:
    """The span's end: the last block boundary before the last prompt token, capped."""
    end = num_tokens - 1
    if max_span_tokens is not None:
        end = min(end, local_tokens + max_span_tokens)
    return max(local_tokens, end - end % block_size)


def plan_span(
    target_ids: Sequence[int],
    donors: Mapping[str, Sequence[int]],
    *,
    local_tokens: int,
    block_size: int,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    min_run_tokens: int = DEFAULT_MIN_RUN_TOKENS,
    min_copied_tokens: int = 1,
    max_span_tokens: int | None = None,
    anchor_tokens: int = DEFAULT_ANCHOR_TOKENS,
    namespace: str = "",
) -> SpanPlan | None:
    """The segmented plan of the target's external span (identical tokens only), or None.

    ``donors`` maps donor id -> the donor tokens whose KV can be served. ``max_span_tokens``
    caps the span's length after ``local_tokens`` (the full-prompt cap of admission).
    ``namespace``: the donors' (keys their cached anchor indexes: ``semkv.anchor_cache``).
    """
    if block_size <= 0 or local_tokens < 0 or local_tokens % block_size:
        raise ValueError("local_tokens must be a non-negative multiple of a positive block_size")
    end = span_end(len(target_ids), local_tokens, block_size, max_span_tokens)
    if end <= local_tokens or not donors:
        return None
    runs = _choose(target_ids, donors, chunk_tokens, min_run_tokens, anchor_tokens,
                   reuse_mismatched=False, namespace=namespace).runs
    segments: list[SpanSegment] = []
    at = local_tokens
    for run in runs:
        # Runs are decided on the whole target, then clipped to the span, so the engine reuses
        # exactly the positions research reuses inside [local_tokens, end).
        lo, hi = max(run.target_start, at), min(run.end, end)
        if hi <= lo:
            continue
        if lo > at:
            segments.append(SpanSegment(target_start=at, length=lo - at))
        segments.append(SpanSegment(target_start=lo, length=hi - lo, donor_id=run.donor_id,
                                    donor_start=run.donor_start + lo - run.target_start))
        at = hi
    if at < end:
        segments.append(SpanSegment(target_start=at, length=end - at))
    plan = SpanPlan(block_size=block_size, local_tokens=local_tokens, span_tokens=end,
                    segments=tuple(segments))
    return plan if plan.copied_tokens >= max(1, min_copied_tokens) else None
