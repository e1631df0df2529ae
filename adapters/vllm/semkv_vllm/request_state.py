"""What the scheduler side keeps per request, from registration to ``request_finished``, and
what registration reads off vLLM's ``Request`` (namespace, options, what may be saved, the
lookup's query)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from semkv.admission import Assessment
from semkv.config import SemkvConfig
from semkv.metrics import CounterBag
from semkv.namespace import Namespace
from semkv.plan_class import PlanClass
from semkv.provider import LookupQuery
from semkv.realize.recompute import RecomputeStrategy
from semkv.request_options import RequestOptions
from semkv.types import FallbackReason, SemanticKVMatch
from semkv_vllm.options import read_options
from semkv_vllm.span_admission import SpanHold


@dataclass
class RequestState:
    request: Any  # vLLM's Request
    namespace: Namespace
    keys: list[bytes] | None = None  # content keys of its full prompt blocks, once saving
    decision: SemanticKVMatch | None = None
    assessment: Assessment | None = None
    decided_for: tuple[int, int] | None = None  # (local prefix, preemptions)
    answer: tuple[int | None, bool] = (0, False)
    pinned: list[int] = field(default_factory=list)  # store slots its load reads
    generations: list[int] = field(default_factory=list)
    planned: bool = False
    loaded_tokens: int = 0  # confirmed by the worker
    recomputed_tokens: int = 0  # copied tokens its realization recomputed (worker-confirmed)
    load_failed: bool = False
    errored: bool = False  # vLLM ended it for its failed load (kv_load_failure_policy fail)
    saved_blocks: int = 0
    may_save: bool = True
    # NOTE: sticky: once any of its KV came from a non-exact op it stays request-only for life
    # (an engine reset releases its decision's holds, never this).
    request_only: bool = False
    registered: bool = False
    lookup_started: bool = False
    lookup_refused: bool = False  # its first lookup found every slot taken (a timeout)
    span: SpanHold | None = None  # a realized span's plan, leases and pinned slots
    # Its non-exact reuse, refused: the plan's class (None: a single donor's span or no plan)
    # and the reason. Served or not, an exact prefix may still have been (its decision).
    refused_span: tuple[PlanClass | None, FallbackReason] | None = None
    fetching: SemanticKVMatch | None = None  # its span's answer, while its donors are looked up
    fetch_key: tuple[int, int] | None = None  # (local prefix, preemptions) of that lookup
    fetch_started: float = 0.0  # time.monotonic() when that lookup was sent
    options: RequestOptions | None = None  # its semkv_options (semkv_vllm.options.read_options)
    bad_options: bool = False  # it sent options that do not parse: exact tier only
    # its span's strategy (read_options: the engine's, or its options' over it)
    recompute: RecomputeStrategy = field(default_factory=RecomputeStrategy)


def new_request_state(request: Any, namespace: Namespace, config: SemkvConfig,
                      stats: CounterBag, recompute: RecomputeStrategy) -> RequestState:
    """A request's state at registration: its namespace (with its LoRA and cache salt) and
    its options (``read_options``: counted when bad or off)."""
    from semkv_vllm.namespace import request_lora_identity

    ns = namespace.for_request(lora_identity=request_lora_identity(request.lora_request),
                               cache_salt=request.cache_salt)
    st = RequestState(request, ns)
    st.options, st.recompute, st.bad_options = read_options(request, config, stats, recompute)
    return st


def supported(request: Any) -> bool:
    """KV is a function of token ids only when the prompt has no embeddings or media."""
    return request.prompt_embeds is None and not request.mm_features


def changes_kv(st: RequestState) -> bool:
    """Did the request send an option that changes its KV (request-only, never saved)?"""
    return st.options is not None and st.options.changes_kv


def may_save(st: RequestState) -> bool:
    """May its prompt become a donor (not opted out, its KV unchanged, never request-only)?"""
    opted_out = st.options is not None and not st.options.save
    return supported(st.request) and not opted_out and not st.request_only and not changes_kv(st)


def lookup_query(st: RequestState, local: int, max_candidates: int) -> LookupQuery:
    """The provider's query: token ids, and text only where the client sent it (the ``text``
    override, allowed by the operator)."""
    return LookupQuery(request_id=st.request.request_id, namespace=st.namespace.digest,
                       token_ids=tuple(st.request.all_token_ids),
                       text=st.options.text if st.options is not None else None,
                       local_prefix_tokens=local, max_candidates=max_candidates)
