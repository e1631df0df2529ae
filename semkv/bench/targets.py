"""The issue's targets, checked against a run's rows and arm summaries.

- exact tier: outputs identical to vLLM's own prefix-hit outputs on 100% of its hits, and
  agreement with cold no lower than vLLM's own prefix hit's;
- misses cost under 2% TTFT (the paired ratio against the disabled arm, and semkv's own share
  of the miss from its timing histograms, which engine-to-engine drift does not touch);
- the semantic tier may be on by default only where its median ROUGE-L against the target's
  cold output is >= 0.9 AND clearly above the response-cache baseline (by ``CLEAR_MARGIN``),
  with zero false positives on negative controls;
- the wrong-donor control: forced donors must show damage in the quality metrics.
"""

from __future__ import annotations

from typing import Any

from semkv.bench.summary import median

MISS_BUDGET = 1.02
SEMANTIC_ROUGE_L = 0.9
CLEAR_MARGIN = 0.05  # "clearly above" the response-cache baseline: at least this much ROUGE-L
# mean log-probability per answer token this much below cold counts as damage
WRONG_DONOR_LOGPROB = -0.1


def _exact_tier(rows: list[dict[str, Any]], arms: dict[str, Any]) -> dict[str, Any]:
    hits = [r for r in rows if r["hit"] and r["tier"] == "exact" and r["arm"] != "disabled"]
    base = arms["disabled"].get("vllm_prefix_hit", {})
    same = sum(r["same_as_vllm_hit"] for r in hits)
    cold_rate = sum(r["exact_match"] for r in hits) / len(hits) if hits else None
    vllm_rate = base.get("same_as_cold_rate")
    return {
        "exact_hits": len(hits), "identical_to_vllm_hit": same,
        "identical_rate": same / len(hits) if hits else None,
        "agreement_with_cold": cold_rate, "vllm_hit_agreement_with_cold": vllm_rate,
        "met": bool(hits) and same == len(hits)
        and (cold_rate is not None and vllm_rate is not None and cold_rate >= vllm_rate),
    }


def _miss_cost(arms: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, s in arms.items():
        miss = s.get("miss")
        if name == "disabled" or not miss:
            continue
        ratio, share = miss["over_cold_median"], miss["semkv_share_median"]
        out[name] = {"paired_ttft_ratio": ratio, "semkv_share": share,
                     "met_ratio": ratio is not None and ratio < MISS_BUDGET,
                     "met_semkv_share": share is not None and share < MISS_BUDGET - 1.0}
    return out


def _semantic(rows: list[dict[str, Any]], arms: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, s in arms.items():
        if s["arm"]["mode"] != "materialize_semantic" or name == "wrong_donor":
            continue
        served = [r for r in rows if r["arm"] == name and r["hit"]
                  and r["tier"] in ("verified", "semantic")]
        rouge = median([r["rouge_l"] for r in served])
        baseline = median([r["response_cache_rouge_l"] for r in served
                           if r["response_cache_rouge_l"] is not None])
        fp = s["false_positive_rate"]
        reasons = []
        if not served:
            reasons.append("no target was served by a non-exact tier")
        if rouge is not None and rouge < SEMANTIC_ROUGE_L:
            reasons.append(f"median ROUGE-L {rouge:.2f} < {SEMANTIC_ROUGE_L}")
        if rouge is not None and baseline is not None and rouge < baseline + CLEAR_MARGIN:
            reasons.append(f"median ROUGE-L {rouge:.2f} not clearly above the response-cache "
                           f"baseline {baseline:.2f} (margin {CLEAR_MARGIN})")
        if fp:
            reasons.append(f"false-positive rate {fp:.2f} on negative controls")
        out[name] = {"served_non_exact": len(served), "rouge_l_median": rouge,
                     "response_cache_rouge_l_median": baseline, "false_positive_rate": fp,
                     "default_on": not reasons, "reasons_off": reasons}
    return out


def _wrong_donor(rows: list[dict[str, Any]]) -> dict[str, Any]:
    rs = [r for r in rows if r["arm"] == "wrong_donor"]
    # exact hits (a shared system prompt) load the target's own KV: only non-exact ones are forced
    forced = [r for r in rs if r["hit"] and r["tier"] in ("verified", "semantic")]
    rouge = median([r["rouge_l"] for r in forced])
    delta = median([r["logprob_delta"] for r in forced if r["logprob_delta"] is not None])
    comparable = median([r["logprob_delta"] for r in forced
                         if r["logprob_delta"] is not None and r["logprob_span_matches"]])
    return {
        "targets": len(rs), "forced_through": len(forced),
        "exact_match_rate": (sum(r["exact_match"] for r in forced) / len(forced)
                             if forced else None),
        "rouge_l_median": rouge, "logprob_delta_median": delta,
        "logprob_delta_median_same_span": comparable,
        # damage is detected when the forced answers drift from cold by these metrics
        "damage_detected": bool(forced) and (
            (rouge is not None and rouge < SEMANTIC_ROUGE_L)
            or (delta is not None and delta < WRONG_DONOR_LOGPROB)),
    }


def check_targets(rows: list[dict[str, Any]], arms: dict[str, Any]) -> dict[str, Any]:
    return {"exact_tier": _exact_tier(rows, arms), "miss_cost": _miss_cost(arms),
            "semantic_tier": _semantic(rows, arms), "wrong_donor": _wrong_donor(rows)}
