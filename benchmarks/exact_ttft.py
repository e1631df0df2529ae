"""TTFT of an exact-tier semkv hit vs vLLM's own prefix-cache hit vs cold, at several lengths.

One run, three engines on the bundled model (vLLM CPU), all alive and used in turn so that
machine load drifts hit all alike, all bound to the same cores (``VLLM_CPU_OMP_THREADS_BIND``,
default core 0):
- ``plain``: no connector. ``cold`` = a never-seen prompt; ``vllm_hit`` = the same prompt again
  (vLLM's own prefix cache, the ceiling of KV reuse);
- ``idle``: the connector with ``semantic_mode: disabled`` (vLLM's connector plumbing only);
- ``semkv`` (materialize_exact, provider chunks): ``miss`` = the SAME never-seen prompt
  (discovery runs, the donor is saved); ``semkv_hit`` = the same prompt after vLLM's own cache
  was emptied (every reused token comes from semkv's store); ``vllm_hit`` again for reference.
Cold, idle and miss run on the same prompt back to back, their order rotating per repetition,
so ``miss/cold`` is a paired ratio, split into vLLM's plumbing (idle/cold) and semkv's work
(miss/idle). ``semkv share`` is semkv's own time on a miss's critical path over the miss TTFT:
every scheduler-side hook (``vllm:semkv_scheduler_seconds``, lookups included) plus the time a
step waited for a donor save (``save_wait_seconds``; with ``async_save`` off, the whole
``save_seconds``). It is the overhead attributable to semkv, free of engine-to-engine noise.
``save_bg`` is the background copy (``async_save``), off the critical path. After every
measurement the benchmark pauses ``--settle`` seconds so that a background copy never runs
beside another engine's measurement.
TTFT = wall time of a 1-token generation, one request at a time. Medians over ``--reps``
different documents per length. Prints a table and writes raw JSON.

    .venv/bin/python benchmarks/exact_ttft.py --lengths 1024 2048 4096 7168 --reps 4
    .venv/bin/python benchmarks/exact_ttft.py --lengths 1024 --reps 12 --semkv-first
    .venv/bin/python benchmarks/exact_ttft.py --lengths 7168 --reps 3 --hit-reps 8 --skip-cold
    .venv/bin/python benchmarks/exact_ttft.py --lengths 2048 --reps 12 --readme-config

``--readme-config``: the semkv engine runs the README's connector config (``materialize_semantic``,
MinHash at its defaults, realized spans; every request's prefix looked up in the exact prefix
index beside the provider), so ``miss/cold`` is what an operator's miss costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

CONNECTOR = {"kv_connector": "SemanticKVConnector",
             "kv_connector_module_path": "semkv_vllm.connector",
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


def ttft(llm: Any, prompt: str, options: dict[str, Any] | None = None, *,
         fresh: bool = False) -> tuple[float, dict[str, Any]]:
    """Wall time of a 1-token generation and the request's semkv summary. ``options``: semkv
    request options (``kv_transfer_params``); ``fresh``: vLLM's own prefix cache emptied
    first, so every token is semkv's or computed."""
    from vllm import SamplingParams

    from semkv.request_options import request_params

    extra = None if options is None else {"kv_transfer_params": request_params(**options)}
    params = SamplingParams(temperature=0.0, max_tokens=1, extra_args=extra)
    if fresh:
        llm.reset_prefix_cache()
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    elapsed = time.perf_counter() - start
    time.sleep(SETTLE)  # a background donor save must not run beside the next measurement
    return elapsed, {"prompt_tokens": len(out.prompt_token_ids),
                                         **((out.kv_transfer_params or {}).get("semkv", {}))}


COMMIT_POLICY = "semkv_vllm.commit_policy.CommitPolicyScheduler"  # as the README serves


def build(extra: dict[str, Any] | None, max_len: int) -> Any:
    from vllm import LLM

    from semkv.bundled_model import ensure_model
    from semkv.kv_sizing import bundled_kv_cache_bytes

    kw: dict[str, Any] = dict(model=str(ensure_model()), dtype="float32",
                              kv_cache_memory_bytes=bundled_kv_cache_bytes(
                                  max_model_len=max_len, max_num_seqs=4),
                              max_model_len=max_len, enable_prefix_caching=True, enforce_eager=True,
                              disable_log_stats=False)  # semkv_seconds reads the metrics
    if extra is not None:
        # the benchmark reads each request's summary: it is its own operator
        kw["kv_transfer_config"] = dict(CONNECTOR, kv_connector_extra_config={
            "summary_to_client": True, **extra})
        if extra.get("semantic_mode") == "materialize_semantic":  # request-only loads need it
            kw["scheduler_cls"] = COMMIT_POLICY
    return LLM(**kw)


SETTLE = 0.5
SEMKV = {"provider": "chunks", "semantic_mode": "materialize_exact", "donor_store_bytes": "4GiB"}
CRITICAL = ("vllm:semkv_scheduler_seconds", "vllm:semkv_save_wait_seconds")


def readme_extra_config() -> dict[str, Any]:
    """The README's ``kv_connector_extra_config``: what an operator runs."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.test_readme_defaults import readme_extra_config as read

    return read()


def readme_config() -> dict[str, Any]:
    """The README's config, with room to keep every donor of the run."""
    return {**readme_extra_config(), "donor_store_bytes": SEMKV["donor_store_bytes"]}


def semkv_seconds(llm: Any, names: tuple[str, ...] = CRITICAL) -> float:
    """semkv's own time so far in the named histograms (default: its critical-path time)."""
    return sum(float(m.sum) for m in llm.get_metrics() if m.name in names and hasattr(m, "sum"))


def measure_pair(plain: Any, idle: Any, semkv: Any, prompt: str, rep: int,
                 hit_reps: int = 1, skip_cold: bool = False) -> dict[str, Any]:
    """One repetition: cold, idle and miss on the same fresh prompt (order rotating), then hits.

    Hits are cheap next to a miss, so ``hit_reps`` pairs of (semkv hit, vLLM hit) are measured
    on the semkv engine per prompt; ``skip_cold`` measures the miss only (for hit studies).
    """
    engines = [("miss", semkv)] if skip_cold else [("cold", plain), ("idle", idle),
                                                    ("miss", semkv)]
    order = engines[rep % len(engines) :] + engines[: rep % len(engines)]
    row: dict[str, Any] = {"rep": rep, "order": [name for name, _ in order]}
    spent = semkv_seconds(semkv)
    copied = semkv_seconds(semkv, ("vllm:semkv_save_seconds",))
    info: dict[str, dict[str, Any]] = {}
    for name, llm in order:
        row[name], info[name] = ttft(llm, prompt)
    miss_info = info["miss"]
    # The miss's background save is waited for (if still running) and counted in the next step
    # on the semkv engine, the hit below; so the window runs to the end of that hit and also
    # holds the hit's own (small) scheduler time: an upper bound on the miss's share.
    row["tokens"] = miss_info["prompt_tokens"]
    row["miss_provenance"] = miss_info.get("provenance")
    if not skip_cold:
        row["plain_vllm_hit"], _ = ttft(plain, prompt)
    row["semkv_hits"], row["vllm_hits"], row["load_seconds"] = [], [], []
    for i in range(hit_reps):
        semkv.reset_prefix_cache()
        loading = semkv_seconds(semkv, ("vllm:semkv_load_seconds",))
        hit, summary = ttft(semkv, prompt)
        row["semkv_hits"].append(hit)
        row["load_seconds"].append(semkv_seconds(semkv, ("vllm:semkv_load_seconds",)) - loading)
        if i == 0:
            row["miss_semkv_seconds"] = semkv_seconds(semkv) - spent
            row["miss_save_bg_seconds"] = (
                semkv_seconds(semkv, ("vllm:semkv_save_seconds",)) - copied)
            row["semkv_reused_tokens"] = summary.get("external_tokens", 0)
            row["semkv_provenance"] = summary.get("provenance")
        row["vllm_hits"].append(ttft(semkv, prompt)[0])
    row["semkv_hit"], row["vllm_hit"] = row["semkv_hits"][0], row["vllm_hits"][0]
    return row


def main() -> None:
    global SETTLE
    # All engines get the same cores. Left to vLLM's "auto", the first engine of a process is
    # bound to one core (one reserved) and the second to all: an unfair comparison.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 7168])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--settle", type=float, default=SETTLE,
                        help="seconds to pause after every measurement")
    parser.add_argument("--hit-reps", type=int, default=1,
                        help="(semkv hit, vLLM hit) pairs measured per prompt")
    parser.add_argument("--skip-cold", action="store_true",
                        help="measure the miss and the hits only (no cold / idle engines)")
    parser.add_argument("--semkv-first", action="store_true",
                        help="build the semkv engine first (default: plain, idle, semkv)")
    parser.add_argument("--readme-config", action="store_true",
                        help="the semkv engine runs the README's connector config (read from "
                             "README.md) instead of materialize_exact with chunks")
    parser.add_argument("--out", type=Path, default=Path("bench-results/exact_ttft.json"))
    args = parser.parse_args()
    SETTLE = args.settle
    from transformers import AutoTokenizer

    from semkv.bundled_model import ensure_model

    tok = AutoTokenizer.from_pretrained(str(ensure_model()))
    max_len = max(args.lengths) + 256
    prompts = {n: prompts_of_length(tok, n, args.reps, "t") for n in args.lengths}
    results: dict[str, Any] = {"lengths": args.lengths, "reps": args.reps,
                               "hit_reps": args.hit_reps, "skip_cold": args.skip_cold,
                               "semkv_first": args.semkv_first, "rows": {}}
    # NOTE: the order engines are built in biases them (~10 % at 1K on this machine, the last
    # one slowest): --semkv-first reverses it, so the two orders together counterbalance it.
    configs = {"plain": None, "idle": {"semantic_mode": "disabled"},
               "semkv": readme_config() if args.readme_config else SEMKV}
    results["semkv_config"] = configs["semkv"]
    names = ["semkv"] if args.skip_cold else ["plain", "idle", "semkv"]
    if args.semkv_first:
        names.reverse()
    engines = {name: build(configs[name], max_len) for name in names}
    plain, idle, semkv = engines.get("plain"), engines.get("idle"), engines["semkv"]
    for llm in engines.values():
        ttft(llm, "warm-up prompt: the engine's first forward is always cold")
    for n in args.lengths:
        results["rows"][n] = [measure_pair(plain, idle, semkv, p, rep, args.hit_reps,
                                           args.skip_cold) for rep, p in enumerate(prompts[n])]

    med = statistics.median
    print(f"{'tokens':>7} {'cold s':>8} {'miss s':>8} {'vllm hit':>9} {'semkv hit':>10} "
          f"{'miss/cold':>10} {'idle/cold':>10} {'miss/idle':>10} {'semkv share':>12} "
          f"{'semkv/vllm hit':>15} {'paired':>7} {'load s':>7} {'cold/semkv':>11}")
    summary = {}
    for n in args.lengths:
        rows = results["rows"][n]
        keys = ["miss", "vllm_hit", "semkv_hit"] + ([] if args.skip_cold else
                                                    ["cold", "plain_vllm_hit"])
        row: dict[str, Any] = {k: med(r[k] for r in rows) for k in keys}
        pairs = [s / v for r in rows for s, v in zip(r["semkv_hits"], r["vllm_hits"],
                                                      strict=True)]
        row["semkv_hit_over_vllm_hit_paired_median"] = med(pairs)
        row["hit_pairs"] = len(pairs)
        row["semkv_hits_median"] = med(h for r in rows for h in r["semkv_hits"])
        row["vllm_hits_median"] = med(h for r in rows for h in r["vllm_hits"])
        row["load_seconds_median"] = med(x for r in rows for x in r["load_seconds"])
        row["semkv_share_of_miss"] = med(r["miss_semkv_seconds"] / r["miss"] for r in rows)
        row["save_bg_seconds"] = med(r["miss_save_bg_seconds"] for r in rows)
        row["semkv_hit_over_vllm_hit"] = row["semkv_hit"] / row["vllm_hit"]
        if not args.skip_cold:
            row["miss_over_cold_paired_median"] = med(r["miss"] / r["cold"] for r in rows)
            row["idle_over_cold_paired_median"] = med(r["idle"] / r["cold"] for r in rows)
            row["miss_over_idle_paired_median"] = med(r["miss"] / r["idle"] for r in rows)
            row["miss_over_cold"] = row["miss"] / row["cold"]
            row["cold_over_semkv_hit"] = row["cold"] / row["semkv_hit"]
        summary[n] = row

        def f(key: str, fmt: str, width: int, row: dict[str, Any] = row) -> str:
            return f"{row[key]:>{width}{fmt}}" if key in row else f"{'-':>{width}}"

        print(f"{n:>7} {f('cold', '.3f', 8)} {row['miss']:>8.3f} {row['vllm_hit']:>9.3f} "
              f"{row['semkv_hit']:>10.3f} {f('miss_over_cold_paired_median', '.3f', 10)} "
              f"{f('idle_over_cold_paired_median', '.3f', 10)} "
              f"{f('miss_over_idle_paired_median', '.3f', 10)} "
              f"{row['semkv_share_of_miss']:>12.4f} {row['semkv_hit_over_vllm_hit']:>15.3f} "
              f"{row['semkv_hit_over_vllm_hit_paired_median']:>7.3f} "
              f"{row['load_seconds_median']:>7.3f} {f('cold_over_semkv_hit', '.1f', 11)}")
    results["summary"] = summary
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"raw JSON: {args.out}")


if __name__ == "__main__":
    main()
