"""Recompute strategies: which prompt tokens to compute fresh on top of the assembled cache.

Protocol: ``prefill(lm, target, plan, store, strategy)`` assembles the target's cache from the
plan (reused positions, re-rotated) and computes, through ``lm.run_layers`` (any
``semkv.realize.LayerRunner``: research's ``LayerwiseModel`` or the engine's layer runner), every
position the plan does not reuse (always including the last prompt token) plus what the
strategy adds:

- ``none``: nothing more; every reused token keeps its donor KV in every layer.
- ``first_k``: the first k tokens of every reused segment (EPIC-like: a chunk's first tokens
  absorb most of the attention that its missing preceding context would have drawn).
- ``blend``: CacheBlend-like. The first ``probe_layers`` layers are computed for every token
  (fresh KV there, for all); the deviation of those fresh keys and values from the reused ones
  ranks the reused tokens, and the top ``ratio`` (a fraction of all prompt tokens) is computed
  through the remaining layers, continuing from its probe-layer hidden states. Layer 0 alone
  cannot tell (an identical token's layer-0 KV is context-free); layer 1 is the first to see
  the missing context, hence two probe layers by default.
- ``first_k_blend``: ``blend`` whose selection always holds the first k tokens of every reused
  segment (a halo after each gap or change of donor), the rest of the budget by deviation.
- ``query`` / ``first_k_query``: the prompt's tail after its last reused token (the question)
  runs over the assembled cache; the reused tokens its last ``query_tokens`` queries attend
  to most are recomputed from layer 0 (ProphetKV-like; ``semkv.realize.query``).
- ``progressive`` (measurement only, research only): per-layer selection as CacheBlend's
  gradual filtering: the copied tokens still selected are re-ranked at every layer by that
  layer's deviation, a shrinking nested set (``_progressive``).
- ``shift`` (measurement only, research only): ``query``, then each copied run's mean K/V
  deviation (measured on its recomputed tokens) added to the copied tokens it left, and the
  question computed again (``semkv.research.shift``).
- ``full``: a full prefill, no reuse: the reference.
- ``oracle`` (measurement only, research only): the reused tokens ranked by their TRUE
  deviation from the cold KV (a full prefill's), summed over every layer, the top ``ratio``
  (the same budget as blend) computed through every layer from layer 0 with the rest. No
  selector can know the cold KV; at each share it shows what the best selection of single
  tokens could reach: a curve far below blend's says the selector is weak, a curve near it
  says the case is hard.

The selection and the layered execution are ``semkv.realize.recompute``'s, the module the
engine's worker realizes spans with (one realization semantics, two runners): ``ratio`` is its
``fraction``, a fraction of the prompt's tokens. ``full`` and ``oracle`` stay here (no reuse
at all; a selection that needs the cold KV).

The result carries the cache (capacity for the generation), the next-token logits and, per
layer range, which positions were computed: the input of the FLOPs estimate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch

from semkv.realize import KVCache, LayerRunner
from semkv.realize.recompute import (
    DEFAULT_PROBE_LAYERS,
    DEFAULT_QUERY_TOKENS,
    RecomputeKind,
    RecomputeStrategy,
    budget,
    copied_positions,
    deviation,
    rank,
    recompute,
)
from semkv.research.assembly import NO_SOURCE, ReusePlan, Segment, assemble
from semkv.research.donors import DonorStore
from semkv.research.shift import shifted_query
from semkv.span_plan import SpanPlan

__all__ = ["DEFAULT_PROBE_LAYERS", "PrefillResult", "Strategy", "StrategyKind", "plan_of_span",
           "prefill", "runs", "shared", "without"]


class StrategyKind(str, Enum):
    NONE = "none"
    FIRST_K = "first_k"
    BLEND = "blend"
    FIRST_K_BLEND = "first_k_blend"
    QUERY = "query"
    FIRST_K_QUERY = "first_k_query"
    FULL = "full"
    ORACLE = "oracle"
    PROGRESSIVE = "progressive"
    SHIFT = "shift"
    QUERY_VALUED = "query_valued"  # named queryv<percent>


@dataclass(frozen=True)
class Strategy:
    kind: StrategyKind
    first_k: int = 0
    ratio: float = 0.0  # blend: recomputed tokens as a fraction of all prompt tokens
    probe_layers: int = DEFAULT_PROBE_LAYERS
    query_tokens: int = DEFAULT_QUERY_TOKENS

    @classmethod
    def none(cls) -> Strategy:
        return cls(StrategyKind.NONE)

    @classmethod
    def first(cls, k: int) -> Strategy:
        if k < 1:
            raise ValueError("first_k needs k >= 1")
        return cls(StrategyKind.FIRST_K, first_k=k)

    @classmethod
    def blend(cls, ratio: float, probe_layers: int = DEFAULT_PROBE_LAYERS) -> Strategy:
        if not 0.0 <= ratio <= 1.0 or probe_layers < 1:
            raise ValueError("blend needs 0 <= ratio <= 1 and probe_layers >= 1")
        return cls(StrategyKind.BLEND, ratio=ratio, probe_layers=probe_layers)

    @classmethod
    def first_k_blend(cls, k: int, ratio: float,
                      probe_layers: int = DEFAULT_PROBE_LAYERS) -> Strategy:
        if k < 1 or not 0.0 <= ratio <= 1.0 or probe_layers < 1:
            raise ValueError("first_k_blend needs k >= 1, 0 <= ratio <= 1, probe_layers >= 1")
        return cls(StrategyKind.FIRST_K_BLEND, first_k=k, ratio=ratio, probe_layers=probe_layers)

    @classmethod
    def query(cls, ratio: float, query_tokens: int = DEFAULT_QUERY_TOKENS) -> Strategy:
        if not 0.0 <= ratio <= 1.0 or query_tokens < 1:
            raise ValueError("query needs 0 <= ratio <= 1 and query_tokens >= 1")
        return cls(StrategyKind.QUERY, ratio=ratio, query_tokens=query_tokens)

    @classmethod
    def first_k_query(cls, k: int, ratio: float,
                      query_tokens: int = DEFAULT_QUERY_TOKENS) -> Strategy:
        if k < 1 or not 0.0 <= ratio <= 1.0 or query_tokens < 1:
            raise ValueError("first_k_query needs k >= 1, 0 <= ratio <= 1, query_tokens >= 1")
        return cls(StrategyKind.FIRST_K_QUERY, first_k=k, ratio=ratio,
                   query_tokens=query_tokens)

    @classmethod
    def full(cls) -> Strategy:
        return cls(StrategyKind.FULL)

    @classmethod
    def oracle(cls, ratio: float) -> Strategy:
        if not 0.0 <= ratio <= 1.0:
            raise ValueError("oracle needs 0 <= ratio <= 1")
        return cls(StrategyKind.ORACLE, ratio=ratio)

    @classmethod
    def progressive(cls, ratio: float, probe_layers: int = DEFAULT_PROBE_LAYERS) -> Strategy:
        if not 0.0 <= ratio <= 1.0 or probe_layers < 1:
            raise ValueError("progressive needs 0 <= ratio <= 1 and probe_layers >= 1")
        return cls(StrategyKind.PROGRESSIVE, ratio=ratio, probe_layers=probe_layers)

    @classmethod
    def shift(cls, ratio: float, query_tokens: int = DEFAULT_QUERY_TOKENS) -> Strategy:
        if not 0.0 <= ratio <= 1.0 or query_tokens < 1:
            raise ValueError("shift needs 0 <= ratio <= 1 and query_tokens >= 1")
        return cls(StrategyKind.SHIFT, ratio=ratio, query_tokens=query_tokens)

    @classmethod
    def queryv(cls, ratio: float, query_tokens: int = DEFAULT_QUERY_TOKENS,
               probe_layers: int = DEFAULT_PROBE_LAYERS) -> Strategy:
        if not 0.0 <= ratio <= 1.0 or query_tokens < 1 or probe_layers < 1:
            raise ValueError("queryv needs 0 <= ratio <= 1, query_tokens >= 1, probe_layers >= 1")
        return cls(StrategyKind.QUERY_VALUED, ratio=ratio, query_tokens=query_tokens,
                   probe_layers=probe_layers)

    @property
    def name(self) -> str:
        if self.kind is StrategyKind.FIRST_K:
            return f"first{self.first_k}"
        if self.kind is StrategyKind.BLEND:
            return f"blend{round(self.ratio * 100)}"
        if self.kind is StrategyKind.FIRST_K_BLEND:
            return f"first{self.first_k}+blend{round(self.ratio * 100)}"
        if self.kind is StrategyKind.QUERY:
            return f"query{round(self.ratio * 100)}"
        if self.kind is StrategyKind.FIRST_K_QUERY:
            return f"first{self.first_k}+query{round(self.ratio * 100)}"
        if self.kind is StrategyKind.ORACLE:
            return f"oracle{round(self.ratio * 100)}"
        if self.kind is StrategyKind.PROGRESSIVE:
            return f"progressive{round(self.ratio * 100)}"
        if self.kind is StrategyKind.SHIFT:
            return f"shift{round(self.ratio * 100)}"
        if self.kind is StrategyKind.QUERY_VALUED:
            return f"queryv{round(self.ratio * 100)}"
        return str(self.kind.value)


@dataclass
class PrefillResult:
    cache: KVCache
    logits: torch.Tensor  # [vocab], fp32: the next-token logits after the prompt
    num_tokens: int
    passes: list[tuple[range, list[int]]] = field(default_factory=list)  # layers, positions

    @property
    def recomputed_tokens(self) -> int:
        """Prompt tokens computed in the last layer: those not served by a donor in the end."""
        last = self._layers - 1
        done = {p for layers, pos in self.passes if last in layers for p in pos}
        return sum(1 for p in done if p < self.num_tokens)

    @property
    def _layers(self) -> int:
        return max((layers.stop for layers, _ in self.passes), default=0)

    @property
    def reused_tokens(self) -> int:
        return self.num_tokens - self.recomputed_tokens

    @property
    def recompute_fraction(self) -> float:
        """Token-layers computed over those of a full prefill (probe layers included)."""
        done = sum(len(layers) * len(pos) for layers, pos in self.passes)
        total = self.num_tokens * self._layers
        return done / total if total else 0.0


def shared(strategy: Strategy) -> RecomputeStrategy:
    """The engine-shared strategy (``semkv.realize.recompute``) for a research strategy."""
    if strategy.kind in (StrategyKind.FULL, StrategyKind.ORACLE, StrategyKind.PROGRESSIVE,
                         StrategyKind.SHIFT):
        raise ValueError(f"{strategy.kind.value} is research's own, not a shared strategy")
    return RecomputeStrategy(RecomputeKind(strategy.kind.value), fraction=strategy.ratio,
                             first_k=max(1, strategy.first_k),
                             probe_layers=strategy.probe_layers,
                             query_tokens=strategy.query_tokens)


def runs(plan: ReusePlan) -> list[tuple[int, int]]:
    """The plan's reused segments as the shared module's copied runs."""
    return [(seg.target_start, seg.length) for seg in plan.segments]


def prefill(
    lm: LayerRunner, target: Sequence[int], plan: ReusePlan, store: DonorStore,
    strategy: Strategy, *, capacity: int | None = None, rotate: bool = True,
) -> PrefillResult:
    """The target's prompt cache and next-token logits under ``strategy``."""
    n = len(target)
    if n == 0 or plan.num_tokens != n:
        raise ValueError("the plan must be for this (non-empty) target")
    if strategy.kind is StrategyKind.FULL:
        cache, logits = lm.full_prefill(target, capacity, all_logits=False)
        return PrefillResult(cache, logits[-1], n, [(range(lm.num_layers), list(range(n)))])
    cache = assemble(plan, store, lm, capacity=capacity, rotate=rotate)
    if strategy.kind is StrategyKind.ORACLE:
        return _oracle(lm, target, plan, cache, strategy, capacity)
    if strategy.kind is StrategyKind.PROGRESSIVE:
        return _progressive(lm, target, plan, cache, strategy)
    if strategy.kind is StrategyKind.SHIFT:
        hidden, passes = shifted_query(lm, target, runs(plan), cache, strategy.ratio,
                                       strategy.query_tokens)
        return PrefillResult(cache, lm.logits(hidden)[-1], n, passes)
    # The selection and layered execution are the engine's own (semkv.realize.recompute): every
    # position is realized here, the plan's segments are the copied runs, n the prompt tokens.
    done = recompute(lm, cache, range(n), runs(plan), dict(enumerate(target)), shared(strategy),
                     n)
    assert done.hidden is not None  # the last prompt token is never reused: always computed
    return PrefillResult(cache, lm.logits(done.hidden[:, -1:])[-1], n, done.passes)


def plan_of_span(span: SpanPlan, num_tokens: int) -> ReusePlan:
    """Research's plan reusing exactly a span plan's copied segments (everything else computed).

    The engine's local prefix is the target's own KV; research computes it, which gives the
    same KV: so research and the engine realize the same prompt under the same copies.
    """
    donor_ids: list[str | None] = [None] * num_tokens
    positions = [NO_SOURCE] * num_tokens
    identical = [False] * num_tokens
    segments = []
    for seg in span.segments:
        if seg.donor_id is None:
            continue
        segments.append(Segment(seg.target_start, seg.donor_id, seg.donor_start, seg.length))
        for i in range(seg.length):
            p = seg.target_start + i
            donor_ids[p], positions[p], identical[p] = seg.donor_id, seg.donor_start + i, True
    return ReusePlan(num_tokens, tuple(donor_ids), tuple(positions), tuple(identical),
                     tuple(segments))


def without(copied: Sequence[tuple[int, int]], chosen: set[int]) -> list[tuple[int, int]]:
    """The copied runs less the ``chosen`` positions (which become gaps: computed fresh)."""
    out: list[tuple[int, int]] = []
    for start, length in copied:
        run_start = None
        for p in range(start, start + length + 1):
            keep = p < start + length and p not in chosen
            if keep and run_start is None:
                run_start = p
            elif not keep and run_start is not None:
                out.append((run_start, p - run_start))
                run_start = None
    return out


def _oracle(lm: LayerRunner, target: Sequence[int], plan: ReusePlan, cache: KVCache,
            strategy: Strategy, capacity: int | None) -> PrefillResult:
    """``oracle``: the copied positions ranked against the cold KV over every layer."""
    n = len(target)
    cold, _ = lm.full_prefill(target, capacity, all_logits=False)
    layers = range(lm.num_layers)
    score = deviation(cold, [cache.keys[i][0, :, :n] for i in layers],
                      [cache.values[i][0, :, :n] for i in layers], 0, n)
    del cold
    copied = runs(plan)
    candidates = copied_positions(copied)
    take = budget(RecomputeStrategy(fraction=strategy.ratio), n, len(candidates))
    chosen = set(rank(score, 0, candidates, take))
    done = recompute(lm, cache, range(n), without(copied, chosen), dict(enumerate(target)),
                     RecomputeStrategy(), n)
    assert done.hidden is not None
    return PrefillResult(cache, lm.logits(done.hidden[:, -1:])[-1], n, done.passes)


def progressive_sizes(budget_tokens: int, copied: int, layers: int) -> list[int]:
    """``progressive``'s copied positions recomputed per layer after the probe: from twice the
    budget down to the budget, linearly (capped at the copied positions); the budget at every
    layer when there is one layer."""
    if layers <= 0:
        return []
    first = min(copied, 2 * budget_tokens)
    if layers == 1:
        return [min(copied, budget_tokens)]
    return [min(copied, round(first + (budget_tokens - first) * i / (layers - 1)))
            for i in range(layers)]


def _progressive(lm: LayerRunner, target: Sequence[int], plan: ReusePlan, cache: KVCache,
                 strategy: Strategy) -> PrefillResult:
    """``progressive`` (measurement only): per-layer selection as CacheBlend's gradual filtering.

    The probe layers run for every position (as ``blend``); the copied positions are ranked by
    the probe's deviation and the top ``progressive_sizes[0]`` continue into the next layer;
    at each later layer the ones still selected are ranked again by that layer's own deviation
    of their reused KV from their fresh KV, and the top ``progressive_sizes[i]`` go on (each
    set inside the last: a token can only continue from a hidden state it has). Gaps run
    through every layer. A copied position that drops out keeps fresh KV in the layers it ran
    and its reused KV above. The budget (``ratio`` of the prompt, as blend's) is what reaches
    the last layer; twice it enters the first: the share to compare is ``recompute_fraction``
    (token-layers). Not a served strategy: measured against the others (docs/frontier.md).
    """
    n = len(target)
    tokens = dict(enumerate(target))
    copied = copied_positions(runs(plan))
    is_copied = set(copied)
    gaps = [p for p in range(n) if p not in is_copied]
    probe = min(strategy.probe_layers, lm.num_layers)
    old_k = [cache.keys[i][0, :, :n].clone() for i in range(probe)]
    old_v = [cache.values[i][0, :, :n].clone() for i in range(probe)]
    with torch.no_grad():
        hidden = lm.run_layers(cache, lm.embed([tokens[p] for p in range(n)]),
                               torch.arange(n), range(probe))
    passes: list[tuple[range, list[int]]] = [(range(probe), list(range(n)))]
    score = deviation(cache, old_k, old_v, 0, n)
    del old_k, old_v
    take = budget(RecomputeStrategy(fraction=strategy.ratio), n, len(copied))
    sizes = progressive_sizes(take, len(copied), lm.num_layers - probe)
    kept = rank(score, 0, copied, sizes[0]) if sizes else []
    at = sorted(set(gaps) | set(kept))
    hidden = hidden[:, at]
    for i, layer in enumerate(range(probe, lm.num_layers)):
        index = torch.tensor(kept, dtype=torch.long)
        before_k = cache.keys[layer][0][:, index].clone()
        before_v = cache.values[layer][0][:, index].clone()
        with torch.no_grad():
            hidden = lm.run_layers(cache, hidden, torch.tensor(at), range(layer, layer + 1))
        passes.append((range(layer, layer + 1), list(at)))
        if i + 1 == len(sizes):
            break
        fk, fv = cache.keys[layer][0][:, index], cache.values[layer][0][:, index]
        diff = ((fk - before_k) ** 2).sum(dim=(0, 2)) + ((fv - before_v) ** 2).sum(dim=(0, 2))
        norm = (fk ** 2).sum(dim=(0, 2)) + (fv ** 2).sum(dim=(0, 2))
        layer_score = torch.zeros(n, dtype=torch.float32)
        layer_score[index] = (diff / norm.clamp_min(1e-12)).to(torch.float32)
        kept = rank(layer_score, 0, kept, sizes[i + 1])
        nxt = sorted(set(gaps) | set(kept))
        where = {p: j for j, p in enumerate(at)}
        hidden = hidden[:, [where[p] for p in nxt]]
        at = nxt
    return PrefillResult(cache, lm.logits(hidden[:, -1:])[-1], n, passes)
