"""Rows and aggregates of a ``semkv bench`` run: speed, engine-confirmed reuse, quality.

Every figure is computed from what the engine confirmed: a request counts as a hit only when
the worker reported loaded tokens for it (the ``vllm:semkv_loaded_tokens`` delta around the
request), never from its latency. Quality is measured against the disabled arm's cold run of
the same prompt (greedy, fixed output length) with ``semkv.research.quality``.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from semkv.bench.gain import percentile
from semkv.bench.results import ArmResult
from semkv.bench.spans import EXACT_ARM, span_by_kind, span_fields
from semkv.bench.workload import Workload
from semkv.research.quality import first_divergence, rouge_l, token_f1

LOADED = "vllm:semkv_loaded_tokens"
LOOKUP = "vllm:semkv_lookup_seconds"



def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _mean_logprob(scored: dict[int, float], positions: set[int]) -> float | None:
    return sum(scored[i] for i in positions) / len(positions) if positions else None


def _logprobs(reuse: dict[int, float], cold: dict[int, float]) -> dict[str, Any]:
    """Mean log-probability per answer token, both runs on the positions both scored."""
    common = set(reuse) & set(cold)
    mine, ref = _mean_logprob(reuse, common), _mean_logprob(cold, common)
    return {"logprob_reuse": mine, "logprob_cold": ref,
            "logprob_delta": mine - ref if mine is not None and ref is not None else None,
            "logprob_scored_tokens": len(common)}


def _values(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in rows if r[key] is not None]


def _quality(output: list[int], reference: list[int]) -> dict[str, Any]:
    return {"exact_match": output == reference,
            "first_divergence": first_divergence(output, reference),
            "rouge_l": rouge_l(output, reference), "token_f1": token_f1(output, reference)}


def _response_cache(cold: ArmResult, wl: Workload, t: str) -> dict[str, Any]:
    """A response cache serving the target a labelled donor's cold answer.

    With several labelled donors (a RAG target's passages) the best-scoring answer stands for
    the cache: an upper bound on what returning a neighbour's answer could achieve.
    """
    reference = cold.miss[t].output
    single = wl.donor_of.get(t)
    labelled = wl.donor_ids.get(t) or ([single] if single is not None else [])
    ids = [d for d in labelled if d in cold.donors]
    if not ids:
        return {"response_cache_rouge_l": None, "response_cache_exact_match": None}
    answers = [cold.donors[d].output for d in ids]
    return {"response_cache_rouge_l": max(rouge_l(a, reference) for a in answers),
            "response_cache_exact_match": any(a == reference for a in answers)}


def build_rows(results: dict[str, ArmResult], wl: Workload) -> list[dict[str, Any]]:
    """One row per (arm, target): counts, times and scores only (no text, no token ids)."""
    cold = results["disabled"]
    exact = results.get(EXACT_ARM)
    rows = []
    for name, res in results.items():
        for t, run in res.reuse.items():
            loaded = int(run.delta.get(LOADED))
            reference = cold.miss[t].output
            row: dict[str, Any] = {
                "arm": name, "mode": res.arm.mode, "provider": res.arm.provider,
                "prompt_id": t, "kind": wl.kind[t], "negative": wl.negative[t],
                "prompt_tokens": run.prompt_tokens, "output_tokens": len(run.output),
                "ttft_s": run.ttft_s, "e2e_s": run.e2e_s,
                "cold_ttft_s": cold.reuse[t].ttft_s,
                "provenance": run.summary.get("provenance"), "tier": run.summary.get("tier"),
                "fallback_reason": run.summary.get("fallback_reason"),
                "external_tokens": int(run.summary.get("external_tokens") or 0),
                "loaded_tokens": loaded, "hit": loaded > 0,
                # a negative served by a non-exact tier: KV that is not the target's own
                "false_positive": wl.negative[t] and loaded > 0
                and run.summary.get("tier") in ("verified", "semantic"),
                "would_reuse_tokens": int(run.summary.get("would_reuse_tokens") or 0),
                "similarity": run.summary.get("similarity"),
                "lookup_s": run.delta.get(f"{LOOKUP}:sum"),
                "lookups": int(run.delta.get(f"{LOOKUP}:count")),
                "semkv_s": run.delta.semkv_seconds(),
                **_quality(run.output, reference),
                "same_as_vllm_hit": run.output == cold.vllm_hit[t].output,
                **_logprobs(res.logprob[t], cold.logprob[t]),
                "logprob_run_external_tokens": int(
                    res.logprob_summary[t].get("external_tokens") or 0),
                # the log-likelihood run reused the same span as the target run (a donor longer
                # than the prompt may reach into the answer there: those deltas are not comparable)
                "logprob_span_matches": int(res.logprob_summary[t].get("external_tokens") or 0)
                == int(run.summary.get("external_tokens") or 0),
                **_response_cache(cold, wl, t),
                "donor_is_true": wl.true_donor[t],
                **span_fields(run, loaded, exact.reuse.get(t) if exact is not None else None),
            }
            if t in res.miss:
                miss = res.miss[t]
                row.update({"miss_ttft_s": miss.ttft_s, "miss_e2e_s": miss.e2e_s,
                            "speedup_vs_own_miss": miss.ttft_s / run.ttft_s,
                            "miss_semkv_s": miss.delta.semkv_seconds(),
                            "miss_cold_ttft_s": cold.miss[t].ttft_s,
                            "miss_same_as_cold": miss.output == reference})
            if name == "disabled":
                hit = cold.vllm_hit[t]
                row.update({"vllm_hit_ttft_s": hit.ttft_s,
                            "vllm_hit_same_as_cold": hit.output == reference})
            rows.append(row)
    return rows


def _dist(values: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 50), "p95": percentile(values, 95),
            "p99": percentile(values, 99)}


def _rate(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def quality_by_kind(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for kind in sorted({r["kind"] for r in rows}):
        rs = [r for r in rows if r["kind"] == kind]
        served = [r for r in rs if r["hit"]]
        rc = [r["response_cache_rouge_l"] for r in rs if r["response_cache_rouge_l"] is not None]
        out[kind] = {
            "targets": len(rs), "hits": len(served),
            "exact_match_rate": _rate([r["exact_match"] for r in rs]),
            "rouge_l_median": median([r["rouge_l"] for r in rs]),
            "token_f1_median": median([r["token_f1"] for r in rs]),
            "first_divergence_median": median([r["first_divergence"] for r in rs]),
            "logprob_delta_median": median(_values(rs, "logprob_delta")),
            "hit_rouge_l_median": median([r["rouge_l"] for r in served]),
            "hit_exact_match_rate": _rate([r["exact_match"] for r in served]),
            "response_cache_rouge_l_median": median(rc),
            "false_positive_rate": (_rate([r["false_positive"] for r in rs])
                                    if rs[0]["negative"] else None),
        }
    return out


def summarize_arm(name: str, res: ArmResult, rows: list[dict[str, Any]]) -> dict[str, Any]:
    rs = [r for r in rows if r["arm"] == name]
    hits = [r for r in rs if r["hit"]]
    negatives = [r for r in rs if r["negative"]]
    lookups = [r["lookup_s"] / r["lookups"] for r in rs if r["lookups"]]
    out_tokens = sum(r["output_tokens"] for r in rs)
    summary: dict[str, Any] = {
        "arm": res.arm.as_dict(), "targets": len(rs), "engine_start_s": res.engine_start_s,
        "ttft_s": _dist([r["ttft_s"] for r in rs]), "e2e_s": _dist([r["e2e_s"] for r in rs]),
        # concurrency 1: output tokens over the summed request wall times
        "throughput_tok_s": out_tokens / sum(r["e2e_s"] for r in rs) if rs else None,
        "speedup_overall": median([r["cold_ttft_s"] / r["ttft_s"] for r in rs]),
        "speedup_hit_only": median([r["cold_ttft_s"] / r["ttft_s"] for r in hits]),
        # the same prompt on the same engine minutes earlier, nothing stored (free of drift
        # between engines; for disabled it is a second cold run)
        "speedup_vs_own_miss": median(_values(rs, "speedup_vs_own_miss")
                                      if all("speedup_vs_own_miss" in r for r in rs) else []),
        "speedup_vs_own_miss_hit_only": median(
            [r["speedup_vs_own_miss"] for r in hits if "speedup_vs_own_miss" in r]),
        "hits": len(hits), "hit_rate": _rate([r["hit"] for r in rs]),
        "hit_rate_positives": _rate([r["hit"] for r in rs if not r["negative"]]),
        "external_tokens": sum(r["external_tokens"] for r in rs),
        "loaded_tokens": sum(r["loaded_tokens"] for r in rs),
        "would_reuse_tokens": sum(r["would_reuse_tokens"] for r in rs),
        "fallback_reasons": dict(Counter(r["fallback_reason"] or "none" for r in rs)),
        "provenance": dict(Counter(r["provenance"] or "none" for r in rs)),
        "tiers": dict(Counter(r["tier"] for r in hits)),
        "lookup_ms": {k: (v * 1e3 if v is not None else None) for k, v in _dist(lookups).items()},
        "semkv_ms_per_request": (1e3 * statistics.fmean([r["semkv_s"] for r in rs])
                                 if rs else None),
        "donor_store_bytes": res.donor_store_bytes,
        "false_positive_rate": _rate([r["false_positive"] for r in negatives]),
        "exact_match_rate": _rate([r["exact_match"] for r in rs]),
        "same_as_vllm_hit_rate_on_hits": _rate([r["same_as_vllm_hit"] for r in hits]),
        "exact_match_rate_on_hits": _rate([r["exact_match"] for r in hits]),
        "rouge_l_median": median([r["rouge_l"] for r in rs]),
        "logprob_delta_median_on_hits": median(_values(hits, "logprob_delta")),
        "quality_by_kind": quality_by_kind(rs),
        "span_by_kind": span_by_kind(rs),
    }
    misses = [r for r in rs if "miss_ttft_s" in r]
    if misses:
        summary["miss"] = {
            "ttft_s": _dist([r["miss_ttft_s"] for r in misses]),
            "over_cold_median": median([r["miss_ttft_s"] / r["miss_cold_ttft_s"]
                                        for r in misses]),
            "semkv_share_median": median([r["miss_semkv_s"] / r["miss_ttft_s"] for r in misses]),
            "same_as_cold_rate": _rate([r["miss_same_as_cold"] for r in misses]),
        }
    if res.batch:
        runs = list(res.batch.values())
        summary["concurrent"] = {
            "requests": len(runs), "wall_s": res.batch_wall_s,
            "ttft_s": _dist([r.ttft_s for r in runs]), "e2e_s": _dist([r.e2e_s for r in runs]),
            "throughput_tok_s": sum(len(r.output) for r in runs) / res.batch_wall_s,
            "requests_per_s": len(runs) / res.batch_wall_s,
        }
    if name == "disabled":
        summary["vllm_prefix_hit"] = {
            "ttft_s": _dist([r["vllm_hit_ttft_s"] for r in rs]),
            "speedup": median([r["cold_ttft_s"] / r["vllm_hit_ttft_s"] for r in rs]),
            "same_as_cold_rate": _rate([r["vllm_hit_same_as_cold"] for r in rs]),
        }
    return summary
