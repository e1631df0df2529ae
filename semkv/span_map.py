"""Token maps for non-identical reuse: which donor token serves each target position.

Protocol: admission calls ``map_span(target, donor, start, ...)`` for a target span that begins
at ``start`` (the end of the local exact prefix). It walks the target from ``start`` and picks,
for every position, the donor position whose KV will serve it:

- while target and donor agree token by token, the run simply continues;
- where they stop agreeing, the next ``anchor_tokens`` target tokens are looked up in the
  donor; if they occur there, the map jumps to that donor position (a shifted copy: other
  instruction lengths, reordered chunks, inserted sentences);
- otherwise the map advances positionally, and that position counts as a token difference.

The result is a ``SpanMap``: runs of consecutive donor positions (``segments``), how many mapped
tokens differ, and whether any run is shifted (needs positional re-rotation). The tier follows:
no difference and no shift = exact, no difference but shifted = verified, any difference =
semantic. ``agreement`` is the fraction of mapped tokens that are identical.

The span length is the longest whole-block span whose agreement, overall and in its last
block, stays at or above ``min_agreement`` (capped at ``max_tokens``, and never past the donor's
end), so the costly shared body is served and a differing tail (the question) is computed.

NOTE: positions only, never token ids, leave this module; a SpanMap is safe to log.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from semkv.anchor_cache import ANCHOR_CACHE, AnchorIndex, SketchSlots
from semkv.types import QualityTier

DEFAULT_ANCHOR_TOKENS = 8
Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class SpanMap:
    """Target ``[target_start, target_start + num_tokens)`` served by donor positions."""

    target_start: int
    num_tokens: int
    segments: tuple[tuple[int, int, int], ...]  # (target position, donor position, length)
    token_differences: int

    @property
    def agreement(self) -> float:
        return 1.0 - self.token_differences / self.num_tokens if self.num_tokens else 0.0

    @property
    def shifted(self) -> bool:
        return any(t != d for t, d, _ in self.segments)

    @property
    def tier(self) -> QualityTier:
        if self.token_differences:
            return QualityTier.SEMANTIC
        return QualityTier.VERIFIED if self.shifted else QualityTier.EXACT

    def donor_positions(self) -> list[int]:
        return [d + i for _, d, n in self.segments for i in range(n)]

    def donor_range(self) -> tuple[int, int]:
        """Smallest and one-past-largest donor position used."""
        lo = min(d for _, d, _ in self.segments)
        hi = max(d + n for _, d, n in self.segments)
        return lo, hi


def token_array(tokens: Sequence[int] | Ints) -> Ints:
    """``tokens`` as an int64 array (``array('q')`` and int64 arrays without a copy)."""
    if isinstance(tokens, np.ndarray):
        return tokens.astype(np.int64, copy=False)
    if isinstance(tokens, array) and tokens.typecode == "q":
        return np.frombuffer(tokens, dtype=np.int64) if len(tokens) else np.zeros(0, np.int64)
    return np.asarray(tokens if isinstance(tokens, list) else list(tokens), dtype=np.int64)


# Multiply-add (mod 2**64) over the k tokens, then splitmix64's finalizer: unrelated k-grams of
# real token ids get unrelated keys. Keys only find anchors; the walk checks each anchor's tokens.
_MUL = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def gram_keys(tokens: Sequence[int] | Ints, start: int, end: int, k: int) -> Ints:
    """One 64-bit key per k-gram of ``tokens`` starting at ``[start, end)`` that fits."""
    t = token_array(tokens).view(np.uint64)
    m = min(end, len(t) - k + 1) - start
    if m <= 0:
        return np.zeros(0, np.int64)
    h = t[start: start + m].copy()
    for j in range(1, k):
        h *= _MUL
        h += t[start + j: start + j + m]
    h ^= h >> np.uint64(30)
    h *= _MIX1
    h ^= h >> np.uint64(27)
    h *= _MIX2
    h ^= h >> np.uint64(31)
    return h.view(np.int64)


def anchor_index(donor: Sequence[int] | Ints, k: int, namespace: str = "") -> AnchorIndex:
    """First donor position of every k-gram key (cached by the donor's namespace and exact
    tokens: a donor's index is built once, not once per request; see
    ``semkv.anchor_cache``)."""
    return ANCHOR_CACHE.get(donor, k, build_anchor_index, namespace)


def build_anchor_index(donor: Sequence[int] | Ints, k: int) -> AnchorIndex:
    """First donor position of every k-gram key (first occurrence wins: stable, left-most).

    NOTE: an anchor is checked token by token where the walk uses it (``_walk``): a key
    collision is never a false anchor. Two different k-grams of one donor with the same 64-bit
    key would lose the later one's anchor (odds ~1e-12 per 4K donor): a shorter copy at worst,
    never a wrong one."""
    keys, first = np.unique(gram_keys(donor, 0, len(donor), k), return_index=True)
    return AnchorIndex(keys, first.astype(np.int64))


def _next_true(flags: Bools, lo: int, hi: int) -> int:
    """The first index in ``[lo, hi)`` where ``flags`` is true, else ``hi``."""
    window = 256
    while lo < hi:
        e = min(hi, lo + window)
        i = int(flags[lo:e].argmax())
        if flags[lo + i]:
            return lo + i
        lo, window = e, window * 4
    return hi


def _walk(target: Sequence[int] | Ints, donor: Sequence[int] | Ints, start: int, end: int,
          hits: Sequence[int | None] | Ints, resume_with: int | None, k: int,
          ) -> tuple[Ints, Bools]:
    """The map walk over ``[start, end)``; ``hits[p - start]``: the donor position of the anchor
    at target position p (None or negative: none). Off the donor's end without an anchor the
    walk stops (``resume_with`` None, ``map_tokens``: the arrays end there) or emits
    ``resume_with`` until the next anchor. An anchor is taken only where the target's tokens
    differ from the diagonal's (or the diagonal left the donor), and only when its ``k`` tokens
    are the target's (a key collision is dropped where it is met, and the walk goes on as if it
    had never been there).

    Along a diagonal (consecutive donor positions) it compares windows of positions at a time
    (numpy, growing 4x): only an anchor at a differing token can end the run there. The walk
    records runs (target start, donor start, length); sources and identities are filled from
    them at the end, in one pass.
    """
    t, dn = token_array(target), token_array(donor)
    size = max(0, end - start)
    at = np.array([-1 if h is None else h for h in hits] if not isinstance(hits, np.ndarray)
                  else hits, dtype=np.int64)[:size]
    if len(at) < size:
        at = np.concatenate([at, np.full(size - len(at), -1, np.int64)])
    has = at >= 0
    runs: list[tuple[int, int, int]] = []  # (target position, donor position, length)
    last = len(dn) - 1
    p, q, on = start, min(start, last), last >= 0
    stopped = end
    while p < end:
        if on and q <= last:
            d = q - p
            stop, window, begin = min(end, last + 1 - d), 256, p
            while p < stop:
                e = min(stop, p + window)
                jumps = np.not_equal(t[p:e], dn[p + d: e + d])
                jumps &= has[p - start: e - start]  # an anchor where the tokens differ
                i = int(jumps.argmax())
                if jumps[i]:
                    p += i
                    break
                p, window = e, window * 4
            if p > begin:
                _add_run(runs, begin, begin + d, p - begin)
            q = p + d
            if p == stop:
                continue  # the end, or the donor's end: the next position decides
        jump = int(at[p - start])
        if jump >= 0 and dn[jump: jump + k].tolist() != t[p: p + k].tolist():
            at[p - start], has[p - start] = -1, False  # a key collision, not an anchor
            continue
        if jump >= 0:
            _add_run(runs, p, jump, 1)
            p, q, on = p + 1, jump + 1, True
            continue
        if resume_with is None:
            stopped = p  # ran off the donor: no KV to serve from here on
            break
        p, on = _next_true(has, p - start, size) + start, False
    n = stopped - start
    sources = np.full(n, -1 if resume_with is None else resume_with, np.int64)
    same = np.zeros(n, np.bool_)
    if len(runs) <= _FEW_RUNS:  # slices beat index arrays for a few long runs
        for a, b, m in runs:
            sources[a - start: a - start + m] = np.arange(b, b + m)
            np.equal(t[a: a + m], dn[b: b + m], out=same[a - start: a - start + m])
    else:
        tp, dp, ln = (np.array(c, dtype=np.int64) for c in zip(*runs, strict=True))
        offsets = np.arange(int(ln.sum())) - np.repeat(np.cumsum(ln) - ln, ln)
        where = np.repeat(tp - start, ln) + offsets
        sources[where] = np.repeat(dp, ln) + offsets
        same[where] = t[where + start] == dn[sources[where]]
    return sources, same


_FEW_RUNS = 16  # _walk fills at most this many runs by slices, more by index arrays


def _add_run(runs: list[tuple[int, int, int]], tp: int, dp: int, length: int) -> None:
    """Append a run, or extend the last one when this one continues it on its diagonal."""
    if runs:
        lt, ld, ll = runs[-1]
        if lt + ll == tp and ld + ll == dp:
            runs[-1] = (lt, ld, ll + length)
            return
    runs.append((tp, dp, length))


# Every 16th target k-gram is sampled: a shared run of ANCHOR_STRIDE + k - 1 tokens or more (23
# by default) always holds one, wherever it lies (TargetGrams.sampled_held).
ANCHOR_STRIDE = 16


@dataclass(frozen=True)
class TargetGrams:
    """A target's k-gram keys from position 0 (``gram_keys``) and every ``ANCHOR_STRIDE``-th of
    them (``sampled``), each with their sketch slots: computed once per target, read against every
    candidate donor's index (its sketch skips most keys, the rest are searched)."""

    keys: Ints
    slots: SketchSlots
    sampled: Ints
    sampled_slots: SketchSlots

    @classmethod
    def of(cls, target: Sequence[int] | Ints, k: int) -> TargetGrams:
        keys = gram_keys(target, 0, len(target), k)
        sampled = keys[::ANCHOR_STRIDE]
        return cls(keys, SketchSlots.of(keys), sampled, SketchSlots.of(sampled))

    def sampled_held(self, anchors: AnchorIndex) -> Bools:
        """Per sampled key (``sampled``): does the donor's index hold it? A donor that holds
        none shares no run of ``ANCHOR_STRIDE + k - 1`` tokens or more with the target; planning
        walks a donor only for a sampled key no donor walked before it holds
        (``semkv.span_plan._brings_new_anchor``)."""
        held: Bools = anchors.find(self.sampled, self.sampled_slots) >= 0
        return held

    def hits(self, anchors: AnchorIndex, n: int) -> Ints:
        """Per target position in ``[0, n)``: the donor position of its anchor, or -1."""
        found = anchors.find(self.keys, self.slots)[:n]
        return np.concatenate([found, np.full(n - len(found), -1, np.int64)]) \
            if len(found) < n else found


def walk_donor(target: Sequence[int] | Ints, donor: Sequence[int] | Ints, start: int, end: int,
               k: int, grams: Ints | TargetGrams, resume_with: int | None = None,
               anchors: AnchorIndex | None = None) -> tuple[Ints, Bools]:
    """``map_tokens`` with the target's k-gram keys from ``start`` given (``gram_keys``, or
    ``TargetGrams`` from 0: built once for every donor of a target), optionally resumed past
    the donor's end (``resume_with``), with the donor's ``anchor_index`` when the caller
    already holds it."""
    if anchors is None:
        anchors = anchor_index(donor, k)
    hits = (grams.hits(anchors, end)[start:] if isinstance(grams, TargetGrams)
            else anchors.lookup(grams[: end - start]))
    return _walk(target, donor, start, end, hits, resume_with, k)


def map_tokens(
    target: Sequence[int],
    donor: Sequence[int],
    start: int,
    end: int,
    *,
    anchor_tokens: int = DEFAULT_ANCHOR_TOKENS,
) -> tuple[list[int], list[bool]]:
    """Per target position in ``[start, end)``: the donor position and whether tokens match."""
    if not len(donor) or end <= start:
        return [], []
    k = max(1, anchor_tokens)
    t = token_array(target)
    sources, same = walk_donor(t, donor, start, end, k, gram_keys(t, start, end, k))
    return sources.tolist(), same.tolist()


def _segments(start: int, sources: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    segs: list[tuple[int, int, int]] = []
    for i, q in enumerate(sources):
        p = start + i
        if segs and segs[-1][1] + segs[-1][2] == q and segs[-1][0] + segs[-1][2] == p:
            segs[-1] = (segs[-1][0], segs[-1][1], segs[-1][2] + 1)
        else:
            segs.append((p, q, 1))
    return tuple(segs)


def map_span(
    target: Sequence[int],
    donor: Sequence[int],
    start: int,
    block_size: int,
    *,
    max_tokens: int,
    min_agreement: float = 0.0,
    anchor_tokens: int = DEFAULT_ANCHOR_TOKENS,
) -> SpanMap | None:
    """The longest whole-block span from ``start`` whose agreement is >= ``min_agreement``.

    ``donor`` must hold only the donor tokens whose KV can be served. None when no whole block
    qualifies.
    """
    if block_size <= 0 or start < 0 or start % block_size:
        raise ValueError("start must be a non-negative multiple of a positive block_size")
    limit = min(max_tokens, len(target) - start)
    limit -= limit % block_size
    if limit <= 0 or not donor:
        return None
    sources, same = map_tokens(target, donor, start, start + limit, anchor_tokens=anchor_tokens)
    best, diffs, best_diffs, block_diffs = 0, 0, 0, 0
    for i, ok in enumerate(same, start=1):
        diffs += not ok
        block_diffs += not ok
        if i % block_size:
            continue
        # The span may end here when it agrees enough overall AND its last block does too:
        # a differing tail (typically the question) is left to compute.
        if (1.0 - diffs / i >= min_agreement
                and 1.0 - block_diffs / block_size >= min_agreement):
            best, best_diffs = i, diffs
        block_diffs = 0
    if best == 0:
        return None
    return SpanMap(start, best, _segments(start, sources[:best]), best_diffs)
