"""Metric names and the engine-neutral counter bag that adapters export.

Counters are keyed ``"<family>"`` or ``"<family>:<label>"`` (e.g. ``"fallbacks:low_similarity"``,
``"external_tokens:exact"``). Adapters map each family to one Prometheus series named
``vllm:semkv_<family>_total`` with the label in ``LABELS[family]``.

NOTE: labels are closed enums (tiers, fallback reasons, provenance): never request ids, prompt
text or anything derived from it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import cast

# family -> (label name or None, help text)
FAMILIES: dict[str, tuple[str | None, str]] = {
    "lookup_requests": (None, "Decisions made (one per request, again after a preemption)."),
    "lookup_hits": ("tier", "Decisions that admitted a donor span, by quality tier."),
    "lookup_misses": (None, "Decisions where the provider proposed no candidate."),
    "prefix_index_hits": ("provider", "Decisions where the exact prefix index found stored "
                                      "whole blocks from the prompt's start, by what the "
                                      "provider answered for the same request: answered, "
                                      "missed, failed (timed out or raised)."),
    "lookup_rejected": ("reason", "Decisions that rejected every candidate, by reason."),
    "lookup_errors": ("kind", "Provider calls that raised, timed out or answered malformed; "
                              "register_dropped: registrations dropped while the provider's "
                              "write queue was full (a slow shared store); "
                              "malformed_records: shared-store records semkv did not write, "
                              "dropped; lmcache_timeout, lmcache_breaker_open: LMCache's "
                              "prefix lookup not waited for (past lmcache_lookup_timeout_ms, "
                              "or its breaker open)."),
    "request_options_refused": ("option", "Request options refused and dropped: an override "
                                          "request_overrides does not name (recompute, "
                                          "kv_floor, text), or a recompute override below the "
                                          "gate policy's strategy for the plan's class "
                                          "(recompute_weaker)."),
    "remote_donors": (None, "Candidates registered by another engine, found through a shared "
                            "discovery store (their tokens came with the lookup)."),
    "lookup_deferred": (None, "Scheduler steps a request waited for its lookup (asynchronous, "
                              "or past the step's one lookup budget)."),
    "materialize_requests": ("tier", "Loads planned into engine blocks, by tier."),
    "materialize_success": ("tier", "Requests whose planned load the workers confirmed, by tier."),
    "materialize_recompute": ("reason", "Admitted spans the engine computed after all."),
    "materialize_failed": (None, "Loads the workers could not complete (stale slot, copy error)."),
    "invalid_blocks": (None, "Blocks reported invalid to vLLM after a failed or stale load."),
    "donor_registrations": (None, "Donors handed to the provider."),
    "donor_evictions": ("reason", "Donors dropped, from the registry, the prefix index and "
                                  "the provider: bound (max_donors or index_memory_bytes, "
                                  "least recently used first), kv_evicted (a block of theirs "
                                  "left the donor store)."),
    "fallbacks": ("reason", "Requests that fell back to normal prefill, by reason."),
    "provenance": ("outcome", "Finished requests by the class of reuse that happened."),
    "external_tokens": ("tier", "Tokens reported to the engine as externally computed."),
    "would_reuse_tokens": ("tier", "Tokens a discovery-only lookup would have reused."),
    "loaded_tokens": (None, "Tokens whose KV the worker actually copied in (confirmed)."),
    "loaded_blocks": (None, "Blocks copied from the donor store into engine blocks."),
    "saved_blocks": (None, "Blocks copied from engine blocks into the donor store."),
    "fetch_missing": (None, "Realized spans refused because the shared KV store no longer "
                            "held a donor's prefix (donor_stale)."),
    "fetched_blocks": ("outcome", "Donor blocks retrieved from a shared KV store into host "
                                  "slots for realized spans (donor_store: lmcache): landed or "
                                  "failed."),
    "fetch_timeouts": (None, "Realized spans refused (donor_stale) because the shared KV store "
                             "did not answer their donors' lookup within transfer_timeout_s."),
    "realize_refused": ("reason", "Realized-span plans refused: class (the gate policy does "
                                  "not serve the plan's class), cost (predicted gain under "
                                  "realize_min_gain), memory (over realize_memory_bytes), "
                                  "tensor_parallel (realized spans run at TP=1 only), stale "
                                  "(a donor or a block it reads gone since the lookup)."),
    "would_realize_spans": ("class", "discovery_only: plans a realization would make that the "
                                     "gate policy would serve, by plan class."),
    "would_refuse_spans": ("class", "discovery_only: plans a realization would make that the "
                                    "gate policy would refuse (uncertified_class), by class."),
    "span_refused": ("class", "Realized-span plans refused (class, cost or memory gate, "
                              "tensor parallelism, a stale donor), by the class of the plan's "
                              "shape (semkv.plan_class)."),
    "refused_kept_exact": ("reason", "Requests whose non-exact reuse (a realized plan or one "
                                     "donor's span) was refused, by the refusal's reason, and "
                                     "that were served their longest stored exact prefix "
                                     "instead (worker-confirmed)."),
    "refused_kept_exact_tokens": ("reason", "The exact-prefix tokens those requests were "
                                            "served, by the refusal's reason."),
    "transfers_cancelled": (None, "Realizations and donor fetches dropped because their "
                                  "request was aborted (its blocks are never written)."),
    "transfer_timeouts": (None, "Realizations and donor fetches past transfer_timeout_s: "
                                "reported invalid, vLLM recomputes the span (load_failed)."),
    "realize_nonfinite": (None, "Realizations whose K or V held a NaN or inf: never written, "
                                "reported invalid, vLLM recomputes the span (load_failed)."),
    "request_only_blocks": (None, "Blocks served request-only: never exact prefix-cache state."),
    "span_tokens": ("kind", "Realized spans' tokens (worker-confirmed): copied from donors, of "
                            "which shifted (keys re-rotated), computed inside the span, and "
                            "copied tokens recomputed through every layer."),
    "realized_spans": ("class", "Requests served from a realized span (worker-confirmed), by "
                                "the class of its plan's shape (semkv.plan_class)."),
}
GAUGES: dict[str, str] = {
    "donor_store_bytes": "Bytes of donor KV held in the store.",
    "donors": "Donors currently registered.",
    "index_memory_bytes": "Host memory of the registered donors' discovery state (their "
                          "tokens, keys and provider index; semkv.index_memory), against "
                          "what index_memory_bytes leaves for donors.",
    "live_leases": "Donor leases currently held.",
}
_TOKENS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_FRACTION = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
# name -> (help text, buckets); one observation per decision or per load
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "lookup_seconds": ("Time from lookup start to decision (provider plus admission).",
                       (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)),
    "scheduler_seconds": ("semkv's scheduler-side time (every hook, lookups included) per step.",
                          (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)),
    "save_seconds": ("Worker time per step copying finished prompt blocks into the donor store.",
                     (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)),
    "save_wait_seconds": ("Time a step waited for in-flight donor saves before touching KV.",
                          (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)),
    "load_seconds": ("Worker time per step copying donor KV into engine blocks (all-at-once).",
                     (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)),
    "realize_seconds": ("Worker compute time of one realized span (reads, re-rotation, gap "
                        "compute), spread over engine steps.",
                        (1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)),
    "request_external_tokens": ("External tokens reported per admitted request.", _TOKENS),
    "request_loaded_tokens": ("Tokens actually loaded per request (worker-confirmed).", _TOKENS),
    "request_similarity": ("Served tokens identical to the target's own, per admitted request.",
                           _FRACTION),
    "request_reuse_ratio": ("External tokens over prompt tokens, per admitted request.", _FRACTION),
}


def key(family: str, label: object | None = None) -> str:
    if family not in FAMILIES:
        raise KeyError(f"unknown semkv metric family {family!r}")
    return family if label is None else f"{family}:{label}"


def split(counter_key: str) -> tuple[str, str | None]:
    family, _, label = counter_key.partition(":")
    return family, (label or None)


class CounterBag:
    """Plain counters, gauges and observations; picklable and mergeable across processes."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self.gauges: dict[str, float] = {}
        self.observations: dict[str, list[float]] = {}

    def inc(self, family: str, label: object | None = None, amount: int = 1) -> None:
        self.counters[key(family, label)] += amount

    def set(self, gauge: str, value: float) -> None:
        if gauge not in GAUGES:
            raise KeyError(f"unknown semkv gauge {gauge!r}")
        self.gauges[gauge] = value

    def observe(self, histogram: str, value: float) -> None:
        if histogram not in HISTOGRAMS:
            raise KeyError(f"unknown semkv histogram {histogram!r}")
        self.observations.setdefault(histogram, []).append(value)

    def to_dict(self) -> dict[str, object]:
        return {
            "counters": dict(self.counters),
            "gauges": dict(self.gauges),
            "observations": {k: list(v) for k, v in self.observations.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object] | None) -> CounterBag:
        bag = cls()
        if data:
            # The mapping crossed a process boundary as plain data (to_dict's shape).
            counters = cast(Mapping[str, int], data.get("counters", {}))
            gauges = cast(Mapping[str, float], data.get("gauges", {}))
            observations = cast(Mapping[str, Iterable[float]], data.get("observations", {}))
            bag.counters.update(counters)
            bag.gauges.update(gauges)
            for name, values in observations.items():
                bag.observations[name] = list(values)
        return bag

    def merge(self, others: Iterable[CounterBag]) -> CounterBag:
        for other in others:
            self.counters.update(other.counters)
            self.gauges.update(other.gauges)
            for name, values in other.observations.items():
                self.observations.setdefault(name, []).extend(values)
        return self

    def is_empty(self) -> bool:
        return not (self.counters or self.gauges or self.observations)

    def take(self) -> CounterBag:
        """Return the current values and start afresh (per-interval reporting)."""
        taken = CounterBag().merge([self])
        self.counters.clear()
        self.gauges.clear()
        self.observations.clear()
        return taken
