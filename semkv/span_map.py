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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import eq as eq_
from operator import gt, is_not

from semkv.anchor_cache import ANCHOR_CACHE
from semkv.types import QualityTier

DEFAULT_ANCHOR_TOKENS = 8


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


def kgrams(tokens: Sequence[int], start: int, end: int, k: int) -> list[tuple[int, ...]]:
    """The k-grams of ``tokens`` that start at ``[start, end)`` and fit (built in C, by zip)."""
    m = min(end, len(tokens) - k + 1) - start
    if m <= 0:
        return []
    return list(zip(*(tokens[start + j: start + j + m] for j in range(k)), strict=True))


def gram_keys(tokens: Sequence[int], start: int, end: int, k: int) -> list[int]:
    """``kgrams`` as ints (each k-gram's hash): looked up 16 times per target, an int key is
    hashed for free where a tuple is hashed again on every lookup (most of planning's time)."""
    return list(map(hash, kgrams(tokens, start, end, k)))


def anchor_index(donor: Sequence[int], k: int) -> dict[int, int]:
    """First donor position of every k-gram key (cached by the donor's exact tokens: a donor's
    index is built once, not once per request; see ``semkv.anchor_cache``)."""
    return ANCHOR_CACHE.get(donor, k, build_anchor_index)


def build_anchor_index(donor: Sequence[int], k: int) -> dict[int, int]:
    """First donor position of every k-gram key (first occurrence wins: stable, left-most).

    NOTE: keyed by the k-gram's hash, so an anchor is checked token by token where the walk
    uses it (``_walk``): a hash collision is never a false anchor. Two different k-grams of
    one donor with the same 64-bit hash would lose the later one's anchor (odds ~1e-12 per
    4K donor): a shorter copy at worst, never a wrong one."""
    keys = gram_keys(donor, 0, len(donor), k)
    # Built from the end: a later (smaller) position overwrites, so each gram keeps its first.
    return dict(zip(reversed(keys), range(len(keys) - 1, -1, -1), strict=True))


_FIRST_WINDOW, _LAST_WINDOW = 32, 1024  # positions compared per step along a run (doubling)


def _walk(target: list[int], donor: Sequence[int], start: int, end: int,
          hits: list[int | None], resume_with: int | None, k: int,
          ) -> tuple[list[int], list[bool]]:
    """The map walk over ``[start, end)``; ``hits[p - start]``: the donor position of the anchor
    at target position p (None: none). Off the donor's end without an anchor the walk stops
    (``resume_with`` None, ``map_tokens``) or emits ``resume_with`` until the next anchor.
    An anchor is taken only when its ``k`` tokens are the target's (a key collision is
    dropped where it is met, and the walk goes on as if it had never been there).

    Along a diagonal (consecutive donor positions) it compares a window of positions at a time
    with C-level ``map``: only an anchor at a differing token can end the run there.
    """
    last = len(donor) - 1
    has = list(map(is_not, hits, repeat(None)))
    sources: list[int] = []
    same: list[bool] = []
    p, nxt, on = start, min(start, last), last >= 0
    while p < end:
        if on and nxt <= last:
            d = nxt - p  # the diagonal: donor position - target position
            stop, w = min(end, last + 1 - d), _FIRST_WINDOW
            while p < stop:
                e = min(stop, p + w)
                eq = list(map(eq_, target[p:e], donor[p + d: e + d]))
                jumps = list(map(gt, has[p - start: e - start], eq))  # an anchor, tokens differ
                i = jumps.index(True) if True in jumps else e - p
                sources.extend(range(p + d, p + d + i))
                same.extend(eq[:i])
                p += i
                if p < e:
                    break
                w = min(2 * w, _LAST_WINDOW)
            nxt = p + d
            if p == stop:
                continue  # the end, or the donor's end: the next position decides
        jump = hits[p - start]  # a differing token, past the donor's end, or off the donor
        if jump is not None and tuple(donor[jump:jump + k]) != tuple(target[p:p + k]):
            hits[p - start], has[p - start] = None, False  # a key collision, not an anchor
            continue
        if jump is not None:
            sources.append(jump)
            same.append(donor[jump] == target[p])
            p, nxt, on = p + 1, jump + 1, True
            continue
        if resume_with is None:
            break  # ran off the donor: no KV to serve from here on
        try:
            j = has.index(True, p - start) + start
        except ValueError:
            j = end
        sources.extend([resume_with] * (j - p))
        same.extend([False] * (j - p))
        p, on = j, False
    return sources, same


ANCHOR_STRIDE = 16  # shares_anchor: every 16th target k-gram is looked up


def shares_anchor(anchors: Mapping[int, int], grams: list[int]) -> bool:
    """Does a donor's ``anchor_index`` hold one of the target's k-grams at a sampled position
    (every ``ANCHOR_STRIDE``-th of ``grams``, the target's ``gram_keys``)?

    A shared run of ``ANCHOR_STRIDE + k - 1`` tokens or more (23 by default) always holds one,
    wherever it lies; a donor that shares none is not worth mapping for identical-token plans
    (at most a few short runs), and most of 16 candidates share none: skipping their look-ups
    and walks is most of planning's time (issue #25)."""
    return any(map(anchors.__contains__, grams[::ANCHOR_STRIDE]))


def walk_donor(target: list[int], donor: Sequence[int], start: int, end: int, k: int,
               grams: list[int], resume_with: int | None = None,
               anchors: Mapping[int, int] | None = None) -> tuple[list[int], list[bool]]:
    """``map_tokens`` with the target's k-gram keys from ``start`` given (``gram_keys``: built
    once for every donor of a target), optionally resumed past the donor's end
    (``resume_with``), with the donor's ``anchor_index`` when the caller already holds it."""
    if anchors is None:
        anchors = anchor_index(donor, k)
    hits = list(map(anchors.get, grams[: end - start]))
    hits.extend([None] * (end - start - len(hits)))  # grams that would run past the target
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
    if not donor or end <= start:
        return [], []
    k = max(1, anchor_tokens)
    ids = target if isinstance(target, list) else list(target)
    return walk_donor(ids, donor, start, end, k, gram_keys(ids, start, end, k))


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
