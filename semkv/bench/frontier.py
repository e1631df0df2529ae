"""Rows of the quality-vs-recompute frontier of realized spans (``--preset frontier``).

The engine loop that produces the requests is the vLLM adapter's (``semkv_vllm.bench.frontier``,
which documents the protocol); this module is the engine-free part: which donors a target is
labelled with, what a request costs the run, and the row of one request scored against the cold
run of the same prompt (greedy agreement, ROUGE-L, per-position KL from cold on the teacher
forced cold answer, tokens copied / computed / recomputed, the plan's class, TTFT, and the
cost gate's predicted TTFT gain beside the measured one).

NOTE: rows hold counts, times and scores only, never token ids or text.
"""

from __future__ import annotations

import statistics
from typing import Any

from semkv.bench.config import FLOOR, STRATEGIES, BenchConfig
from semkv.bench.results import Run
from semkv.bench.workload import Workload
from semkv.research.quality import coarse_kl, first_divergence, rouge_l, top_margin

TOP = 20  # log-probs per position (vLLM's default max_logprobs)
NEAR_TIE = 0.25  # nats: a greedy flip where cold's top-1 minus top-2 is below this is a tie
OFF = {"lookup": False, "save": False}  # the cold arm's request options
SPAN = "vllm:semkv_span_tokens"


def donors_of(wl: Workload, target: str) -> list[str]:
    listed = wl.donor_ids.get(target) or []
    one = wl.donor_of.get(target)
    return listed or ([one] if one else [])


def served(run: Run) -> bool:
    """The request was served from a realized span (request-only semantic reuse)."""
    return run.summary.get("provenance") == "request_only_semantic_reuse"


def teacher_scores(dists: list[dict[int, float] | None], cold: list[dict[int, float] | None],
                   answer: list[int]) -> dict[str, Any]:
    """KL from cold per position and the cold answer's log-likelihood, where both scored."""
    kls, lls, cold_lls = [], [], []
    for tok, d, c in zip(answer, dists, cold, strict=True):
        if d is None or c is None or tok not in d or tok not in c:
            continue
        kls.append(coarse_kl(c, d))
        lls.append(d[tok])
        cold_lls.append(c[tok])
    return {"scored_positions": len(kls),
            "kl_mean": statistics.fmean(kls) if kls else None,
            "kl_max": max(kls) if kls else None,
            "answer_logprob": statistics.fmean(lls) if lls else None,
            "logprob_delta": (statistics.fmean(lls) - statistics.fmean(cold_lls)) if lls
            else None}


def row(target: str, wl: Workload, arm: str, run: Run, cold: Run,
        cold_dists: list[dict[int, float] | None], teacher: dict[str, Any] | None,
        response_cache: float | None) -> dict[str, Any]:
    """One request's row: counts, times and scores against ``cold`` (the same prompt, cold)."""
    div = first_divergence(run.output, cold.output)
    diverged = run.output != cold.output
    margin = None
    if diverged and div < len(cold_dists) and cold_dists[div] is not None:
        margin = top_margin(cold_dists[div])  # type: ignore[arg-type]
    prompt = run.prompt_tokens
    copied = int(run.delta.get(f"{SPAN}:copied"))
    loaded = int(run.summary.get("confirmed_loaded_tokens") or 0)
    donor_tokens = loaded if arm == FLOOR else copied
    return {
        "target": target, "kind": wl.kind[target], "negative": wl.negative[target], "arm": arm,
        "prompt_tokens": prompt, "provenance": run.summary.get("provenance"),
        "tier": run.summary.get("tier"), "fallback_reason": run.summary.get("fallback_reason"),
        "served": served(run) or (arm == FLOOR and loaded > 0),
        "donor_tokens": donor_tokens, "donor_fraction": donor_tokens / prompt if prompt else 0.0,
        "computed_in_span": int(run.delta.get(f"{SPAN}:computed")),
        "span_donors": (run.summary.get("span") or {}).get("donors"),
        "span_segments": (run.summary.get("span") or {}).get("segments"),
        # the plan's shape (semkv.plan_class), as the engine labelled it; None: no span
        "plan_class": (run.summary.get("span") or {}).get("class"),
        # a plan the engine made and refused (a gate, its memory bound, its own limits)
        "refused_class": (run.summary.get("span_refused") or {}).get("class"),
        "refused_reason": (run.summary.get("span_refused") or {}).get("reason"),
        "recomputed": int(run.delta.get(f"{SPAN}:recomputed")),
        "ttft_s": run.ttft_s, "cold_ttft_s": cold.ttft_s,
        "speedup": cold.ttft_s / run.ttft_s if run.ttft_s > 0 else None,
        # the cost gate's prediction of that speedup for the plan (None: no span, not priced)
        "predicted_gain": (run.summary.get("span") or {}).get("predicted_gain"),
        "exact_match": not diverged, "rouge_l": rouge_l(run.output, cold.output),
        "first_divergence": div if diverged else None, "cold_margin_at_divergence": margin,
        "response_cache_rouge_l": response_cache,
        **(teacher or {"scored_positions": 0, "kl_mean": None, "kl_max": None,
                       "answer_logprob": None, "logprob_delta": None}),
    }


def planned_requests(config: BenchConfig, wl: Workload, arms: tuple[str, ...]) -> int:
    """Progress-bar total of a frontier run: every request it will send (warm-up aside)."""
    strategies = sum(a in STRATEGIES for a in arms)
    total = 0
    for t in wl.targets:
        total += len(donors_of(wl, t)) + 1
        total += 1 if wl.negative[t] else 2 * strategies + (2 if FLOOR in arms else 0)
    return total
