"""TTFT of an exact-tier semkv hit vs vLLM's own prefix-cache hit vs cold, at several lengths.

One run, two engines on the bundled model (vLLM CPU), one after the other:
- ``plain``: no connector. ``cold`` = a never-seen prompt; ``vllm_hit`` = the same prompt again
  (vLLM's own prefix cache, the ceiling of KV reuse);
- ``semkv`` (materialize_exact, provider chunks): ``miss`` = a never-seen prompt (discovery runs,
  the donor is saved); ``semkv_hit`` = the same prompt after vLLM's own cache was emptied (every
  reused token comes from semkv's store); ``vllm_hit`` again for reference.
TTFT = wall time of a 1-token generation, one request at a time. Medians over ``--reps``
different documents per length. Prints a table of ratios and writes raw JSON.

    .venv/bin/python benchmarks/exact_ttft.py --lengths 1024 2048 4096 7168 --reps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

CONNECTOR = {"kv_connector": "SemanticKVConnector", "kv_connector_module_path": "semkv_vllm.connector",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def prompts_of_length(tokenizer: Any, length: int, reps: int, salt: str) -> list[str]:
    from semkv.assets import essays_dir

    text = "\n\n".join(p.read_text(errors="ignore") for p in sorted(essays_dir().glob("*.txt")))
    ids = tokenizer.encode(text)
    out = []
    for r in range(reps):
        start = (r * 7919 + length * 13) % max(1, len(ids) - length - 1)
        body = tokenizer.decode(ids[start : start + length - 16])
        out.append(f"[{salt}-{length}-{r}] {body}\nQuestion: what is this about?\nAnswer:")
    return out


def ttft(llm: Any, prompt: str) -> tuple[float, dict[str, Any]]:
    from vllm import SamplingParams

    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
    return time.perf_counter() - start, {"prompt_tokens": len(out.prompt_token_ids),
                                         **((out.kv_transfer_params or {}).get("semkv", {}))}


def build(extra: dict[str, Any] | None, max_len: int) -> Any:
    from vllm import LLM

    from semkv.bundled_model import ensure_model

    kw: dict[str, Any] = dict(model=str(ensure_model()), dtype="float32", gpu_memory_utilization=0.3,
                              max_model_len=max_len, enable_prefix_caching=True, enforce_eager=True)
    if extra is not None:
        kw["kv_transfer_config"] = dict(CONNECTOR, kv_connector_extra_config=extra)
    return LLM(**kw)


def measure(llm: Any, prompts: list[str], semkv: bool) -> list[dict[str, Any]]:
    rows = []
    ttft(llm, "warm-up prompt: the engine's first forward is always cold")
    for p in prompts:
        first_s, first = ttft(llm, p)
        row: dict[str, Any] = {"tokens": first["prompt_tokens"],
                               "miss" if semkv else "cold": first_s}
        if semkv:
            llm.reset_prefix_cache()
            row["semkv_hit"], summary = ttft(llm, p)
            row["semkv_reused_tokens"] = summary.get("external_tokens", 0)
            row["semkv_provenance"] = summary.get("provenance")
        row["vllm_hit"], _ = ttft(llm, p)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 7168])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench-results/exact_ttft.json"))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from semkv.bundled_model import ensure_model

    tok = AutoTokenizer.from_pretrained(str(ensure_model()))
    max_len = max(args.lengths) + 256
    plain_prompts = {n: prompts_of_length(tok, n, args.reps, "p") for n in args.lengths}
    semkv_prompts = {n: prompts_of_length(tok, n, args.reps, "s") for n in args.lengths}
    results: dict[str, Any] = {"lengths": args.lengths, "reps": args.reps, "plain": {}, "semkv": {}}
    llm = build(None, max_len)
    for n in args.lengths:
        results["plain"][n] = measure(llm, plain_prompts[n], semkv=False)
    del llm
    import gc

    gc.collect()
    llm = build({"provider": "chunks", "semantic_mode": "materialize_exact",
                 "donor_store_bytes": "4GiB"}, max_len)
    for n in args.lengths:
        results["semkv"][n] = measure(llm, semkv_prompts[n], semkv=True)

    med = statistics.median
    print(f"{'tokens':>7} {'cold s':>8} {'miss s':>8} {'vllm hit':>9} {'semkv hit':>10} "
          f"{'miss/cold':>10} {'semkv/vllm hit':>15} {'cold/semkv':>11}")
    summary = {}
    for n in args.lengths:
        p, s = results["plain"][n], results["semkv"][n]
        row = {"cold": med(r["cold"] for r in p), "miss": med(r["miss"] for r in s),
               "vllm_hit": med(r["vllm_hit"] for r in s), "semkv_hit": med(r["semkv_hit"] for r in s),
               "plain_vllm_hit": med(r["vllm_hit"] for r in p)}
        row["miss_over_cold"] = row["miss"] / row["cold"]
        row["semkv_hit_over_vllm_hit"] = row["semkv_hit"] / row["vllm_hit"]
        row["cold_over_semkv_hit"] = row["cold"] / row["semkv_hit"]
        summary[n] = row
        print(f"{n:>7} {row['cold']:>8.3f} {row['miss']:>8.3f} {row['vllm_hit']:>9.3f} "
              f"{row['semkv_hit']:>10.3f} {row['miss_over_cold']:>10.3f} "
              f"{row['semkv_hit_over_vllm_hit']:>15.3f} {row['cold_over_semkv_hit']:>11.1f}")
    results["summary"] = summary
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"raw JSON: {args.out}")


if __name__ == "__main__":
    main()
