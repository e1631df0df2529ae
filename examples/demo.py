"""The main job: a real vLLM CPU engine on the bundled SmolLM2 model with semkv's connector.

It runs a short labelled workload twice per target: cold (nothing cached anywhere), then after
its donor ran and vLLM's own prefix cache was emptied, so any reuse can only come from semkv.
It prints, per request, what reuse happened (engine-confirmed), the realized span's plan class
(or the class a gate refused), TTFT cold vs warm, vLLM's own prefix hit after the same donor
(tokens and TTFT, semkv out of the request), and the answer against cold.

The default is the recommended production setting: ``materialize_semantic`` (the exact tier,
plus realized spans of the classes the bundled model's shipped gate policy certifies), MinHash
discovery, the commit-policy scheduler. Cross-instruction targets (another system prompt before
the same document) are served from realized spans; a target that reads the donor's paragraphs
in another order (class ``one_donor_reordered``, certified only on prompts of 3,561 tokens or
more; these are ~600) is refused with its reason.

With ``--model gemma3-270m`` the engine serves Gemma 3 270M (window and full attention mixed:
several KV-cache groups under vLLM's hybrid KV-cache manager): the exact tier is served per
group, and realized spans are refused per request with their reason (``unsupported_kv_groups``).

    make demo                      # materialize_semantic, minhash
    make demo DEMO_ARGS="--mode materialize_exact --provider chunks"
    make demo DEMO_ARGS="--model gemma3-270m"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("SEMKV_LOG_LEVEL", "WARNING")


# why a realized span was refused, by the reason the connector reports (semkv.types)
REFUSALS = {"uncertified_class": "the gate policy does not certify this plan class",
            "low_predicted_gain": "the cost gate predicted too small a TTFT gain over cold",
            "allocation_failed": "its working set is over realize_memory_bytes",
            "unsupported_kv_groups": "realized spans address one KV-cache group; this model "
                                     "has window and full-attention groups"}


def workload(n_docs: int) -> list[tuple[str, str, str]]:
    """(cluster type, donor, target), built at run time from the bundled essays."""
    from semkv.assets import essays_dir

    texts = [p.read_text(errors="ignore") for p in sorted(essays_dir().glob("*.txt"))]
    docs = [t[1000:3400] for t in texts[:n_docs]]
    q1, q2 = "What is the author's main argument?", "Give one example the author uses."
    sys_a = "You are a careful reading assistant.\n\n"
    sys_b = "Answer briefly and precisely, citing the text.\n\n"
    rows = []
    for i, d in enumerate(docs):
        rows.append(("exact_control", f"{d}\n\nQ: {q1}\nA:", f"{d}\n\nQ: {q1}\nA:"))
        rows.append(("partial_overlap", f"{d}\n\nQ: {q1}\nA:", f"{d}\n\nQ: {q2}\nA:"))
        rows.append(("cross_instruction", f"{sys_a}{d}\n\nQ: {q1}\nA:",
                     f"{sys_b}{d}\n\nQ: {q1}\nA:"))
        other = docs[(i + 1) % len(docs)]
        rows.append(("negative_unrelated", f"{other}\n\nQ: {q1}\nA:", f"{d}\n\nQ: {q2}\nA:"))
        cut = d.find(". ", len(d) // 2) + 2  # a sentence boundary near the middle
        if i == 0 and cut > 1:  # the donor's halves in the other order: an uncertified class
            rows.append(("reordered_halves", f"{sys_a}{d}\n\nQ: {q1}\nA:",
                         f"{sys_a}{d[cut:]} {d[:cut]}\n\nQ: {q1}\nA:"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="materialize_semantic")
    parser.add_argument("--provider", default="minhash")
    parser.add_argument("--docs", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("bench-results/demo.json"))
    parser.add_argument("--model", default="smollm2-135m", choices=("smollm2-135m",
                                                                    "gemma3-270m"),
                        help="which bundled model the engine serves")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table
    from vllm import LLM, SamplingParams

    from semkv.bundled_model import ensure_model
    from semkv.kv_sizing import kv_cache_bytes
    from semkv.request_options import request_params
    from semkv.research.quality import rouge_l

    console = Console(width=max(Console().width, 210))  # keep the table readable in CI logs
    extra: dict[str, Any] = {"provider": args.provider, "semantic_mode": args.mode,
                             "min_reuse_tokens": 128,
                             # the demo is its own operator: a server keeps this off
                             "summary_to_client": True}
    config = {
        "kv_connector": "SemanticKVConnector", "kv_connector_module_path": "semkv_vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    semantic = args.mode == "materialize_semantic"  # REQUEST_ONLY needs the commit policy
    scheduler = {"scheduler_cls": "semkv_vllm.commit_policy.CommitPolicyScheduler"} if semantic \
        else {}
    console.print(f"[bold]semkv demo[/]: vLLM CPU, {args.model}, provider={args.provider}, "
                  f"mode={args.mode}")
    model = ensure_model(args.model)  # converted once per machine
    # KV sized from the run (4 requests of 4,096 tokens), never a fraction of the host
    llm = LLM(model=str(model), dtype="float32",
              kv_cache_memory_bytes=kv_cache_bytes(model, max_model_len=4096, max_num_seqs=4,
                                                   block_size=128),
              max_model_len=4096, block_size=128, enable_prefix_caching=True, enforce_eager=True,
              kv_transfer_config=config, disable_log_stats=False, **scheduler)
    first = SamplingParams(temperature=0.0, max_tokens=1)
    answer = SamplingParams(temperature=0.0, max_tokens=24)

    # semkv out of a request (request options): vLLM's own prefix cache alone serves it
    out_of_it = SamplingParams(temperature=0.0, max_tokens=1, extra_args={
        "kv_transfer_params": request_params(lookup=False, save=False)})

    def ttft(prompt: str, params: Any = first) -> tuple[float, Any]:
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        return time.perf_counter() - start, out

    llm.generate(["warm-up: the engine's first forward is always cold"], first, use_tqdm=False)
    rows = []
    for cluster, donor, target in workload(args.docs):
        llm.reset_prefix_cache(reset_connector=True)
        cold_s, _ = ttft(target)
        cold = llm.generate([target], answer, use_tqdm=False)[0].outputs[0]
        llm.reset_prefix_cache(reset_connector=True)
        llm.generate([donor], out_of_it, use_tqdm=False)
        own_s, own = ttft(target, out_of_it)  # vLLM's own prefix hit, for comparison
        llm.reset_prefix_cache(reset_connector=True)
        llm.generate([donor], first, use_tqdm=False)
        llm.reset_prefix_cache()  # vLLM forgets the donor; semkv's store keeps it
        warm_s, out = ttft(target)
        llm.reset_prefix_cache()
        warm = llm.generate([target], answer, use_tqdm=False)[0].outputs[0]
        rows.append({"cluster": cluster, "cold_ttft_s": cold_s, "warm_ttft_s": warm_s,
                     "vllm_hit_ttft_s": own_s, "vllm_hit_tokens": own.num_cached_tokens,
                     "same_answer_as_cold": warm.text == cold.text,
                     "rouge_l_vs_cold": rouge_l(list(warm.token_ids), list(cold.token_ids)),
                     **out.kv_transfer_params["semkv"]})

    table = Table(title="What reuse did (each target: after its donor, vLLM's own cache emptied)")
    for col in ("cluster", "provenance", "plan class", "reason", "reused tok", "cold TTFT",
                "semkv TTFT", "speedup", "vLLM hit (tok, TTFT)", "answer = cold", "ROUGE-L"):
        table.add_column(col)
    for r in rows:
        span, refused = r.get("span") or {}, r.get("span_refused") or {}
        table.add_row(r["cluster"], r["provenance"], span.get("class") or refused.get("class")
                      or "-", r["fallback_reason"] or "-", str(r["external_tokens"]),
                      f"{r['cold_ttft_s']:.2f}s", f"{r['warm_ttft_s']:.2f}s",
                      f"{r['cold_ttft_s'] / r['warm_ttft_s']:.1f}x",
                      f"{r['vllm_hit_tokens']}, {r['vllm_hit_ttft_s']:.2f}s",
                      "yes" if r["same_answer_as_cold"] else "no", f"{r['rouge_l_vs_cold']:.2f}")
    console.print(table)
    realized = [r for r in rows if r["provenance"] == "request_only_semantic_reuse"]
    if realized:
        speedup = statistics.median(r["cold_ttft_s"] / r["warm_ttft_s"] for r in realized)
        same = sum(r["same_answer_as_cold"] for r in realized)
        rouge = statistics.median(r["rouge_l_vs_cold"] for r in realized)
        console.print(f"realized spans: {len(realized)} served (request-only), median TTFT "
                      f"{speedup:.1f}x, answers equal to cold {same}/{len(realized)}, median "
                      f"ROUGE-L vs cold {rouge:.2f}")
    for r in rows:
        if r.get("span_refused"):
            reason = r["span_refused"]["reason"]
            why = REFUSALS.get(reason, "refused")
            console.print(f"refused: {r['cluster']} plan class {r['span_refused']['class']}: "
                          f"{reason} ({why}; vLLM's own prefill served it)")
    hits = [r for r in rows if r["provenance"] in ("exact_external_kv_hit",
                                                   "request_only_semantic_reuse")]
    overall = statistics.median(r["cold_ttft_s"] / r["warm_ttft_s"] for r in rows)
    hit_only = statistics.median(r["cold_ttft_s"] / r["warm_ttft_s"] for r in hits) if hits else 0.0
    def labels(m: Any) -> str:
        return ",".join(v for k, v in m.labels.items() if k not in ("model_name", "engine"))

    metrics = {m.name + ":" + labels(m): getattr(m, "value", None)
               for m in llm.get_metrics() if m.name.startswith("vllm:semkv_")}
    console.print(f"hits {len(hits)}/{len(rows)}; median TTFT speedup overall {overall:.1f}x, "
                  f"hit-only {hit_only:.1f}x; loaded tokens (engine-confirmed): "
                  f"{metrics.get('vllm:semkv_loaded_tokens:', 0)}")
    if hits:
        own = statistics.median(r["warm_ttft_s"] / r["vllm_hit_ttft_s"] for r in hits)
        console.print(f"semkv's hits against vLLM's own prefix hit after the same donor: median "
                      f"TTFT ratio {own:.2f}x (semkv / vLLM; vLLM's own hits "
                      f"{statistics.median(r['vllm_hit_tokens'] for r in hits):.0f} tokens)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"model": args.model, "rows": rows, "metrics": metrics},
                                    indent=2))
    console.print(f"raw JSON: {args.json}")


if __name__ == "__main__":
    main()
