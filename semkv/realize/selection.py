"""The vocabulary of selective recompute: strategies, the positions they touch, ranking, and
the layered execution (``layer_calls``). ``semkv.realize.recompute`` (the protocol, blend)
and ``semkv.realize.query`` (query-aware selection) both build on it; it imports neither.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from enum import Enum
from itertools import chain

import numpy as np
import torch

from semkv.realize.cache import KVCache
from semkv.realize.runner import LayerRunner

DEFAULT_PROBE_LAYERS = 2  # layer 0 cannot tell (its KV is context-free); layer 1 first can
DEFAULT_FIRST_K = 16
DEFAULT_FRACTION = 0.15
DEFAULT_QUERY_TOKENS = 64  # query: the tail's last tokens whose attention ranks the copies
Passes = list[tuple[range, list[int]]]  # (layers, positions computed in them)
Runs = Sequence[tuple[int, int]]  # copied runs: (target_start, length)


class RecomputeKind(str, Enum):
    NONE = "none"
    FIRST_K = "first_k"
    BLEND = "blend"
    FIRST_K_BLEND = "first_k_blend"
    QUERY = "query"
    FIRST_K_QUERY = "first_k_query"
    QUERY_VALUED = "query_valued"

    @property
    def probes(self) -> bool:
        """Layer probe: the first ``probe_layers`` layers computed for every position."""
        return self in (RecomputeKind.BLEND, RecomputeKind.FIRST_K_BLEND)

    @property
    def queries(self) -> bool:
        """Query probe: the prompt's tail run over the assembled KV (``semkv.realize.query``)."""
        return self in (RecomputeKind.QUERY, RecomputeKind.FIRST_K_QUERY,
                        RecomputeKind.QUERY_VALUED)

    @property
    def weighs(self) -> bool:
        """Query's attention weighted by each copied token's value error in the first
        ``probe_layers`` layers, computed for every position first (``semkv.realize.query``)."""
        return self is RecomputeKind.QUERY_VALUED

    @property
    def selects(self) -> bool:
        """Ranks copied tokens and recomputes a ``fraction`` of the prompt's worth of them."""
        return self.probes or self.queries

    @property
    def forces_first_k(self) -> bool:
        return self in (RecomputeKind.FIRST_K, RecomputeKind.FIRST_K_BLEND,
                        RecomputeKind.FIRST_K_QUERY)


@dataclass(frozen=True)
class RecomputeStrategy:
    """Which copied positions are recomputed (plain data: it crosses to the engine's worker)."""

    kind: RecomputeKind = RecomputeKind.NONE
    fraction: float = DEFAULT_FRACTION  # blend: of the prompt's tokens (module docstring)
    first_k: int = DEFAULT_FIRST_K
    probe_layers: int = DEFAULT_PROBE_LAYERS
    query_tokens: int = DEFAULT_QUERY_TOKENS

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", RecomputeKind(self.kind))
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError("fraction must lie in [0, 1]")
        if self.kind.forces_first_k and self.first_k < 1:
            raise ValueError("first_k needs k >= 1")
        if self.probe_layers < 1:
            raise ValueError("probe_layers must be >= 1")
        if self.query_tokens < 1:
            raise ValueError("query_tokens must be >= 1")

    @property
    def held_probe_layers(self) -> int:
        """Layers whose reused K/V a probe keeps while it runs (the memory admission's
        ``probe_layers``): blend's and ``query_valued``'s, 0 for the others."""
        return self.probe_layers if self.kind.probes or self.kind.weighs else 0


def covers(strategy: RecomputeStrategy, required: RecomputeStrategy) -> bool:
    """Does ``strategy`` recompute at least what ``required`` does, on any plan? True for
    ``required`` of kind none, for a ranking strategy at fraction 1.0 (every copied token), and
    for the same kind whose every setting that kind reads is at least ``required``'s; False
    otherwise (two different rankings are not comparable)."""
    if required.kind is RecomputeKind.NONE:
        return True
    if strategy.kind.selects and strategy.fraction >= 1.0:
        return True
    if strategy.kind is not required.kind:
        return False
    kind = strategy.kind
    return ((not kind.selects or strategy.fraction >= required.fraction)
            and (not kind.forces_first_k or strategy.first_k >= required.first_k)
            and (not (kind.probes or kind.weighs) or strategy.probe_layers >= required.probe_layers)
            and (not kind.queries or strategy.query_tokens >= required.query_tokens))


@dataclass
class Recomputed:
    hidden: torch.Tensor | None  # [1, T, hidden]: the final pass's positions; None: nothing run
    passes: Passes
    recomputed: list[int]  # copied positions computed through every layer, increasing


def copied_positions(runs: Runs) -> list[int]:
    return list(chain.from_iterable(range(start, start + length) for start, length in runs))


def first_k_positions(runs: Runs, k: int) -> list[int]:
    """The first ``k`` positions of every copied run."""
    return list(chain.from_iterable(range(start, start + min(k, length))
                                    for start, length in runs))


def uncovered_positions(positions: range, runs: Runs, keep_first: int = 0) -> list[int]:
    """The positions of ``positions`` (step 1) that no run copies, plus the first
    ``keep_first`` positions of every run that lie in it; increasing.

    NOTE: a mask over the range, not a set test per position: the scheduler prices every plan
    of up to 4K positions with it (``needed_positions``, the cost gate), in a few microseconds."""
    lo, n = positions.start, len(positions)
    keep = np.ones(n, np.bool_)
    for start, length in runs:
        keep[min(n, max(0, start - lo)): min(n, max(0, start + length - lo))] = False
    if keep_first:
        for start, length in runs:
            keep[min(n, max(0, start - lo)): min(n, max(0, start + min(keep_first, length) - lo))] \
                = True
    out: list[int] = (np.flatnonzero(keep) + lo).tolist()
    return out


def tail_positions(runs: Runs, prompt_tokens: int) -> range:
    """The prompt's positions after its last copied token (the question, in RAG): the query
    probe runs them over the assembled KV (``semkv.realize.query``)."""
    last = max((start + length for start, length in runs if length), default=0)
    return range(last, prompt_tokens)


def cache_tokens(positions: range, runs: Runs, strategy: RecomputeStrategy,
                 prompt_tokens: int) -> int:
    """The realization cache's capacity: the realized range, and with the query probe the
    prompt's tail after it (written there only: the engine writes back ``positions``)."""
    if strategy.kind.queries and len(positions):
        return max(positions.stop, prompt_tokens)
    return positions.stop


def needed_positions(positions: range, runs: Runs, strategy: RecomputeStrategy,
                     prompt_tokens: int = 0) -> list[int]:
    """The positions ``recompute`` may compute: the token ids the caller must supply (with
    the query probe, the prompt's tail after ``positions`` too: ``prompt_tokens`` long)."""
    if strategy.kind.queries and len(positions):
        return list(positions) + list(range(positions.stop, max(positions.stop, prompt_tokens)))
    if strategy.kind.probes:
        return list(positions)
    return uncovered_positions(positions, runs,
                               strategy.first_k if strategy.kind.forces_first_k else 0)


def budget(strategy: RecomputeStrategy, prompt_tokens: int, copied: int) -> int:
    """Blend and query: how many copied tokens are recomputed (first_k_blend, first_k_query:
    at least their forced halo positions, which count against it)."""
    return min(copied, round(strategy.fraction * prompt_tokens))


def deviation(cache: KVCache, old_k: Sequence[torch.Tensor], old_v: Sequence[torch.Tensor],
              lo: int, hi: int, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
              ) -> torch.Tensor:
    """Per position of ``[lo, hi)``: the relative squared deviation of reused from fresh KV.

    ``reduce`` sums the parts over tensor-parallel ranks (each holds some heads) before the
    ratio is taken, so that every rank ranks the same way.
    """
    score = torch.zeros(hi - lo, dtype=torch.float32)
    for layer in range(len(old_k)):
        fk, fv = cache.keys[layer][0, :, lo:hi], cache.values[layer][0, :, lo:hi]
        diff = ((fk - old_k[layer]) ** 2).sum(dim=(0, 2)) + ((fv - old_v[layer]) ** 2).sum(
            dim=(0, 2))
        norm = (fk ** 2).sum(dim=(0, 2)) + (fv ** 2).sum(dim=(0, 2))
        if reduce is not None:
            diff, norm = reduce(torch.stack([diff, norm]))
        score += (diff / norm.clamp_min(1e-12)).to(torch.float32).cpu()
    return score


def rank(score: torch.Tensor, lo: int, candidates: Sequence[int], take: int) -> list[int]:
    """The ``take`` candidates of highest score (ties: the earlier position), increasing."""
    values = score.tolist()
    ranked = sorted(candidates, key=lambda p: (-values[p - lo], p))
    return sorted(ranked[:take])


def layer_calls(runner: LayerRunner, cache: KVCache, hidden: torch.Tensor, at: torch.Tensor,
                layers: range, max_tokens: int | None = None,
                attention: torch.Tensor | None = None,
                ) -> Generator[int, None, torch.Tensor]:
    """``run_layers`` over ``layers``, one layer and at most ``max_tokens`` of the increasing
    positions ``at`` per call (one call per step); returns the last layer's hidden states.
    ``attention``: ``run_layers``' accumulator of the queries' attention (``runner.py``)."""
    n = int(at.numel())
    step = n if max_tokens is None else max(1, min(max_tokens, n))
    extra = {} if attention is None else {"attention": attention}
    for layer in layers:
        out = []
        for lo in range(0, n, step):
            with torch.no_grad():
                out.append(runner.run_layers(cache, hidden[:, lo:lo + step], at[lo:lo + step],
                                             range(layer, layer + 1), **extra))
            yield min(step, n - lo)
        hidden = out[0] if len(out) == 1 else torch.cat(out, dim=1)
        del out
    return hidden
