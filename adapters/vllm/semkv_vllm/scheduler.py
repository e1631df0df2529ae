"""Scheduler side of the connector: discovery, admission, load plans, donor capture.

Protocol, per vLLM scheduler step:
- ``on_new_request``: register the request (cheap); with ``async_lookup`` start its lookup.
- ``get_num_new_matched_tokens`` (request has no computed tokens): decide once per
  (request, local prefix, preemption count) and answer the same on repeated calls. A hit holds
  a donor lease and pins the store slots it will read, before any token is reported.
- ``update_state_after_alloc``: turn the hit into a ``LoadOp`` on the request's new blocks.
- ``build_connector_meta``: hand this step's loads to the workers, plus saves of every prompt
  block that becomes complete during this step; register a donor once its prompt is saved.
- ``update_connector_output``: learn from the workers how many blocks really arrived.
- ``request_finished``: provenance, stats, lease release; returns a summary in
  ``kv_transfer_params["semkv"]``.

NOTE: a provider exception, timeout or malformed answer ends in (0, False): normal prefill.
NOTE: in ``discovery_only`` nothing is saved or loaded; donors are registered by tokens only,
so the stats can say what each tier would have reused.
NOTE: with a shared store (``donor_store: lmcache``, see ``lmcache_store.py``) the store itself
is asked first: the prefix of the request it holds becomes one more exact-tier candidate (the
request's own tokens, so every process that computed them agrees), admitted like any donor.
Nothing is saved or loaded here then; the shared store's connector moves the KV.
"""

from __future__ import annotations

import itertools
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.request import RequestStatus

from semkv.admission import Admission, Assessment, DonorView, as_tokens
from semkv.config import SemkvConfig
from semkv.gates import full_prompt_cap
from semkv.leases import LeaseTable
from semkv.log import get_logger
from semkv.lookup import GuardedProvider, LookupResult
from semkv.metrics import CounterBag
from semkv.namespace import Namespace
from semkv.provider import DonorRecord, LookupQuery
from semkv.types import (
    CachePolicy,
    Candidate,
    FallbackReason,
    Mode,
    Provenance,
    QualityTier,
    SemanticKVMatch,
)
from semkv_vllm.metadata import LoadOp, SaveOp, SemkvMetadata, SemkvWorkerMetadata
from semkv_vllm.store_index import StoreIndex, block_keys

log = get_logger("semkv.vllm.scheduler")
MAX_CANDIDATES = 5


@dataclass
class _Donor:
    donor_id: str
    namespace: str
    token_ids: array[int]  # compact: donors are many and long
    keys: list[bytes]


@dataclass
class _Req:
    request: Any
    namespace: Namespace
    keys: list[bytes] | None = None
    decision: SemanticKVMatch | None = None
    assessment: Assessment | None = None
    decided_for: tuple[int, int] | None = None  # (local prefix, preemptions)
    answer: tuple[int | None, bool] = (0, False)
    pinned: list[int] = field(default_factory=list)
    generations: list[int] = field(default_factory=list)
    planned: bool = False
    loaded_tokens: int = 0
    load_failed: bool = False
    saved_blocks: int = 0
    may_save: bool = True
    registered: bool = False
    lookup_started: bool = False


class SchedulerSide:
    def __init__(self, config: SemkvConfig, *, block_size: int, namespace: Namespace,
                 num_slots: int, bytes_per_slot: int, engine_supported: bool,
                 provider: GuardedProvider | None, can_shift: bool = False,
                 request_only_enforced: Callable[[], bool] = lambda: False,
                 shared_lookup: Callable[[Any, int], int | None] | None = None) -> None:
        self.config = config
        self.bs = block_size
        self.namespace = namespace
        self.bytes_per_slot = bytes_per_slot
        self.engine_supported = engine_supported
        self.provider = provider
        self.can_shift = can_shift  # positions of this model's keys can be moved (RoPE)
        self.layout_known = False  # every worker reported a known page layout
        self.request_only_enforced = request_only_enforced
        # Shared donor store: (request, local prefix) -> tokens it can load beyond the local
        # prefix, None while its lookup runs. Such stores load between steps.
        self.shared_lookup = shared_lookup
        self.async_load = config.async_load or shared_lookup is not None
        self.shared_donors: dict[str, DonorView] = {}
        self.materialize = config.semantic_mode in (Mode.MATERIALIZE_EXACT,
                                                    Mode.MATERIALIZE_SEMANTIC)
        self.index = StoreIndex(num_slots)
        self.leases = LeaseTable()
        self.admission = Admission(config, block_size)
        self.donors: OrderedDict[str, _Donor] = OrderedDict()
        self.donor_by_tail: dict[bytes, str] = {}
        self.requests: dict[str, _Req] = {}
        self.pending_loads: list[LoadOp] = []
        self.stats = CounterBag()
        self.hook_seconds = 0.0  # connector hooks' time since the last stats export
        self.kv_cache_manager: Any = None
        self._ids = itertools.count(1)
        self._exported: dict[str, int] = {}  # the guard's counters, as last exported

    # -- request registration ----------------------------------------------------------------
    def _state(self, request: Any) -> _Req:
        st = self.requests.get(request.request_id)
        if st is None:
            from semkv_vllm.namespace import request_lora_identity

            ns = self.namespace.for_request(
                lora_identity=request_lora_identity(request.lora_request),
                cache_salt=request.cache_salt,
            )
            st = self.requests[request.request_id] = _Req(request, ns)
            st.may_save = self.engine_supported and self._supported(request)
        return st

    @staticmethod
    def _supported(request: Any) -> bool:
        # KV is a function of token ids only when the prompt has no embeddings or media.
        return request.prompt_embeds is None and not request.mm_features

    def on_new_request(self, request: Any) -> None:
        st = self._state(request)
        if self.provider is not None and self.config.async_lookup and self._supported(request):
            st.lookup_started = self.provider.submit(self._query(st, 0))
            if not st.lookup_started:
                st.decision = SemanticKVMatch.fallback(request.request_id,
                                                       FallbackReason.PROVIDER_TIMEOUT)
                st.decided_for = (0, request.num_preemptions)

    def _query(self, st: _Req, local: int) -> LookupQuery:
        params = st.request.kv_transfer_params or {}
        text = params.get("semkv_text") if isinstance(params, dict) else None
        return LookupQuery(request_id=st.request.request_id, namespace=st.namespace.digest,
                           token_ids=tuple(st.request.all_token_ids),
                           text=text if isinstance(text, str) else None,
                           local_prefix_tokens=local, max_candidates=MAX_CANDIDATES)

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
        if st.decided_for is not None:
            # The local prefix changed (or the request was preempted): the old decision and its
            # lease are void; decide afresh.
            st.lookup_started = False
            self._release(st)
        started = time.perf_counter()
        decision = self._decide(st, local)
        if decision is None:
            self.stats.inc("lookup_deferred")
            return None, False  # async lookup still running within its budget
        st.decision, st.decided_for = decision, key
        self._count_decision(decision, len(request.all_token_ids))
        self.stats.observe("lookup_seconds", time.perf_counter() - started)
        if decision.is_hit:
            st.answer = (decision.external_prefix_tokens, self.async_load)
        else:
            st.answer = (0, False)
        return st.answer

    def _count_decision(self, d: SemanticKVMatch, prompt_tokens: int) -> None:
        self.stats.inc("lookup_requests")
        if d.is_hit:
            self.stats.inc("lookup_hits", d.quality_tier)
            self.stats.observe("request_external_tokens", d.external_prefix_tokens)
            self.stats.observe("request_similarity", d.similarity)
            self.stats.observe("request_reuse_ratio",
                               d.external_prefix_tokens / max(prompt_tokens, 1))
        elif d.fallback_reason is FallbackReason.PROVIDER_MISS:
            self.stats.inc("lookup_misses")
        elif d.fallback_reason not in (FallbackReason.PROVIDER_ERROR,
                                       FallbackReason.PROVIDER_TIMEOUT):
            self.stats.inc("lookup_rejected", d.fallback_reason)  # errors: lookup_errors

    def _decide(self, st: _Req, local: int) -> SemanticKVMatch | None:
        rid = st.request.request_id
        tokens = st.request.all_token_ids
        if full_prompt_cap(len(tokens), local, len(tokens), self.bs,
                           synchronous=not self.async_load) == 0:
            return SemanticKVMatch.fallback(rid, FallbackReason.EXACT_PREFIX_SUFFICIENT,
                                            local_prefix_tokens=local)
        if not (self.engine_supported and self._supported(st.request)):
            return SemanticKVMatch.fallback(rid, FallbackReason.UNSUPPORTED_REQUEST)
        if not st.namespace.is_complete:
            return SemanticKVMatch.fallback(rid, FallbackReason.NAMESPACE_MISMATCH)
        shared = None
        if self.shared_lookup is not None and self.materialize:
            shared = self.shared_lookup(st.request, local)
            if shared is None:
                return None  # the shared store's lookup is still running
        result = self._lookup(st, local)
        if result is None:
            return None
        candidates = list(result.candidates)
        if shared:
            candidates.insert(0, self._shared_candidate(st, local, shared))
        elif result.reason is not None:
            return SemanticKVMatch.fallback(rid, result.reason, local_prefix_tokens=local)
        match, st.assessment = self.admission.decide(
            rid, tokens, local, candidates, self._donor_view, self.leases.acquire,
            st.namespace, synchronous=not self.async_load)
        if match.donor_id in self.shared_donors and match.is_hit and shared:
            # The shared store loads exactly what it answered (whole chunks; never the last
            # prompt token), and admission passed a span no longer than that.
            match = match.model_copy(update={"external_prefix_tokens": shared,
                                             "donor_prefix_tokens": local + shared})
        elif shared:
            self._drop_shared(rid)
        if match.is_hit and match.quality_tier is not QualityTier.EXACT:
            refusal = self._refuse_non_exact(st.assessment)
            if refusal is not None:
                self.leases.release(match.donor_lease_id or "")
                return SemanticKVMatch.fallback(rid, refusal, local_prefix_tokens=local)
        if match.is_hit and not self._pin(st, match):
            self.leases.release(match.donor_lease_id or "")
            return SemanticKVMatch.fallback(rid, FallbackReason.DONOR_STALE,
                                            local_prefix_tokens=local)
        return match

    def _shared_candidate(self, st: _Req, local: int, tokens: int) -> Candidate:
        """The shared store's prefix of this request, as a transient exact-tier donor."""
        donor_id = f"shared:{st.request.request_id}"
        digest = st.namespace.digest
        stored = local + tokens
        self.shared_donors[donor_id] = DonorView(
            donor_id, digest, as_tokens(st.request.all_token_ids[:stored]), stored)
        self.leases.publish(donor_id)
        return Candidate(donor_id=donor_id, namespace=digest, similarity=1.0)

    def _drop_shared(self, request_id: str) -> None:
        donor_id = f"shared:{request_id}"
        if donor_id in self.shared_donors and self.leases.try_retire(donor_id):
            del self.shared_donors[donor_id]

    def _refuse_non_exact(self, assessment: Assessment | None) -> FallbackReason | None:
        """Engine-side conditions for request-only reuse (admission judged the tokens)."""
        if not self.request_only_enforced():
            return FallbackReason.RECOMPUTE_POLICY  # loaded KV could become exact cache state
        span = assessment.span if assessment is not None else None
        if span is None or not self.layout_known or (span.shifted and not self.can_shift):
            return FallbackReason.UNSUPPORTED_REQUEST  # pages or positions cannot be edited
        return None

    def _lookup(self, st: _Req, local: int) -> LookupResult | None:
        assert self.provider is not None
        if not self.config.async_lookup:
            return self.provider.lookup_now(self._query(st, local))
        if not st.lookup_started:
            st.lookup_started = self.provider.submit(self._query(st, local))
            if not st.lookup_started:
                return LookupResult(reason=FallbackReason.PROVIDER_TIMEOUT)
        return self.provider.poll(st.request.request_id)

    def _donor_view(self, donor_id: str) -> DonorView | None:
        if donor_id in self.shared_donors:
            return self.shared_donors[donor_id]
        donor = self.donors.get(donor_id)
        if donor is None:
            return None
        self.donors.move_to_end(donor_id)
        stored = (self.index.stored_prefix(donor.keys) if self.materialize
                  else len(donor.keys)) * self.bs
        return DonorView(donor_id, donor.namespace, donor.token_ids, stored)

    def _pin(self, st: _Req, match: SemanticKVMatch) -> bool:
        if not self.materialize or match.donor_id in self.shared_donors:
            return True  # a shared store holds its own locks from lookup to load
        donor = self.donors[match.donor_id or ""]
        first, count = self._donor_blocks(st, match)
        found = [self.index.get(k) for k in donor.keys[first : first + count]]
        if any(f is None for f in found):
            return False
        st.pinned = [f[0] for f in found if f]
        st.generations = [f[1] for f in found if f]
        self.index.pin(st.pinned)
        return True

    def _donor_blocks(self, st: _Req, match: SemanticKVMatch) -> tuple[int, int]:
        """(first donor block, number of blocks) the load reads."""
        span = st.assessment.span if st.assessment is not None else None
        if match.quality_tier is QualityTier.EXACT or span is None:
            return match.local_prefix_tokens // self.bs, match.external_prefix_tokens // self.bs
        lo, hi = span.donor_range()
        return lo // self.bs, (hi - 1) // self.bs - lo // self.bs + 1

    def _release(self, st: _Req) -> None:
        if st.decision is not None and st.decision.donor_lease_id:
            self.leases.release(st.decision.donor_lease_id)
        if st.pinned:
            self.index.unpin(st.pinned)
        self._drop_shared(st.request.request_id)
        st.pinned, st.generations, st.planned = [], [], False
        st.decision, st.decided_for, st.answer = None, None, (0, False)

    def cache_policy(self, request_id: str) -> CachePolicy:
        """Side-effect free: may this request's blocks become exact prefix-cache state?"""
        st = self.requests.get(request_id)
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
        if d.donor_id in self.shared_donors:  # the shared store's connector loads it
            self.stats.inc("materialize_requests", d.quality_tier)
            st.planned = True
            return
        block_ids = blocks.get_block_ids()[0]
        first = d.local_prefix_tokens // self.bs
        targets = list(block_ids[first : first + d.external_prefix_tokens // self.bs])
        op = LoadOp(request.request_id, list(st.pinned), list(st.generations), targets,
                    asynchronous=self.async_load)
        span = st.assessment.span if st.assessment is not None else None
        if d.quality_tier is not QualityTier.EXACT and span is not None:
            op.segments = list(span.segments)
            op.donor_first_block = span.donor_range()[0] // self.bs
            op.target_start = span.target_start
            st.may_save = False  # request-only KV never becomes a donor either
            self.stats.inc("request_only_blocks", amount=len(targets))
        self.pending_loads.append(op)
        self.stats.inc("materialize_requests", d.quality_tier)
        st.planned = True

    def build_connector_meta(self, scheduler_output: Any) -> SemkvMetadata:
        meta = SemkvMetadata(loads=self.pending_loads)
        self.pending_loads = []
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            st = self.requests.get(rid)
            if st is not None:
                self._release(st)
        if self.provider is not None:
            for rid, scheduled in scheduler_output.num_scheduled_tokens.items():
                st = self.requests.get(rid)
                if st is not None and st.may_save and not st.registered:
                    self._capture(st, st.request.num_computed_tokens + scheduled, meta)
        self.index.evicted_keys.clear()
        return meta

    def _capture(self, st: _Req, computed_after: int, meta: SemkvMetadata) -> None:
        request = st.request
        prompt = request.num_prompt_tokens
        total_blocks = prompt // self.bs
        if total_blocks * self.bs < self.config.min_reuse_tokens:
            st.may_save = False  # too short to ever be worth reusing
            return
        done = min(computed_after, prompt) // self.bs
        if done <= st.saved_blocks:
            return
        if st.keys is None:
            st.keys = block_keys(st.namespace.digest, request.prompt_token_ids, self.bs)
        if self.materialize and self.shared_lookup is None:  # a shared store saves for itself
            if self.kv_cache_manager is None:
                return
            if total_blocks > self.index.num_slots:
                st.may_save = False  # a donor larger than the whole store could never serve
                return
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)[0]
            op = SaveOp([], [], [])
            for i in range(st.saved_blocks, done):
                got = self.index.reserve(st.keys[i])
                if got is None:
                    if self.index.get(st.keys[i]) is None:  # every slot pinned: stop here
                        st.may_save = False
                        break
                    continue
                self.index.pin([got[0]])  # never evict a block this request just stored
                op.slots.append(got[0])
                op.generations.append(got[1])
                op.block_ids.append(block_ids[i])
            self.index.unpin(op.slots)
            if op.slots:
                meta.saves.append(op)
        st.saved_blocks = done
        if done == total_blocks and st.may_save:
            self._register(st)

    def _register(self, st: _Req) -> None:
        assert st.keys is not None and self.provider is not None
        st.registered = True
        tail = st.keys[-1]
        if tail in self.donor_by_tail and self.donor_by_tail[tail] in self.donors:
            self.donors.move_to_end(self.donor_by_tail[tail])
            return
        donor_id = f"d{next(self._ids)}"
        tokens = as_tokens(st.request.prompt_token_ids[: len(st.keys) * self.bs])
        self.donors[donor_id] = _Donor(donor_id, st.namespace.digest, tokens, st.keys)
        self.donor_by_tail[tail] = donor_id
        self.leases.publish(donor_id)
        self.provider.register(DonorRecord(donor_id=donor_id, namespace=st.namespace.digest,
                                           token_ids=tuple(tokens)))
        self.stats.inc("donor_registrations")
        self._trim_donors()

    def _trim_donors(self) -> None:
        for donor_id in list(self.donors):
            if len(self.donors) <= self.config.max_donors:
                break
            if self.leases.try_retire(donor_id):
                self._drop_donor(donor_id)

    def _drop_donor(self, donor_id: str) -> None:
        donor = self.donors.pop(donor_id)
        if self.donor_by_tail.get(donor.keys[-1]) == donor_id:
            del self.donor_by_tail[donor.keys[-1]]
        assert self.provider is not None
        self.provider.evict(donor_id)
        self.stats.inc("donor_evictions")

    # -- worker feedback and finish ----------------------------------------------------------
    def update_connector_output(self, worker_meta: Any) -> None:
        if not isinstance(worker_meta, SemkvWorkerMetadata):
            return
        if worker_meta.layout_known is not None:
            self.layout_known = worker_meta.layout_known
        # NOTE: vLLM frees requests that stop in this step before it hands us the step's worker
        # output, so the counter counts confirmations whether or not the request is still here.
        for rid, blocks in worker_meta.loaded_blocks.items():
            self.stats.inc("loaded_tokens", amount=blocks * self.bs)
            self.stats.observe("request_loaded_tokens", blocks * self.bs)
            st = self.requests.get(rid)
            if st is not None:
                st.loaded_tokens = blocks * self.bs
        for rid in worker_meta.failed:
            st = self.requests.get(rid)
            if st is not None:
                st.load_failed = True

    def request_finished(self, request: Any) -> dict[str, Any] | None:
        st = self.requests.pop(request.request_id, None)
        if st is None:
            return None
        if st.planned and request.status == RequestStatus.FINISHED_ERROR:
            # kv_load_failure_policy "fail": vLLM ends the request for the invalid blocks of
            # its load before it hands us the worker's report of that failure.
            st.load_failed = True
        summary = self._account(st)
        log.info("provenance", request_id=request.request_id, **summary)  # counts only, no text
        self._release(st)
        if self.provider is not None:
            self.provider.forget(request.request_id)
        return {"semkv": summary}

    def _account(self, st: _Req) -> dict[str, Any]:
        d = st.decision
        local = d.local_prefix_tokens if d is not None else 0
        if d is not None and d.is_hit and st.planned and not st.load_failed:
            tier = d.quality_tier or QualityTier.EXACT
            outcome = (Provenance.EXACT_EXTERNAL_KV_HIT if tier is QualityTier.EXACT
                       else Provenance.REQUEST_ONLY_SEMANTIC_REUSE)
            self.stats.inc("materialize_success", tier)
            self.stats.inc("external_tokens", tier, d.external_prefix_tokens)
            reason = None
        else:
            if st.load_failed:
                self.stats.inc("materialize_recompute", FallbackReason.LOAD_FAILED)
            reason = (FallbackReason.LOAD_FAILED if st.load_failed
                      else d.fallback_reason if d is not None and d.fallback_reason
                      else FallbackReason.PROVIDER_MISS if d is not None
                      else FallbackReason.PROVIDER_DISABLED)
            tier = None
            a = st.assessment
            if a is not None and a.external_tokens > 0:
                self.stats.inc("would_reuse_tokens", a.tier, a.external_tokens)
            if a is not None and a.tier is not QualityTier.EXACT and not st.load_failed:
                outcome = Provenance.SEMANTIC_CANDIDATE_REJECTED
            elif local > 0:
                outcome = Provenance.EXACT_LOCAL_PREFIX_HIT
            else:
                outcome = Provenance.FALLBACK_RECOMPUTE
            self.stats.inc("fallbacks", reason)
        self.stats.inc("provenance", outcome)
        would = st.assessment.external_tokens if st.assessment is not None and tier is None else 0
        return {
            "provenance": str(outcome),
            "would_reuse_tokens": would,
            "tier": str(tier) if tier else None,
            "fallback_reason": str(reason) if reason else None,
            "local_prefix_tokens": local,
            "external_tokens": d.external_prefix_tokens if d is not None else 0,
            # 0 when the request stopped in the very step of its load (see update_connector_output)
            "confirmed_loaded_tokens": st.loaded_tokens,
            "donor_id": d.donor_id if d is not None else None,
            # served tokens identical to the target's own (1.0 for exact/verified hits)
            "similarity": d.similarity if d is not None and tier is not None else None,
        }

    # -- lifecycle ---------------------------------------------------------------------------
    def reset(self) -> None:
        for st in self.requests.values():
            self._release(st)
            st.saved_blocks, st.registered, st.may_save = 0, False, (
                self.engine_supported and self._supported(st.request))
        self.leases.release_all()
        self.pending_loads = []
        self.index.clear()
        self.index.evicted_keys.clear()
        self.donors.clear()
        self.donor_by_tail.clear()
        self.shared_donors.clear()
        if self.provider is not None:
            self.provider.reset()

    def shutdown(self) -> None:
        self.reset()
        if self.provider is not None:
            self.provider.close()

    def take_stats(self) -> CounterBag:
        if self.hook_seconds:
            self.stats.observe("scheduler_seconds", self.hook_seconds)
            self.hook_seconds = 0.0
        if self.provider is not None:  # export the guard's counters as deltas
            for kind, value in self.provider.counters.items():
                delta = value - self._exported.get(kind, 0)
                if delta:
                    self.stats.inc("lookup_errors", kind, delta)
                    self._exported[kind] = value
        self.stats.set("donor_store_bytes", len(self.index) * self.bytes_per_slot)
        self.stats.set("donors", len(self.donors))
        self.stats.set("live_leases", self.leases.live_count())
        return self.stats.take()


def make_detokenizer(tokenizer_path: str, revision: str | None,
                     trust_remote_code: bool) -> Callable[[Sequence[int]], str]:
    """Lazy detokenizer for providers that need text (loaded on first use)."""
    tokenizer: Any = None

    def detokenize(token_ids: Sequence[int]) -> str:
        nonlocal tokenizer
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(
                tokenizer_path, revision=revision, trust_remote_code=trust_remote_code)
        return str(tokenizer.decode(list(token_ids), skip_special_tokens=False))

    return detokenize
