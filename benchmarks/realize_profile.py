"""Where a realized request's time goes: lookup, scheduler-side planning, waiting, worker compute
per kind, the tail (issue #25).

One in-process vLLM CPU engine on the bundled model (the frontier engine's connector config:
MinHash discovery, realized spans, ``gate_policy: ungated`` so every plan class is served),
one request at a time. Per target: its labelled donors are stored, the target runs cold
(lookup and saving off), then realized under each ``--strategies`` arm twice: once plain (its
TTFT, from vLLM's request stats) and once under ``cProfile`` (where the time went; the profiler
slows Python-heavy parts, so its shares, not its seconds, are the result).

The engine runs in this thread (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): scheduler, worker and
forward are all in the profile. The provider's lookup runs on semkv's lookup thread (outside the
profile): it comes from ``vllm:semkv_lookup_seconds`` instead. Phases (cumulative seconds of
the functions named in ``PHASES``; a phase's own sub-phases are subtracted from it):

- ``schedule``: vLLM's scheduler step, semkv's scheduler-side hooks inside it (of which ``plan``:
  ``SpanAdmission.plan``);
- ``forward``: vLLM's model forward (the tail after the span, and the decode);
- ``realize``: the worker's realization steps, split into ``read`` (donor and local K/V into the
  dense cache, re-rotation), ``compute`` (the layer runner's calls: gaps and recomputed tokens),
  ``deviation`` (blend's ranking), ``write`` (into the request's blocks, the finiteness check);
- ``other``: the rest of the request's wall time (output processing, idle steps).

    nice -n 19 .venv/bin/python benchmarks/realize_profile.py --kinds multi_passage_rag \\
        cross_instruction --clusters 2 --target-tokens 1850

Prints a table per kind and strategy (medians), writes raw JSON (numbers only) to ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

# phase -> (file suffix, function name) whose cumulative time is the phase's
PHASES: dict[str, list[tuple[str, str]]] = {
    "schedule": [("v1/core/sched/scheduler.py", "schedule")],
    "semkv_scheduler": [("semkv_vllm/connector.py", "get_num_new_matched_tokens"),
                        ("semkv_vllm/connector.py", "update_state_after_alloc"),
                        ("semkv_vllm/connector.py", "build_connector_meta"),
                        ("semkv_vllm/connector.py", "update_connector_output")],
    "plan": [("semkv_vllm/span_admission.py", "plan")],
    "forward": [("v1/worker/gpu_model_runner.py", "_model_forward")],
    "realize": [("semkv_vllm/realization.py", "advance")],
    "read": [("semkv_vllm/realization.py", "_read"), ("semkv/realize/span.py", "place_layer")],
    "compute": [("semkv/realize/recompute.py", "layer_calls")],
    "deviation": [("semkv/realize/recompute.py", "deviation")],
    "write": [("semkv_vllm/realization.py", "write"), ("semkv_vllm/realization.py", "finite")],
    "steps": [("v1/engine/core.py", "step")],
}
STRATEGIES = {"none": {"strategy": "none"},
              "first_k16": {"strategy": "first_k", "first_k": 16},
              "first_k16+blend15": {"strategy": "first_k_blend", "first_k": 16,
                                    "fraction": 0.15}}


def cumulative(stats: pstats.Stats) -> dict[str, tuple[float, int]]:
    """Per phase: summed cumulative seconds and primitive calls of its functions."""
    out: dict[str, tuple[float, int]] = {}
    table: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    for phase, names in PHASES.items():
        seconds, calls = 0.0, 0
        for (path, _, func), (primitive, _, _, ct, _) in table.items():
            if any(path.endswith(suffix) and func == name for suffix, name in names):
                seconds, calls = seconds + ct, calls + primitive
        out[phase] = (seconds, calls)
    return out


def breakdown(phases: dict[str, tuple[float, int]], wall: float) -> dict[str, float]:
    """Exclusive seconds per phase (sub-phases subtracted from their parents)."""
    s = {k: v[0] for k, v in phases.items()}
    realize_parts = s["read"] + s["compute"] + s["deviation"]
    return {
        "wall": wall,
        "schedule_vllm": max(0.0, s["schedule"] - s["semkv_scheduler"]),
        "semkv_scheduler": max(0.0, s["semkv_scheduler"] - s["plan"]),
        "plan": s["plan"],
        "forward": s["forward"],
        "realize_read": s["read"],
        "realize_compute": s["compute"],
        "realize_deviation": s["deviation"],
        "realize_other": max(0.0, s["realize"] - realize_parts),
        "write": s["write"],
        "other": max(0.0, wall - s["schedule"] - s["forward"] - s["realize"] - s["write"]),
        "engine_steps": float(phases["steps"][1]),
    }


def profiled(llm: Any, ids: list[int], options: dict[str, Any], max_tokens: int,
             ) -> tuple[Any, dict[str, float]]:
    from semkv_vllm.bench.engine import generate

    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    run = generate(llm, ids, max_tokens, options)
    profile.disable()
    wall = time.perf_counter() - started
    return run, breakdown(cumulative(pstats.Stats(profile)), wall)


def delta_seconds(run: Any, name: str) -> float:
    return float(run.delta.get(f"vllm:semkv_{name}:sum"))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from semkv_vllm.bench.engine import configure_process, generate, open_engine
    from semkv_vllm.bench.frontier import donors_of, engine_arm, most_donors

    from semkv.bench.config import preset
    from semkv.bench.frontier import OFF
    from semkv.bench.workload import load_workload

    config = preset("frontier", kinds=tuple(args.kinds), clusters_per_type=args.clusters,
                    target_tokens=args.target_tokens, max_tokens=args.max_tokens,
                    cores=args.cores)
    configure_process(config.cores)
    wl = load_workload(config)
    arm = engine_arm(config, most_donors(wl))
    rows: list[dict[str, Any]] = []
    with open_engine(arm, config, max_num_seqs=1) as llm:
        generate(llm, list(range(100, 164)), 2)  # the first forward of an engine is slow
        for t in [t for t in wl.targets if not wl.negative[t]]:
            ids = wl.ids[t]
            llm.reset_prefix_cache(reset_connector=True)
            for d in donors_of(wl, t):
                generate(llm, wl.ids[d], 1, {"lookup": False})
            llm.reset_prefix_cache()
            cold = generate(llm, ids, args.max_tokens, OFF)
            for name in args.strategies:
                option = {"recompute": STRATEGIES[name]}
                llm.reset_prefix_cache()
                plain = generate(llm, ids, args.max_tokens, option)
                llm.reset_prefix_cache()
                run, parts = profiled(llm, ids, option, args.max_tokens)
                summary = plain.summary
                rows.append({
                    "kind": wl.kind[t], "strategy": name, "prompt_tokens": len(ids),
                    "donors": len(donors_of(wl, t)),
                    "provenance": summary.get("provenance"),
                    "loaded_tokens": int(summary.get("confirmed_loaded_tokens") or 0),
                    "plan_class": (summary.get("span") or {}).get("class"),
                    "cold_ttft_s": cold.ttft_s, "ttft_s": plain.ttft_s,
                    "speedup": cold.ttft_s / plain.ttft_s if plain.ttft_s else None,
                    "lookup_s": delta_seconds(plain, "lookup_seconds"),
                    "realize_s": delta_seconds(plain, "realize_seconds"),
                    "scheduler_s": delta_seconds(plain, "scheduler_seconds"),
                    "profiled": parts, "profiled_ttft_s": run.ttft_s,
                })
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "profiled"}),
                      flush=True)
    return {"config": config.as_dict(), "strategies": list(args.strategies), "rows": rows}


def report(raw: dict[str, Any]) -> None:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in raw["rows"]:
        groups[(r["kind"], r["strategy"])].append(r)
    keys = ["schedule_vllm", "semkv_scheduler", "plan", "forward", "realize_read",
            "realize_compute", "realize_deviation", "realize_other", "write", "other"]
    print("\nmedians; phase columns: share of the profiled request's wall time")
    print("| kind | strategy | n | served | tokens | cold TTFT | TTFT | speedup | lookup | "
          "realize (worker) | steps | " + " | ".join(keys) + " |")
    print("|" + "---|" * (12 + len(keys)))
    for (kind, strategy), rs in sorted(groups.items()):
        med = statistics.median
        served = sum(r["provenance"] == "request_only_semantic_reuse" for r in rs)
        shares = [med([r["profiled"][k] / r["profiled"]["wall"] for r in rs]) for k in keys]
        print(f"| {kind} | {strategy} | {len(rs)} | {served} | "
              f"{med([r['prompt_tokens'] for r in rs]):.0f} | "
              f"{med([r['cold_ttft_s'] for r in rs]):.2f} s | "
              f"{med([r['ttft_s'] for r in rs]):.2f} s"
              f" | {med([r['speedup'] for r in rs]):.2f}x | "
              f"{med([r['lookup_s'] for r in rs]) * 1e3:.1f} ms | "
              f"{med([r['realize_s'] for r in rs]):.2f} s | "
              f"{med([r['profiled']['engine_steps'] for r in rs]):.0f} | "
              + " | ".join(f"{s:.0%}" for s in shares) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kinds", nargs="+", default=["multi_passage_rag", "cross_instruction"])
    p.add_argument("--clusters", type=int, default=2)
    p.add_argument("--target-tokens", type=int, default=1850)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--strategies", nargs="+", default=["first_k16", "first_k16+blend15"],
                   choices=sorted(STRATEGIES))
    p.add_argument("--cores", default="0-1")
    p.add_argument("--out", type=Path, default=Path("bench-results/realize_profile.json"))
    args = p.parse_args()
    raw = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(raw, indent=1))
    report(raw)


if __name__ == "__main__":
    main()
