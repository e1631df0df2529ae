"""Scheduler side of the connector: discovery, admission, load plans.

Donor capture lives in ``donor_registry.py``, outcome counting in ``provenance.py``, span
realization plans (non-prefix reuse from several donors) in ``span_admission.py`` and whether
a request gets one in ``span_decision.py``, the workers' reports in ``worker_feedback.py``, the
order in which finished requests' blocks go back to vLLM in ``finish_order.py``.

Protocol, per vLLM scheduler step:
- ``on_new_request``: register the request (cheap); with ``async_lookup`` start its lookup.
  Without it a decision waits for its lookup, all of one step's waits within one lookup
  budget (``semkv.lookup.StepBudget``): a burst's later requests wait a step instead.
- ``get_num_new_matched_tokens`` (request has no computed tokens): decide once per
  (request, local prefix, preemption count) and answer the same on repeated calls. A hit holds
  a donor lease and pins the store slots it will read, before any token is reported.
- ``update_state_after_alloc``: turn the hit into a ``LoadOp`` on the request's new blocks.
- ``build_connector_meta``: hand this step's loads to the workers, plus saves of every prompt
  block that becomes complete during this step (``DonorRegistry.capture``).
- ``update_connector_output``: learn from the workers how many blocks really arrived.
- ``request_finished``: provenance, stats, lease release; logs the summary and returns it in
  ``kv_transfer_params["semkv"]`` only with ``summary_to_client`` (the client's response).

NOTE: a provider exception, timeout or malformed answer ends in (0, False): normal prefill.
NOTE: in ``discovery_only`` nothing is saved or loaded; donors are registered by tokens only,
so the stats can say what each tier would have reused.
NOTE: with a shared discovery store (``provider_config.discovery_store``) candidates may be
another engine's donors (``foreign_donors.py``): assessed in ``discovery_only``, ``donor_stale``
for a materializing engine (it has none of their KV).
NOTE: with a shared store (``donor_store: lmcache``, see ``lmcache_store.py``) the store itself
is asked first: the prefix of the request it holds becomes one more exact-tier candidate (the
request's own tokens, so every process that computed them agrees), admitted like any donor.
Nothing is saved or loaded here then; the shared store's connector moves the KV. With realized
spans on as well, donors (this engine's and, through a shared discovery store, other engines')
are planned from their token ids and their KV fetched from the shared store into private host
slots before the span is answered (``lmcache_fetch.py``): the decision waits (None) for the
store to confirm every donor's prefix, then holds it locked until the worker reports the load.
A request-only request's KV never goes into the shared store (``keeps_out_of_shared_store``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vllm.v1.request import RequestStatus

from semkv.admission import Admission, DonorView
from semkv.anchor_cache import ANCHOR_CACHE
from semkv.config import SemkvConfig
from semkv.cost import StepWork
from semkv.gates import full_prompt_cap
from semkv.leases import LeaseTable
from semkv.log import get_logger
from semkv.lookup import GuardedProvider, LookupResult, StepBudget
from semkv.metrics import CounterBag
from semkv.namespace import Namespace
from semkv.realize.memory import Budget
from semkv.types import (
    CachePolicy,
    Candidate,
    FallbackReason,
    Mode,
    QualityTier,
    SemanticKVMatch,
)
from semkv_vllm.cost_gate import step_work
from semkv_vllm.donor_registry import Donor, DonorRegistry
from semkv_vllm.engine_support import EngineSupport
from semkv_vllm.finish_order import FinishOrder
from semkv_vllm.foreign_donors import ForeignDonors
from semkv_vllm.lmcache_fetch import FetchLookups, SpanFetches
from semkv_vllm.load_ops import load_op, pin_slots, realize_op
from semkv_vllm.metadata import LoadOp, RealizeOp, SemkvMetadata
from semkv_vllm.options import cap_match
from semkv_vllm.provenance import account, count_decision, export_guard_counters
from semkv_vllm.request_state import (
    RequestState,
    changes_kv,
    lookup_query,
    may_save,
    new_request_state,
    supported,
)
from semkv_vllm.span_admission import ClassGate, CostGate, SpanAdmission, strategy_of
from semkv_vllm.span_decision import SpanDecision
from semkv_vllm.store_index import StoreIndex
from semkv_vllm.vllm_compat import skips_external_kv
from semkv_vllm.window_pins import WindowPins
from semkv_vllm.worker_capabilities import WorkerCapabilities
from semkv_vllm.worker_feedback import apply_worker_meta

log = get_logger("semkv.vllm.scheduler")
MAX_CANDIDATES = 5


class SchedulerSide:
    def __init__(self, config: SemkvConfig, *, block_size: int, namespace: Namespace,
                 num_slots: int, bytes_per_slot: int, support: EngineSupport,
                 provider: GuardedProvider | None, can_shift: bool = False,
                 request_only_enforced: Callable[[], bool] = lambda: False,
                 shared_lookup: Callable[[Any, int], int | None] | None = None,
                 fetch_lookups: FetchLookups | None = None,
                 realize_budget: Budget | None = None, class_gate: ClassGate | None = None,
                 cost_gate: CostGate | None = None) -> None:
        self.config = config
        self.bs = block_size
        self.namespace = namespace
        self.bytes_per_slot = bytes_per_slot
        self.support = support  # what this engine's requests can take (engine_support.py)
        self.provider = provider
        self.step_lookups = StepBudget()
        self.finish_order = FinishOrder()
        self.workers = WorkerCapabilities()  # what they reported with their first step
        self.request_only_enforced = request_only_enforced
        # Shared donor store: (request, local prefix) -> tokens it can load beyond the local
        # prefix, None while its lookup runs. Such stores load between steps.
        self.shared_lookup = shared_lookup
        # NOTE: with several KV-cache groups a failed load can only be reported per request
        # (vLLM maps invalid block ids back to requests for one group only), and with a window
        # group it must be (vLLM's invalid-block recovery restarts inside the failed load,
        # whose window lies in blocks the group dropped): asynchronous
        self.async_load = (config.async_load or shared_lookup is not None
                           or support.per_group)
        self.materialize = config.semantic_mode.materializes
        self.index = StoreIndex(num_slots)
        self.leases = LeaseTable()
        self.admission = Admission(config, block_size)
        self.requests: dict[str, RequestState] = {}
        self.pending_loads: list[LoadOp] = []
        self.pending_realizes: list[RealizeOp] = []
        self.stats = CounterBag()
        # Realized spans over a shared KV store: donors' KV is fetched from it per plan.
        self.fetch_lookups = fetch_lookups if shared_lookup is not None else None
        self.foreign = ForeignDonors(self.leases, block_size, self.stats,
                                     materialize=self.materialize,
                                     fetchable=self.fetch_lookups is not None)
        self.registry = DonorRegistry(
            config, block_size=block_size, index=self.index, leases=self.leases,
            provider=provider, stats=self.stats,
            materialize=self.materialize, saves_blocks=self.materialize and shared_lookup is None)
        ANCHOR_CACHE.resize(self.registry.budget.anchor_cache)  # span planning's share
        # Non-prefix reuse: realized spans serve the verified tier (identical tokens elsewhere).
        fetch_chunk = (None if self.fetch_lookups is None
                       else self.fetch_lookups.chunk_tokens)
        self.spans = (SpanAdmission(config, block_size, self.index, self.leases,
                                    self._donor_keys, fetch_chunk=fetch_chunk,
                                    budget=realize_budget, stats=self.stats)
                      if (config.semantic_mode is Mode.MATERIALIZE_SEMANTIC
                          and config.realize_spans
                          and (shared_lookup is None or fetch_chunk is not None)
                          and QualityTier.VERIFIED in config.semantic_tiers) else None)
        self.class_gate, self.cost_gate = class_gate, cost_gate
        if self.spans is not None:
            self.spans.classes, self.spans.cost = class_gate, cost_gate
            self.spans.engine_limit = support.realize
        self.fetches = (SpanFetches(self.fetch_lookups, self.spans, self.stats,
                                    timeout_s=config.transfer_timeout_s)
                        if self.spans is not None and self.fetch_lookups is not None else None)
        self.recompute = strategy_of(config)  # the engine's; a request's options lay over it
        self.span_decision = SpanDecision(
            spans=self.spans, leases=self.leases, class_gate=class_gate, stats=self.stats,
            block_size=block_size, min_copied_tokens=config.verified_min_reuse_tokens,
            span_view=self._span_view, request_only_enforced=request_only_enforced,
            support=support, workers=self.workers, can_shift=can_shift)
        if provider is not None:
            provider.known = lambda d: d in self.registry.donors or self.foreign.is_shared(d)
        self.hook_seconds = 0.0  # connector hooks' time since the last stats export
        self.kv_cache_manager: Any = None
        # a realization's local window blocks, held until the worker read them (window groups)
        self.window_pins = WindowPins(support.windows, block_size)
        self.null_block = 0  # vLLM's null block id (read from its block pool when bound)
        self._exported: dict[str, int] = {}  # the guard's counters, as last exported

    def workers_refusal(self) -> str | None:
        return self.workers.refusal()

    @property
    def workers_reported(self) -> bool:
        return self.workers.reported

    @property
    def layout_known(self) -> bool | None:
        return self.workers.layout_known

    def step_work(self, scheduler_output: Any) -> StepWork | None:
        """The step's forward work for the workers to time, when spans are priced."""
        if self.spans is None or self.cost_gate is None:
            return None
        return step_work(self.requests, scheduler_output)

    @property
    def donors(self) -> dict[str, Donor]:
        return self.registry.donors

    # -- request registration ----------------------------------------------------------------
    def _state(self, request: Any) -> RequestState:
        st = self.requests.get(request.request_id)
        if st is None:
            st = self.requests[request.request_id] = new_request_state(
                request, self.namespace, self.config, self.stats, self.recompute)
            st.may_save = self._may_save(st)
        return st

    def _may_save(self, st: RequestState) -> bool:
        return self.support.exact is None and may_save(st)

    def on_new_request(self, request: Any) -> None:
        st = self._state(request)
        wanted = st.options is None or st.options.lookup
        if (self.provider is not None and self.config.async_lookup and wanted
                and self.support.exact is None and supported(request)):
            st.lookup_started = self.provider.submit(lookup_query(st, 0, MAX_CANDIDATES))
            st.lookup_refused = not st.lookup_started  # decided as a timeout, exact prefix kept

    # -- decisions -------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, local: int) -> tuple[int | None, bool]:
        if self.provider is None:
            return 0, False
        st = self._state(request)
        if st.load_failed:
            # vLLM asks again after a failed asynchronous load (kv_load_failure_policy
            # recompute); answering the old hit again would leave the request waiting for a
            # load that is never planned (st.planned is already set). Never retry: prefill.
            return 0, False
        key = (local, request.num_preemptions)
        if st.decided_for == key and st.decision is not None:
            return st.answer
        if st.decided_for is not None or (st.fetching is not None and st.fetch_key != key):
            # The local prefix changed (or the request was preempted): the old decision and its
            # lease are void; decide afresh.
            st.lookup_started = False
            self._release(st)
        started = time.perf_counter()
        decision = (self.fetches.poll(st) if self.fetches is not None and st.fetching
                    else self._decide(st, local))
        if decision is None:
            if st.fetching is not None:
                st.fetch_key = key
            self.stats.inc("lookup_deferred")
            return None, False  # async lookup (or a donor fetch's lookup) still running
        if (decision.is_hit and st.span is not None
                and not self.window_pins.pin(request, local, self.kv_cache_manager)):
            self._release(st)  # vLLM's cache no longer gives the local window the span reads
            decision = self._keep_exact(st, local, SemanticKVMatch.fallback(
                request.request_id, FallbackReason.DONOR_STALE, local_prefix_tokens=local))
        st.decision, st.decided_for = decision, key
        count_decision(self.stats, decision, len(request.all_token_ids))
        self.stats.observe("lookup_seconds", time.perf_counter() - started)
        if decision.is_hit:
            # a realization computes on the worker: always off the engine step (asynchronous)
            st.answer = (decision.external_prefix_tokens, self.async_load or st.span is not None)
        else:
            st.answer = (0, False)
        return st.answer

    def _decide(self, st: RequestState, local: int) -> SemanticKVMatch | None:
        rid = st.request.request_id
        tokens = st.request.all_token_ids
        st.refused_span = None
        if full_prompt_cap(len(tokens), local, len(tokens), self.bs,
                           synchronous=not self.async_load) == 0:
            return SemanticKVMatch.fallback(rid, FallbackReason.EXACT_PREFIX_SUFFICIENT,
                                            local_prefix_tokens=local)
        if self.support.exact is not None:  # counted per request, by the engine's reason
            return SemanticKVMatch.fallback(rid, self.support.exact.reason)
        if not supported(st.request) or skips_external_kv(st.request):
            # (vLLM would discard the hit: no lookup, no lease, the reason said)
            return SemanticKVMatch.fallback(rid, FallbackReason.UNSUPPORTED_REQUEST)
        if st.bad_options:  # the exact tier needs no option: served as to any request
            return self._keep_exact(st, local, SemanticKVMatch.fallback(
                rid, FallbackReason.UNSUPPORTED_REQUEST, local_prefix_tokens=local))
        if st.options is not None and not st.options.lookup:
            return SemanticKVMatch.fallback(rid, FallbackReason.PROVIDER_DISABLED)
        if changes_kv(st) and not self.request_only_enforced():
            # its KV (fp8-rounded, or another recompute) must never become prefix-cache state
            return SemanticKVMatch.fallback(rid, FallbackReason.RECOMPUTE_POLICY)
        if not st.namespace.is_complete:
            return SemanticKVMatch.fallback(rid, FallbackReason.NAMESPACE_MISMATCH)
        if self.spans is not None and not self.workers_reported:
            # A fresh engine's first decisions come before its workers' first step: wait for
            # it (every step, idle ones too, reports) rather than refuse a realization.
            return None
        shared = None
        if self.shared_lookup is not None and self.materialize:
            shared = self.shared_lookup(st.request, local)
            if shared is None:
                return None  # the shared store's lookup is still running
        result = self._lookup(st, local)
        if result is None:
            return None
        candidates = list(result.candidates)
        self.foreign.remote_views(result.remote, candidates)
        exact = self._exact_candidate(st, result)
        if exact is not None:  # the exact tier never depends on the provider's answer
            candidates.insert(0, exact)
        if shared:
            candidates.insert(0, self.foreign.shared_candidate(st.request, st.namespace.digest,
                                                               local + shared))
        elif result.reason is not None and exact is None:
            return SemanticKVMatch.fallback(rid, result.reason, local_prefix_tokens=local)
        match, st.assessment = self.admission.decide(
            rid, tokens, local, candidates, self.donor_view, self.leases.acquire,
            st.namespace, synchronous=not self.async_load)
        if self.foreign.is_shared(match.donor_id) and match.is_hit and shared:
            # The shared store loads exactly what it answered (whole chunks; never the last
            # prompt token), and admission passed a span no longer than that.
            match = match.model_copy(update={"external_prefix_tokens": shared,
                                             "donor_prefix_tokens": local + shared})
        elif shared:
            self.foreign.drop_shared(rid)
        until = st.options.reuse_until if st.options is not None else None
        capped = cap_match(match, until, self.bs)
        if self.foreign.is_shared(match.donor_id) and capped is not match:
            capped = None  # a shared store loads exactly what it answered: never cut
        if capped is None:  # a request option keeps semkv's KV off the positions it reaches
            self.leases.release(match.donor_lease_id or "")
            match = SemanticKVMatch.fallback(rid, FallbackReason.LOW_REUSE_TOKENS,
                                             local_prefix_tokens=local)
        else:
            match = capped
        if not self.materialize:  # discovery_only: what the class gate would have done
            self.span_decision.count_would(st, local, candidates)
        if self.spans is not None and not (match.is_hit and self.foreign.is_shared(match.donor_id)):
            realized = self.span_decision.realize(st, local, candidates, match)
            if realized is not None and realized.is_hit and self.fetches is not None:
                return self.fetches.start(st, realized)  # its donors' KV is fetched first
            if realized is not None:
                return realized if realized.is_hit else self._keep_exact(st, local, realized)
        if match.is_hit and match.quality_tier is not QualityTier.EXACT:
            refusal = self.span_decision.refuse_non_exact(st.assessment)
            if refusal is not None:
                self.leases.release(match.donor_lease_id or "")
                return self._keep_exact(st, local, SemanticKVMatch.fallback(
                    rid, refusal, local_prefix_tokens=local))
        if match.is_hit and not self._pin(st, match):
            self.leases.release(match.donor_lease_id or "")
            return self._keep_exact(st, local, SemanticKVMatch.fallback(
                rid, FallbackReason.DONOR_STALE, local_prefix_tokens=local))
        return match

    def _keep_exact(self, st: RequestState, local: int,
                    refused: SemanticKVMatch) -> SemanticKVMatch:
        """After a refusal of other reuse (``refused``, a fallback): the longest stored exact
        prefix when there is one, its summary naming the refusal (``refused_span``); else the
        refusal. Looked up afresh: a stale donor's evicted blocks end the prefix before them.

        NOTE: the exact tier passes no class, cost or memory gate (its KV is the request's own,
        byte for byte): whatever refused the other reuse cannot refuse it.
        """
        # NOTE: with a shared KV store (LMCache) the host store holds no blocks: never found
        exact = (self.registry.exact_candidate(st.namespace.digest, st.request.all_token_ids)
                 if self.materialize else None)
        if exact is None or refused.fallback_reason is None:
            return refused
        rid = st.request.request_id
        match, assessment = self.admission.decide(
            rid, st.request.all_token_ids, local, [exact], self.donor_view, self.leases.acquire,
            st.namespace, synchronous=not self.async_load)
        capped = cap_match(match, st.options.reuse_until if st.options else None, self.bs)
        if capped is None or not capped.is_hit or capped.quality_tier is not QualityTier.EXACT:
            self.leases.release(match.donor_lease_id or "")
            return refused
        if not self._pin(st, capped):  # an exact load pins by its counts (no assessment)
            self.leases.release(capped.donor_lease_id or "")
            return refused
        st.assessment = assessment
        cls = st.refused_span[0] if st.refused_span is not None else None
        st.refused_span = (cls, refused.fallback_reason)
        return capped

    def loads_from_shared(self, request_id: str) -> bool:
        """Is this request's admitted span the shared store's own prefix (its connector loads)?"""
        st = self.requests.get(request_id)
        d = None if st is None else st.decision
        return d is not None and d.is_hit and self.foreign.is_shared(d.donor_id)

    def keeps_out_of_shared_store(self, request_id: str) -> bool:
        """Must the shared KV store not store this request (request-only KV, or opted out)?"""
        st = self.requests.get(request_id)
        if st is None:
            return False
        opted_out = st.options is not None and not st.options.save
        return opted_out or self.cache_policy(request_id) is CachePolicy.REQUEST_ONLY

    def end_fetches(self, st: RequestState) -> None:
        if self.fetches is not None:
            self.fetches.end(st)

    def _donor_keys(self, donor_id: str) -> list[bytes] | None:
        donor = self.registry.donors.get(donor_id)
        return None if donor is None else donor.keys

    def _exact_candidate(self, st: RequestState, result: LookupResult) -> Candidate | None:
        """The exact prefix index's candidate (its stored whole blocks from the first), counted
        by what the provider answered for the same request."""
        exact = self.registry.exact_candidate(st.namespace.digest, st.request.all_token_ids)
        if exact is not None:
            self.stats.inc("prefix_index_hits", "failed" if result.reason is not None
                           else "answered" if result.candidates else "missed")
        return exact

    def _lookup(self, st: RequestState, local: int) -> LookupResult | None:
        assert self.provider is not None
        if not self.config.async_lookup:  # waited for, one lookup budget per step in all
            st.lookup_started, result = self.step_lookups.lookup(
                self.provider, lookup_query(st, local, MAX_CANDIDATES), st.lookup_started)
            return result
        if st.lookup_refused:  # on_new_request's submit found every lookup slot taken
            st.lookup_refused = False
            return LookupResult(reason=FallbackReason.PROVIDER_TIMEOUT)
        if not st.lookup_started:
            st.lookup_started = self.provider.submit(lookup_query(st, local, MAX_CANDIDATES))
            if not st.lookup_started:
                return LookupResult(reason=FallbackReason.PROVIDER_TIMEOUT)
        return self.provider.poll(st.request.request_id)

    def donor_view(self, donor_id: str) -> DonorView | None:
        return (self.foreign.shared.get(donor_id) or self.registry.view(donor_id)
                or self.foreign.remote.get(donor_id))

    def _span_view(self, donor_id: str) -> DonorView | None:
        """Span planning also sees other engines' donors whose KV it can fetch."""
        return self.donor_view(donor_id) or self.foreign.fetchable.get(donor_id)

    def _pin(self, st: RequestState, match: SemanticKVMatch) -> bool:
        if not self.materialize or self.foreign.is_shared(match.donor_id):
            return True  # a shared store holds its own locks from lookup to load
        return pin_slots(st, match, self.registry.donors[match.donor_id or ""].keys,
                         self.index, self.bs)

    def _release(self, st: RequestState) -> None:
        if not st.planned:  # else its op may still read them: released when it reports
            self.window_pins.release(st.request.request_id)
        self._release_holds(st)
        st.span, st.fetching, st.planned = None, None, False
        st.decision, st.decided_for, st.answer = None, None, (0, False)

    def _release_holds(self, st: RequestState) -> None:
        """Leases, pins, fetched slots and lookup locks; the decision itself stays."""
        if st.span is not None:  # a realization holds every lease and pin in its SpanHold
            assert self.spans is not None
            self.end_fetches(st)
            self.spans.release(st.span)  # idempotent: the plan stays for the accounting
        elif st.decision is not None and st.decision.donor_lease_id:
            self.leases.release(st.decision.donor_lease_id)
        if st.pinned:
            self.index.unpin(st.pinned)
        self.foreign.drop_shared(st.request.request_id)
        st.pinned, st.generations = [], []

    def cache_policy(self, request_id: str) -> CachePolicy:
        """Side-effect free: may this request's blocks become exact prefix-cache state?"""
        st = self.requests.get(request_id)
        if st is not None and (st.request_only or changes_kv(st)):
            return CachePolicy.REQUEST_ONLY
        if st is not None and st.decision is not None and st.decision.is_hit:
            return st.decision.cache_policy
        return CachePolicy.EXACT_COMMIT

    # -- allocation and metadata -------------------------------------------------------------
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        st = self.requests.get(request.request_id)
        if st is None or st.decision is None or not st.decision.is_hit or st.planned:
            return
        if num_external != st.decision.external_prefix_tokens or not self.materialize:
            # The engine did not take our span (e.g. its local partial block won): no load.
            local = st.decision.local_prefix_tokens
            if self.materialize:
                self.stats.inc("materialize_recompute", FallbackReason.EXACT_PREFIX_SUFFICIENT)
            self._release(st)
            st.decision = SemanticKVMatch.fallback(
                request.request_id, FallbackReason.EXACT_PREFIX_SUFFICIENT,
                local_prefix_tokens=local)
            st.decided_for = (local, request.num_preemptions)
            return
        d = st.decision
        if self.foreign.is_shared(d.donor_id):  # the shared store's connector loads it
            self.stats.inc("materialize_requests", d.quality_tier)
            st.planned = True
            return
        block_ids = blocks.get_block_ids()  # one list per KV-cache group
        if st.span is not None:
            pinned = (self.window_pins.local_ids(request.request_id) if self.support.per_group
                      else None)
            self.pending_realizes.append(realize_op(st, block_ids, null_block=self.null_block,
                                                    pinned=pinned))
            request_only = True
        else:
            load = load_op(st, block_ids, self.bs, asynchronous=self.async_load,
                           null_block=self.null_block, per_group=self.support.per_group)
            self.pending_loads.append(load)
            request_only = load.segments is not None
        if request_only:
            st.request_only = True
            self.stats.inc("request_only_blocks", amount=d.external_prefix_tokens // self.bs)
        if st.answer[1]:  # asynchronous: the worker reports it received, later
            self.finish_order.expect(request.request_id)
        self.stats.inc("materialize_requests", d.quality_tier)
        st.planned = True

    def build_connector_meta(self, scheduler_output: Any) -> SemkvMetadata:
        self.step_lookups.new_step()  # the next schedule() waits one lookup budget at most
        meta = SemkvMetadata(loads=self.pending_loads, realizes=self.pending_realizes,
                             idle=not getattr(scheduler_output, "total_num_scheduled_tokens", 1))
        self.pending_loads, self.pending_realizes = [], []
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            st = self.requests.get(rid)
            if st is not None:
                self._release(st)
        if self.provider is not None:
            for rid, scheduled in scheduler_output.num_scheduled_tokens.items():
                st = self.requests.get(rid)
                if st is not None and st.may_save and not st.registered:
                    self.registry.capture(st, st.request.num_computed_tokens + scheduled, meta,
                                          self.kv_cache_manager, self.null_block)
        if self.provider is not None:  # donors whose KV the store gave up go with it
            self.registry.drop_evicted(self.index.evicted_keys)
        self.index.evicted_keys.clear()
        if self.fetch_lookups is not None:
            self.fetch_lookups.settle()  # lookups of aborted requests, once answered
        return meta

    # -- worker feedback and finish ----------------------------------------------------------
    def update_connector_output(self, worker_meta: Any) -> None:
        apply_worker_meta(worker_meta, self.workers, cost_gate=self.cost_gate, stats=self.stats,
                          requests=self.requests, block_size=self.bs,
                          end_fetches=self.end_fetches)

    def request_finished(self, request: Any, *,
                         shared_delays_free: bool = False) -> dict[str, Any] | None:
        self.finish_order.finished(request.request_id, shared_delays_free=shared_delays_free)
        st = self.requests.pop(request.request_id, None)
        if st is None:
            return None
        if st.planned and request.status == RequestStatus.FINISHED_ERROR:
            # kv_load_failure_policy "fail": vLLM ends the request for the invalid blocks of
            # its load before it hands us the worker's report of that failure.
            st.load_failed = st.errored = True
        summary = account(self.stats, st)
        log.info("provenance", request_id=request.request_id, **summary)  # counts only, no text
        self._release(st)
        if self.provider is not None:
            self.provider.forget(request.request_id)
        # NOTE: what reuse did is the operator's (metrics, the log line above): a client sees
        # it only where the operator says so, or it would learn what other tenants sent.
        return {"semkv": summary} if self.config.summary_to_client else None

    # -- lifecycle ---------------------------------------------------------------------------
    def reset(self, *, provider: bool = True) -> None:
        """Forget every donor and hold. vLLM calls it with requests still running (its own
        prefix-cache reset may fail while blocks are in use; the connector's runs anyway)."""
        for st in self.requests.values():
            if st.planned:
                # Its KV is (being) written: keep the decision, so its provenance and cache
                # policy (request-only stays request-only) outlive the reset.
                self._release_holds(st)
            else:
                self._release(st)
            st.saved_blocks, st.registered, st.may_save = 0, False, self._may_save(st)
        self.leases.release_all()
        self.pending_loads, self.pending_realizes = [], []
        self.index.clear()
        self.index.evicted_keys.clear()
        self.registry.clear()
        self.foreign.clear()
        if self.provider is not None and provider:
            self.provider.reset()

    def shutdown(self) -> None:
        # NOTE: the provider is closed, not reset: a shared discovery store keeps this engine's
        # donors for the others (their KV may live on in LMCache; TTLs expire them).
        self.reset(provider=False)
        if self.provider is not None:
            self.provider.close()

    def take_stats(self) -> CounterBag:
        if self.hook_seconds:
            self.stats.observe("scheduler_seconds", self.hook_seconds)
            self.hook_seconds = 0.0
        if self.provider is not None:
            export_guard_counters(self.stats, self.provider.counts(), self._exported)
        self.stats.set("donor_store_bytes", len(self.index) * self.bytes_per_slot)
        self.stats.set("donors", len(self.registry))
        self.stats.set("index_memory_bytes", self.registry.nbytes)
        self.stats.set("live_leases", self.leases.live_count())
        return self.stats.take()

