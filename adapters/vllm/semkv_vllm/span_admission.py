"""Scheduler side of span realization: from a provider's candidates to a pinned ``SpanPlan``.

Protocol (``SchedulerSide._decide`` calls ``plan`` after admission judged the candidates):

1. Every candidate whose donor is known, of the request's namespace and with stored KV
   contributes its stored tokens; ``semkv.span_plan.plan_span`` picks the best donor per target
   chunk among all of them (identical tokens only, any offset) and leaves the rest of the span
   as gaps for the worker to compute.
2. The plan must copy at least ``verified_min_reuse_tokens`` tokens and beat an exact-tier match
   admission found (exact KV needs no re-rotation and may be committed: it wins ties). With a
   ``Budget`` (``realize_budget``: the model's per-rank geometry, ``realize_memory_bytes``,
   vLLM's ``max_num_batched_tokens`` as the positions per layer call) its working set
   (``semkv.realize.memory``, the same estimate the worker checks before allocating) must fit:
   else ``allocation_failed``, counted ``realize_refused{reason=memory}``, nothing held.
3. One lease per donor, then every donor block a copy reads is pinned in the store, before any
   token is reported. Anything missing ends in ``donor_stale`` with everything released,
   counted ``realize_refused{reason=stale}``.
   With a shared KV store (``fetch_chunk`` set: ``donor_store: lmcache``) donors' KV is not in
   the host store: each donor's prefix up to the last block a copy reads gets free slots of
   its own, private to the request and pinned, and a ``FetchOp`` that fills them from the
   shared store (``lmcache_fetch.py``); the scheduler confirms the store holds that prefix
   before it answers.

The answer is a ``SemanticKVMatch`` of tier ``verified`` (identical tokens, other context),
``REQUEST_ONLY``, asynchronous: the worker computes the gaps off the engine step.

The hold carries the recompute strategy (``recompute_*`` keys, ``semkv.realize.recompute``):
the ``RealizeOp`` names it, and carries the ids of every span token it may compute.

NOTE: plans and matches hold positions and counts only; token ids stay in the scheduler, except
the span tokens a ``RealizeOp`` may compute (gaps, and copied tokens the strategy may select).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from semkv.admission import DonorView
from semkv.config import SemkvConfig
from semkv.leases import LeaseTable, UnknownDonorError
from semkv.metrics import CounterBag
from semkv.plan_class import PlanClass, plan_class
from semkv.realize.memory import Budget, Geometry, working_set
from semkv.realize.recompute import (
    RecomputeKind,
    RecomputeStrategy,
    cache_tokens,
    covers,
    needed_positions,
)
from semkv.span_plan import SpanPlan, plan_span
from semkv.types import (
    CachePolicy,
    Candidate,
    FallbackReason,
    Materialization,
    QualityTier,
    SemanticKVMatch,
)
from semkv_vllm.engine_support import Limit
from semkv_vllm.metadata import CopySource, FetchOp, RealizeOp
from semkv_vllm.store_index import StoreIndex


@dataclass
class SpanHold:
    """A realization decision's plan, leases and pinned donor slots (released together)."""

    plan: SpanPlan
    lease_ids: list[str] = field(default_factory=list)
    copies: list[CopySource] = field(default_factory=list)
    recompute: RecomputeStrategy = field(default_factory=RecomputeStrategy)
    fetches: list[FetchOp] = field(default_factory=list)  # shared store -> private slots
    fetch_keys: list[bytes] = field(default_factory=list)  # the private slots' index keys
    chunk_tokens: int | None = None  # the realization's positions per layer call

    @property
    def slots(self) -> list[int]:
        return [s for c in self.copies for s in c.slots]

    def op(self, request_id: str, token_ids: Sequence[int], block_ids: Sequence[int]) -> RealizeOp:
        """The worker's op, on the request's allocated blocks."""
        bs = self.plan.block_size
        local, span = self.plan.local_tokens, self.plan.span_tokens
        gaps = self.plan.gap_positions()
        runs = [(s.target_start, s.length) for s in self.plan.segments if not s.is_gap]
        needed = needed_positions(range(local, span), runs, self.recompute, len(token_ids))
        return RealizeOp(request_id, local, span, list(block_ids[: local // bs]),
                         list(block_ids[local // bs: span // bs]), list(self.copies), gaps,
                         needed, [int(token_ids[p]) for p in needed], self.recompute,
                         len(token_ids), fetches=list(self.fetches),
                         max_chunk_tokens=self.chunk_tokens)


def strategy_of(config: SemkvConfig) -> RecomputeStrategy:
    """The recompute strategy the ``recompute_*`` keys configure."""
    return RecomputeStrategy(RecomputeKind(config.recompute_strategy),
                             fraction=config.recompute_fraction,
                             first_k=config.recompute_first_k,
                             probe_layers=config.recompute_probe_layers,
                             query_tokens=config.recompute_query_tokens)


def realize_budget(config: SemkvConfig, vllm_config: Any) -> Budget:
    """The realization's bound and per-call chunk, with the model's per-rank geometry read
    from vLLM's config (the shapes the worker's runner reads off the loaded modules)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    tp = max(1, int(pc.tensor_parallel_size))
    hidden = int(mc.get_hidden_size())
    # Models the runners refuse may lack it: the usual 4x keeps the estimate an estimate.
    width = getattr(mc.hf_text_config, "intermediate_size", None) or 4 * hidden
    geometry = Geometry(
        layers=int(mc.get_num_layers(pc)), kv_heads=int(mc.get_num_kv_heads(pc)),
        heads=int(mc.get_num_attention_heads(pc)), head_dim=int(mc.get_head_size()),
        hidden=hidden, intermediate=-(-int(width) // tp), dtype_bytes=int(mc.dtype.itemsize))
    return Budget(geometry, int(config.realize_memory_bytes),
                  int(vllm_config.scheduler_config.max_num_batched_tokens))


def plan_working_set(budget: Budget, plan: SpanPlan, recompute: RecomputeStrategy,
                     prompt_tokens: int) -> int:
    """The working set of the ``RealizeOp`` this plan becomes (``realization.op_working_set``
    of it, computed before anything is held)."""
    bs, local = plan.block_size, plan.local_tokens
    copies = [s for s in plan.segments if not s.is_gap]
    blocks = sum((s.donor_start + s.length - 1) // bs - s.donor_start // bs + 1 for s in copies)
    runs = [(s.target_start, s.length) for s in copies]
    positions = range(local, plan.span_tokens)
    computed = len(needed_positions(positions, runs, recompute, prompt_tokens))
    return working_set(budget.geometry, span_tokens=plan.span_tokens, local_tokens=local,
                       read_rows=local + blocks * bs, computed=computed,
                       probe_layers=recompute.held_probe_layers,
                       chunk_tokens=budget.chunk_tokens,
                       cache_tokens=cache_tokens(positions, runs, recompute, prompt_tokens))


class CostGate(Protocol):
    """Predicts a plan's TTFT gain over the request's fallback: a cold prefill after the local
    prefix, or after the exact prefix that would be served instead (``cost_gate.py``)."""

    def predicted_gain(self, plan: SpanPlan, recompute: RecomputeStrategy, prompt_tokens: int,
                       *, exact_end: int | None = None,
                       ) -> float | None: ...  # None: cannot predict yet


class ClassGate(Protocol):
    """The gate policy by plan class (``class_gate.py``): the strategy a class is served with."""

    ungated: bool  # gate_policy ungated: every class, with the strategy it is handed

    def strategy(self, cls: PlanClass, engine: RecomputeStrategy, prompt_tokens: int,
                 ) -> RecomputeStrategy | FallbackReason: ...

    def served(self, cls: PlanClass, prompt_tokens: int) -> bool: ...


class SpanAdmission:
    def __init__(self, config: SemkvConfig, block_size: int, index: StoreIndex,
                 leases: LeaseTable, keys_of: Callable[[str], list[bytes] | None], *,
                 fetch_chunk: int | None = None, budget: Budget | None = None,
                 stats: CounterBag | None = None) -> None:
        self.config = config
        self.bs = block_size
        self.index = index
        self.leases = leases
        self.keys_of = keys_of  # donor id -> its blocks' content keys in the store
        # Set: donors' KV lives in a shared store that holds whole chunks of this many tokens.
        self.fetch_chunk = fetch_chunk
        self.budget = budget  # None: plans are not bounded here (the worker still refuses)
        self.stats = stats
        self.cost: CostGate | None = None  # the cost gate; None: plans are not priced
        self.classes: ClassGate | None = None  # the gate policy by class; None: ungated
        self.refused_class: PlanClass | None = None  # the last plan a gate refused
        # the engine's own limit (tensor parallelism, KV-cache groups): every plan refused as
        # it, before the gates (a class the engine cannot realize is not the policy's to judge)
        self.engine_limit: Limit | None = None

    def plan(self, request_id: str, target: Sequence[int], local: int,
             candidates: Sequence[Candidate], view: Callable[[str], DonorView | None],
             namespace: str, exact: SemanticKVMatch | None,
             recompute: RecomputeStrategy, until: int | None = None,
             request_recompute: bool = False,
             ) -> tuple[SemanticKVMatch, SpanHold] | FallbackReason:
        self.refused_class = None
        donors = {}
        for c in candidates:
            v = view(c.donor_id)
            if v is None or c.namespace != namespace or v.namespace != namespace:
                continue
            stored = v.stored_tokens
            if self.fetch_chunk is not None:  # the shared store holds whole chunks only
                stored = len(v.token_ids) - len(v.token_ids) % self.fetch_chunk
            if stored > 0:
                donors[c.donor_id] = v.token_ids[:stored]
        if not donors:
            return FallbackReason.PROVIDER_MISS
        plan = plan_span(target, donors, local_tokens=local, block_size=self.bs,
                         max_span_tokens=None if until is None else max(0, until - local),
                         min_copied_tokens=self.config.verified_min_reuse_tokens,
                         namespace=namespace)
        if plan is None:
            return FallbackReason.LOW_REUSE_TOKENS
        if exact is not None and exact.external_prefix_tokens >= plan.copied_tokens:
            return FallbackReason.EXACT_PREFIX_SUFFICIENT  # the exact match serves as much
        cls = plan_class(plan)
        if self.engine_limit is not None:
            self._refused(self.engine_limit.counter, cls)
            return self.engine_limit.reason
        if self.classes is not None:
            # the class's strategy over the engine's (a request's own fields never fill what
            # the policy leaves unset); ungated, the request's or engine's strategy as it is
            over = (strategy_of(self.config) if request_recompute and not self.classes.ungated
                    else recompute)
            gated = self.classes.strategy(cls, over, len(target))
            if isinstance(gated, FallbackReason):
                self._refused("class", cls)
                return gated
            # a request's own recompute (an override the operator allowed) only where it
            # recomputes at least what the policy certified this class with
            if not request_recompute or not covers(recompute, gated):
                if request_recompute and self.stats is not None:
                    self.stats.inc("request_options_refused", "recompute_weaker")
                recompute = gated
        # priced against the request's fallback: the exact prefix served when there is one
        exact_end = (None if exact is None
                     else exact.local_prefix_tokens + exact.external_prefix_tokens)
        gain = (None if self.cost is None
                else self.cost.predicted_gain(plan, recompute, len(target), exact_end=exact_end))
        if gain is not None and gain < self.config.realize_min_gain:
            self._refused("cost", cls)
            return FallbackReason.LOW_PREDICTED_GAIN
        if self.budget is not None and (
                plan_working_set(self.budget, plan, recompute, len(target))
                > self.budget.memory_bytes):
            self._refused("memory", cls)
            return FallbackReason.ALLOCATION_FAILED  # before any lease or pin
        hold = SpanHold(plan, recompute=recompute,
                        chunk_tokens=None if self.budget is None else self.budget.chunk_tokens)
        held = (self._hold(hold) if self.fetch_chunk is None
                else self._hold_for_fetch(hold, request_id, donors))
        if not held:  # a donor dropped, or a block it reads evicted, since the lookup
            self.release(hold)
            self._refused("stale", cls)
            return FallbackReason.DONOR_STALE
        copied = sum(1 for s in plan.segments if not s.is_gap)
        match = SemanticKVMatch(
            request_id=request_id, donor_id=plan.donors[0], donor_lease_id=hold.lease_ids[0],
            similarity=1.0,  # every copied token is identical to the target's
            local_prefix_tokens=local, external_prefix_tokens=plan.span_tokens - local,
            donor_prefix_tokens=plan.span_tokens, materialization=Materialization.ASYNC,
            quality_tier=QualityTier.VERIFIED, cache_policy=CachePolicy.REQUEST_ONLY,
            metadata={**plan.summary(), "copy_segments": copied,
                      **({} if gain is None else {"predicted_gain": round(gain, 3)})})
        return match, hold

    def _refused(self, reason: str, cls: PlanClass) -> None:
        self.refused_class = cls
        if self.stats is not None:
            self.stats.inc("realize_refused", reason)
            self.stats.inc("span_refused", cls.value)

    def _lease(self, hold: SpanHold) -> bool:
        """One lease per donor of the plan (False: a donor is gone)."""
        for donor_id in hold.plan.donors:
            try:
                hold.lease_ids.append(self.leases.acquire(donor_id).lease_id)
            except UnknownDonorError:
                return False
        return True

    def _hold(self, hold: SpanHold) -> bool:
        if not self._lease(hold):
            return False
        for seg in hold.plan.segments:
            if seg.donor_id is None:
                continue
            keys = self.keys_of(seg.donor_id)
            first, last = seg.donor_start // self.bs, (seg.donor_start + seg.length - 1) // self.bs
            found = [self.index.get(k) for k in (keys or [])[first: last + 1]]
            if len(found) != last - first + 1 or any(f is None for f in found):
                return False
            slots = [f[0] for f in found if f]
            self.index.pin(slots)
            hold.copies.append(CopySource(seg.target_start, seg.length, seg.donor_start, first,
                                          slots, [f[1] for f in found if f]))
        return True

    def _hold_for_fetch(self, hold: SpanHold, request_id: str,
                        donors: dict[str, Sequence[int]]) -> bool:
        """Leases, then private pinned slots and a ``FetchOp`` per donor (shared store)."""
        if not self._lease(hold):
            return False
        for k, donor_id in enumerate(hold.plan.donors):
            segments = [s for s in hold.plan.segments if s.donor_id == donor_id]
            blocks = max((s.donor_start + s.length - 1) // self.bs for s in segments) + 1
            slots, generations = [], []
            for block in range(blocks):
                key = hashlib.blake2b(f"fetch|{request_id}|{k}|{block}".encode(),
                                      digest_size=16).digest()
                reserved = self.index.reserve(key)
                if reserved is None:  # every slot is pinned: the store is too small now
                    return False
                self.index.pin([reserved[0]])
                hold.fetch_keys.append(key)
                slots.append(reserved[0])
                generations.append(reserved[1])
            tokens = [int(t) for t in donors[donor_id][: blocks * self.bs]]
            hold.fetches.append(FetchOp(f"semkv-fetch-{k}-{request_id}", tokens,
                                        blocks * self.bs, slots, generations))
            for seg in segments:
                first = seg.donor_start // self.bs
                last = (seg.donor_start + seg.length - 1) // self.bs
                hold.copies.append(CopySource(seg.target_start, seg.length, seg.donor_start,
                                              first, slots[first: last + 1],
                                              generations[first: last + 1]))
        return True

    def release_fetched(self, hold: SpanHold) -> None:
        """Free a hold's private slots once its realization read them (leases stay held)."""
        for key in hold.fetch_keys:
            found = self.index.get(key)
            if found is not None:
                self.index.unpin([found[0]])
                self.index.drop(key)
        hold.fetch_keys, hold.fetches, hold.copies = [], [], []

    def release(self, hold: SpanHold) -> None:
        for lease_id in hold.lease_ids:
            self.leases.release(lease_id)
        if hold.fetch_keys:  # private slots: pinned once each, then freed
            self.release_fetched(hold)
        elif hold.copies:
            self.index.unpin(hold.slots)
        hold.lease_ids, hold.copies, hold.fetches, hold.fetch_keys = [], [], [], []
