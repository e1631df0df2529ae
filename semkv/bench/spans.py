"""Where each prompt token's KV came from, per request and per cluster type (realized spans).

A reuse request's prompt splits into four parts::

    | vLLM local prefix | external span: donor tokens (copied, some shifted) + computed gaps |
    | computed by vLLM after the span |

Donor and in-span computed counts come from the worker-confirmed ``vllm:semkv_span_tokens``
deltas around the request (incremented only when the worker reported the span's blocks
loaded), never from the plan the scheduler made: a plan that failed midway is recomputed by vLLM
and counts as vLLM's. For exact and token-swap hits (no span plan) every loaded token is a donor
token and nothing is computed inside the span.

Each realized request also carries its plan's class (``semkv.plan_class``, from the provenance
summary), counted per cluster type, and the TTFT gain the cost gate predicted for its plan,
read against the gain measured over the same arm's own miss (``semkv.bench.gain``).

Comparisons per cluster type: TTFT against the same arm's own miss of the same prompt (free of
engine-to-engine drift, as the speed table's "vs own miss"), TTFT against the exact tier's arm
on the same prompt, quality against cold, and the response-cache baseline (the best cold
answer any labelled donor of the target gave, scored against the target's cold answer).
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from semkv.bench.gain import gain_errors
from semkv.bench.results import Run

SPAN = "vllm:semkv_span_tokens"
REALIZE = "vllm:semkv_realize_seconds"
EXACT_ARM = "materialize_exact:chunks"  # the exact tier's arm: what realization must beat


def span_fields(run: Run, loaded: int, exact_run: Run | None) -> dict[str, Any]:
    """Row fields of one reuse request (counts and times only)."""
    copied = int(run.delta.get(f"{SPAN}:copied"))
    computed = int(run.delta.get(f"{SPAN}:computed"))
    local = int(run.summary.get("local_prefix_tokens") or 0)
    plan = run.summary.get("span") or {}
    return {
        "local_prefix_tokens": local,
        "donor_tokens": loaded - computed,  # = copied on a realized span, loaded otherwise
        "span_copied_tokens": copied,
        "span_shifted_tokens": int(run.delta.get(f"{SPAN}:shifted")),
        "span_computed_tokens": computed,
        "vllm_computed_tokens": run.prompt_tokens - local - loaded,
        "span_donors": int(plan.get("donors") or 0),
        "span_segments": int(plan.get("segments") or 0),
        "plan_class": plan.get("class"),  # semkv.plan_class; None: no realized span
        "predicted_gain": plan.get("predicted_gain"),  # the cost gate's; None: not priced
        "realize_s": run.delta.get(f"{REALIZE}:sum") or None,
        "exact_arm_ttft_s": exact_run.ttft_s if exact_run is not None else None,
        # > 1: this arm's first token came sooner than the exact tier's on the same prompt
        "speedup_vs_exact_arm": exact_run.ttft_s / run.ttft_s if exact_run is not None else None,
    }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _rate(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def _present(rows: list[dict[str, Any]], key: str) -> list[Any]:
    return [r[key] for r in rows if r.get(key) is not None]


def span_by_kind(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One arm's rows -> per cluster type: token sources, TTFT ratios, quality, baselines."""
    out: dict[str, dict[str, Any]] = {}
    for kind in sorted({r["kind"] for r in rows}):
        rs = [r for r in rows if r["kind"] == kind]
        out[kind] = {
            "targets": len(rs), "hits": sum(r["hit"] for r in rs),
            "realized": sum(r.get("span_copied_tokens", 0) > 0 for r in rs),
            # realized requests per plan class (the engine's label of the plan's shape)
            "plan_classes": dict(sorted(Counter(
                r["plan_class"] for r in rs
                if r.get("plan_class") and r.get("span_copied_tokens", 0) > 0).items())),
            "prompt_tokens": sum(r["prompt_tokens"] for r in rs),
            **{key: sum(r.get(key, 0) for r in rs)
               for key in ("local_prefix_tokens", "donor_tokens", "span_shifted_tokens",
                           "span_computed_tokens", "vllm_computed_tokens")},
            "speedup_vs_own_miss_median": _median(_present(rs, "speedup_vs_own_miss")),
            "speedup_vs_exact_arm_median": _median(_present(rs, "speedup_vs_exact_arm")),
            "realize_ms_median": _median([1e3 * s for s in _present(rs, "realize_s")]),
            # the cost gate: predicted gain vs measured over the same arm's own miss
            "cost_gate": gain_errors((r.get("predicted_gain"), r.get("speedup_vs_own_miss"))
                                     for r in rs if r.get("span_copied_tokens", 0) > 0),
            "exact_match_rate": _rate([r["exact_match"] for r in rs]),
            "rouge_l_median": _median([r["rouge_l"] for r in rs]),
            "response_cache_exact_match_rate": _rate(_present(rs, "response_cache_exact_match")),
            "response_cache_rouge_l_median": _median(_present(rs, "response_cache_rouge_l")),
            "false_positive_rate": (_rate([r["false_positive"] for r in rs])
                                    if rs[0]["negative"] else None),
        }
    return out
