"""What the scheduler side keeps per request, from registration to ``request_finished``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from semkv.admission import Assessment
from semkv.namespace import Namespace
from semkv.realize.recompute import RecomputeStrategy
from semkv.request_options import RequestOptions
from semkv.types import SemanticKVMatch
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
    span: SpanHold | None = None  # a realized span's plan, leases and pinned slots
    fetching: SemanticKVMatch | None = None  # its span's answer, while its donors are looked up
    fetch_key: tuple[int, int] | None = None  # (local prefix, preemptions) of that lookup
    fetch_started: float = 0.0  # time.monotonic() when that lookup was sent
    options: RequestOptions | None = None  # its semkv_options (request_options: true)
    bad_options: bool = False  # it sent options that do not parse: normal prefill
    # its span's strategy (read_options: the engine's, or its options' over it)
    recompute: RecomputeStrategy = field(default_factory=RecomputeStrategy)
