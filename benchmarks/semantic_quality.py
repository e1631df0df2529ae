"""Quality of request-only (verified / semantic) reuse on the real engine, per cluster type.

One vLLM CPU engine on the bundled model, ``CommitPolicyScheduler``, ``materialize_semantic``
with permissive gates (both non-exact tiers, ``min_similarity`` from ``--min-similarity``), so
every candidate the provider finds is served and the gates can be chosen from the result:
1. every donor of a labelled workload runs (and is stored);
2. every target runs after vLLM's own prefix cache was emptied: whatever it reuses comes from
   semkv (its tier, served tokens and token agreement are recorded);
3. everything is reset and every target and donor runs cold.
Quality of each reused answer is measured against the target's cold answer (greedy, same
length): exact match, first divergence, ROUGE-L F1 and token F1 over output tokens. The
response-cache baseline scores the DONOR's cold answer against the target's cold answer (what
serving the cached response would give). Negative controls must never be served.

    .venv/bin/python benchmarks/semantic_quality.py --clusters 4 --target-tokens 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

CONNECTOR = {"kv_connector": "SemanticKVConnector",
             "kv_connector_module_path": "semkv_vllm.connector",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def build_engine(extra: dict[str, Any], max_len: int) -> Any:
    from vllm import LLM

    from semkv.bundled_model import ensure_model
    from semkv.kv_sizing import bundled_kv_cache_bytes

    return LLM(model=str(ensure_model()), dtype="float32",
               kv_cache_memory_bytes=bundled_kv_cache_bytes(max_model_len=max_len,
                                                            max_num_seqs=4, block_size=32),
               max_model_len=max_len, block_size=32, enable_prefix_caching=True,
               enforce_eager=True, seed=0,
               scheduler_cls="semkv_vllm.commit_policy.CommitPolicyScheduler",
               kv_transfer_config=dict(CONNECTOR, kv_connector_extra_config={
                   "summary_to_client": True, **extra}))  # its own operator: reads summaries


def run(llm: Any, text: str, max_tokens: int) -> tuple[list[int], dict[str, Any]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([text], sp, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), (out.kv_transfer_params or {}).get("semkv", {})


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    med = statistics.median
    out: dict[str, Any] = {}
    for kind in sorted({r["kind"] for r in rows}):
        rs = [r for r in rows if r["kind"] == kind]
        served = [r for r in rs if r["tier"] in ("verified", "semantic")]
        entry: dict[str, Any] = {
            "targets": len(rs), "served": len(served),
            "tiers": dict(Counter(r["tier"] or r["fallback_reason"] for r in rs)),
            "response_cache_rouge_l_median": med(r["response_cache_rouge_l"] for r in rs),
        }
        if served:
            entry.update({
                "exact_match_rate": sum(r["exact_match"] for r in served) / len(served),
                "rouge_l_median": med(r["rouge_l"] for r in served),
                "token_f1_median": med(r["token_f1"] for r in served),
                "first_divergence_median": med(r["first_divergence"] for r in served),
                "agreement_median": med(r["similarity"] for r in served),
                "reused_tokens_median": med(r["external_tokens"] for r in served),
            })
        out[kind] = entry
    for tier in ("verified", "semantic"):
        served = [r for r in rows if r["tier"] == tier]
        if served:
            out[f"tier:{tier}"] = {
                "served": len(served), "rouge_l_median": med(r["rouge_l"] for r in served),
                "exact_match_rate": sum(r["exact_match"] for r in served) / len(served),
                "response_cache_rouge_l_median": med(r["response_cache_rouge_l"] for r in served),
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clusters", type=int, default=4)
    parser.add_argument("--target-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--min-similarity", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--provider", default="minhash")
    parser.add_argument("--out", type=Path, default=Path("bench-results/semantic_quality.json"))
    args = parser.parse_args()
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from semkv.bundled_model import ensure_model
    from semkv.eval import build_workload
    from semkv.research.quality import first_divergence, rouge_l, token_f1

    tok = AutoTokenizer.from_pretrained(str(ensure_model()))
    wl = build_workload(args.seed, clusters_per_type=args.clusters,
                        target_tokens=args.target_tokens, tokenizer=tok.encode)
    extra = {"provider": args.provider, "semantic_mode": "materialize_semantic",
             "semantic_tiers": ["verified", "semantic"], "min_similarity": args.min_similarity,
             "realize_spans": False,  # this script measures the token swap
             "min_reuse_tokens": 64, "verified_min_reuse_tokens": 64,
             "semantic_min_reuse_tokens": 64, "donor_store_bytes": "2GiB"}
    llm = build_engine(extra, max_len=2 * args.target_tokens + 512)
    for d in tqdm(wl.donors, desc="donors"):
        run(llm, d.text, 1)
    reused: dict[str, tuple[list[int], dict[str, Any]]] = {}
    for t in tqdm(wl.targets, desc="targets (reuse)"):
        llm.reset_prefix_cache()  # vLLM forgets; semkv's store keeps the donors
        reused[t.prompt_id] = run(llm, t.text, args.max_tokens)
    cold: dict[str, list[int]] = {}
    for p in tqdm([*wl.targets, *wl.donors], desc="cold"):
        llm.reset_prefix_cache(reset_connector=True)
        cold[p.prompt_id] = run(llm, p.text, args.max_tokens)[0]
    rows = []
    for t in wl.targets:
        out, summary = reused[t.prompt_id]
        ref = cold[t.prompt_id]
        donor_answer = cold.get(t.true_donor_id or "", [])
        rows.append({
            "prompt_id": t.prompt_id, "kind": t.kind.value, "tier": summary.get("tier"),
            "fallback_reason": summary.get("fallback_reason"),
            "external_tokens": summary.get("external_tokens", 0),
            "confirmed_loaded_tokens": summary.get("confirmed_loaded_tokens", 0),
            "similarity": summary.get("similarity"), "exact_match": out == ref,
            "first_divergence": first_divergence(out, ref), "rouge_l": rouge_l(out, ref),
            "token_f1": token_f1(out, ref),
            "response_cache_rouge_l": rouge_l(donor_answer, ref) if donor_answer else 0.0,
        })
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
              "summary": summarize(rows)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))
    print(f"raw JSON: {args.out}")


if __name__ == "__main__":
    main()
