"""Token-level verification of a donor candidate, whatever provider proposed it.

Protocol: admission calls ``verify(target_ids, donor_ids, block_size, candidate)`` with the
target's and the donor's token ids (which never leave the scheduler) and gets back a frozen
``Verification`` holding counts, offsets and scores only. It answers three questions:

1. *Exact prefix*: how many leading tokens donor and target share, rounded down to whole
   blocks. Only this span has KV that is exact for the target (same tokens, same positions,
   same preceding context).
2. *Longest identical run*: the longest run of whole blocks that is token-identical in both
   at block-aligned offsets (``run_target_start``, ``run_donor_start``, ``run_tokens``). When it
   is not the prefix, its tokens match but its context differs: the "verified" tier.
3. *The judged span*: the candidate's own span (clipped to both sequences), or, when the
   candidate names none, the longest identical run (else the block-aligned paired span from
   position 0). For it: ``token_differences``, a ``similarity`` in [0, 1] (rapidfuzz LCS over
   the paired tokens), bag-of-token signals (``jaccard``, ``token_f1``) and a suggested tier:
   exact (identical from position 0 in both), verified (identical elsewhere), semantic (any
   token differs, or nothing to reuse).

Block alignment of the judged span is reported (``block_aligned``), not enforced here: the
admission gates decide. rapidfuzz is imported on first use only, so importing semkv stays cheap.

NOTE: a Verification never carries token ids; it is safe to log and to put in metrics.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import groupby
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from semkv.types import Candidate, QualityTier

# Paired spans up to this length get an exact LCS; longer ones are sampled in windows, which
# bounds the cost (rapidfuzz's LCS is ~15 ms for two unrelated 8K-token sequences).
EXACT_SIMILARITY_TOKENS = 1024
WINDOW_TOKENS = 256
MAX_WINDOWS = 16
WINDOW_MARGIN = 64  # donor-side slack per window: tolerates local shifts (insertions, edits)
MAX_POSTINGS = 8  # positions indexed per repeated donor block (bounds degenerate, repetitive input)
BAG_WINDOWS, BAG_WINDOW_TOKENS = 4, 1024  # bag signals of longer spans are sampled


class Verification(BaseModel):
    """What the verifier found for one (target, donor) pair. Counts and scores only."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    donor_id: str | None = None
    block_size: int = Field(ge=1)
    target_tokens: int = Field(ge=0)
    donor_tokens: int = Field(ge=0)
    common_prefix_tokens: int = Field(ge=0, description="identical leading tokens, unrounded")
    exact_prefix_tokens: int = Field(ge=0, description="common prefix in whole blocks")
    run_target_start: int = Field(ge=0)
    run_donor_start: int = Field(ge=0)
    run_tokens: int = Field(ge=0, description="longest identical block-aligned run")
    target_start: int = Field(ge=0)
    donor_start: int = Field(ge=0)
    num_tokens: int = Field(ge=0)
    span_source: Literal["candidate", "verifier"]
    clipped: bool = False  # the candidate's span reached past one of the sequences
    block_aligned: bool
    token_differences: int = Field(ge=0)
    similarity: float = Field(ge=0.0, le=1.0)
    jaccard: float = Field(ge=0.0, le=1.0)
    token_f1: float = Field(ge=0.0, le=1.0)
    tier: QualityTier

    @property
    def identical(self) -> bool:
        return self.num_tokens > 0 and self.token_differences == 0

    def signals(self) -> dict[str, float]:
        """Numeric signals, e.g. for ``Candidate.signals`` or metrics."""
        return {
            "verify_similarity": self.similarity,
            "verify_jaccard": self.jaccard,
            "verify_token_f1": self.token_f1,
            "verify_exact_prefix_tokens": float(self.exact_prefix_tokens),
            "verify_run_tokens": float(self.run_tokens),
            "verify_token_differences": float(self.token_differences),
        }


def common_prefix(target: list[int], donor: list[int]) -> int:
    """Number of identical leading tokens (C-level slice compares, binary search)."""
    limit = min(len(target), len(donor))
    if target[:limit] == donor[:limit]:
        return limit
    lo, hi = 0, limit  # invariant: target[:lo] == donor[:lo] and target[:hi] != donor[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if target[lo:mid] == donor[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _blocks(seq: list[int], block_size: int) -> list[tuple[int, ...]]:
    return list(zip(*[iter(seq)] * block_size, strict=False))  # whole blocks; tail dropped


def longest_aligned_run(
    target: list[int], donor: list[int], block_size: int
) -> tuple[int, int, int]:
    """``(target_start, donor_start, num_tokens)`` of the longest identical block-aligned run.

    Ties prefer the run anchored at (0, 0), then the earliest target start. Blocks are keyed by
    their token tuples, so a hit is an exact match, never a hash collision.
    """
    tblocks, dblocks = _blocks(target, block_size), _blocks(donor, block_size)
    # Later assignments win in dict(): feeding the blocks backwards keeps each first position.
    first = dict(zip(reversed(dblocks), range(len(dblocks) - 1, -1, -1), strict=True))
    if len(first) < len(dblocks):
        blocks, ti, dj = _run_with_repeats(tblocks, dblocks)
    else:
        # Every donor block is unique: a run is a stretch of target blocks on one diagonal.
        hits = map(first.get, tblocks)
        diagonals = [None if j is None else j - i for i, j in enumerate(hits)]
        blocks = ti = dj = pos = 0
        for diagonal, group in groupby(diagonals):
            length = sum(1 for _ in group)
            if diagonal is not None and length > blocks:  # strict: (0, 0) comes first anyway
                blocks, ti, dj = length, pos, pos + diagonal
            pos += length
    return ti * block_size, dj * block_size, blocks * block_size


def _run_with_repeats(
    tblocks: list[tuple[int, ...]], dblocks: list[tuple[int, ...]]
) -> tuple[int, int, int]:
    """The general case (a donor block occurs more than once): dynamic programming."""
    postings: dict[tuple[int, ...], list[int]] = {}
    for j, block in enumerate(dblocks):
        slot = postings.setdefault(block, [])
        if len(slot) < MAX_POSTINGS:
            slot.append(j)
    best = (0, 0, 0)  # (blocks, target block, donor block)
    prev: dict[int, int] = {}  # donor block -> run length ending at the previous target block
    for i, block in enumerate(tblocks):
        cur: dict[int, int] = {}
        for j in postings.get(block, ()):
            run = cur[j] = prev.get(j - 1, 0) + 1
            anchored = run == i + 1 and j == i
            if run > best[0] or (run == best[0] and anchored):
                best = (run, i - run + 1, j - run + 1)
        prev = cur
    return best


def _window_starts(n: int, width: int, most: int) -> list[int]:
    """Evenly spread starts of at most ``most`` windows of ``width`` over ``n`` tokens."""
    count = min(most, -(-n // width))
    step = (n - width) / max(1, count - 1)
    return [round(k * step) for k in range(count)]


def _paired_similarity(a: list[int], b: list[int]) -> float:
    """LCS(a, b) / len(a) for equal-length paired spans; windowed beyond a size limit."""
    from rapidfuzz.distance import LCSseq

    n = len(a)
    if n == 0:
        return 0.0
    if a == b:
        return 1.0
    if n <= EXACT_SIMILARITY_TOKENS:
        return LCSseq.normalized_similarity(a, b)  # equal lengths: LCS / n
    starts = _window_starts(n, WINDOW_TOKENS, MAX_WINDOWS)
    matched = 0
    for start in starts:
        window = a[start : start + WINDOW_TOKENS]
        wide = b[max(0, start - WINDOW_MARGIN) : start + WINDOW_TOKENS + WINDOW_MARGIN]
        matched += LCSseq.similarity(window, wide)
    return min(1.0, matched / (len(starts) * WINDOW_TOKENS))


def _bag_signals(a: list[int], b: list[int]) -> tuple[float, float]:
    """(Jaccard, F1) of the two token sets: order-free overlap, robust to reordering.

    Spans longer than BAG_WINDOWS * BAG_WINDOW_TOKENS are sampled at the same long windows on
    both sides: set building dominates the cost (about 0.5 ms per 8K distinct ids), so it stays
    bounded, and long windows keep the bias of a shifted span small (shift / window width).
    """
    if not a or not b:
        return 0.0, 0.0
    sa: set[int] = set()
    sb: set[int] = set()
    if len(a) > BAG_WINDOWS * BAG_WINDOW_TOKENS:
        for start in _window_starts(len(a), BAG_WINDOW_TOKENS, BAG_WINDOWS):
            sa.update(a[start : start + BAG_WINDOW_TOKENS])
            sb.update(b[start : start + BAG_WINDOW_TOKENS])
    else:
        sa.update(a)
        sb.update(b)
    inter = len(sa) - len(sa - sb)  # set difference is cheaper than intersection here
    return inter / (len(sa) + len(sb) - inter), 2 * inter / (len(sa) + len(sb))


def _judged_span(
    target: list[int],
    donor: list[int],
    block_size: int,
    candidate: Candidate | None,
    run: tuple[int, int, int],
) -> tuple[int, int, int, bool, Literal["candidate", "verifier"]]:
    if candidate is not None and candidate.num_tokens > 0:
        ts = min(candidate.target_start, len(target))
        ds = min(candidate.donor_start, len(donor))
        n = min(candidate.num_tokens, len(target) - ts, len(donor) - ds)
        return ts, ds, n, n != candidate.num_tokens, "candidate"
    if run[2] > 0:
        return run[0], run[1], run[2], False, "verifier"
    paired = min(len(target), len(donor))
    return 0, 0, paired - paired % block_size, False, "verifier"


def verify(
    target_ids: Sequence[int],
    donor_ids: Sequence[int],
    block_size: int,
    candidate: Candidate | None = None,
) -> Verification:
    """Verify ``candidate`` (or, without one, the best span) of a donor against a target."""
    if block_size < 1:
        raise ValueError("block_size must be positive")
    # One sequence type for both: slices of a tuple never compare equal to slices of a list.
    target, donor = list(target_ids), list(donor_ids)
    common = common_prefix(target, donor)
    exact_prefix = common - common % block_size
    run = longest_aligned_run(target, donor, block_size)
    if exact_prefix >= run[2]:  # the prefix is an aligned run too (capped postings can miss it)
        run = (0, 0, exact_prefix)
    ts, ds, n, clipped, source = _judged_span(target, donor, block_size, candidate, run)
    a, b = target[ts : ts + n], donor[ds : ds + n]
    differences = 0 if a == b else sum(map(operator.ne, a, b))
    if n == 0 or differences:
        tier = QualityTier.SEMANTIC
    elif ts == 0 and ds == 0:
        tier = QualityTier.EXACT
    else:
        tier = QualityTier.VERIFIED
    jaccard, f1 = _bag_signals(a, b)
    return Verification(
        donor_id=candidate.donor_id if candidate is not None else None,
        block_size=block_size,
        target_tokens=len(target),
        donor_tokens=len(donor),
        common_prefix_tokens=common,
        exact_prefix_tokens=exact_prefix,
        run_target_start=run[0],
        run_donor_start=run[1],
        run_tokens=run[2],
        target_start=ts,
        donor_start=ds,
        num_tokens=n,
        span_source=source,
        clipped=clipped,
        block_aligned=not (ts % block_size or ds % block_size or n % block_size),
        token_differences=differences,
        similarity=_paired_similarity(a, b),
        jaccard=jaccard,
        token_f1=f1,
        tier=tier,
    )


__all__ = ["Verification", "common_prefix", "longest_aligned_run", "verify"]
