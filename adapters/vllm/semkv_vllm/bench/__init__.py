"""``semkv bench``'s engine driver: every arm of a run on the real vLLM CPU engine.

Protocol::

    from semkv.bench import preset
    from semkv_vllm.bench import run_bench

    result = run_bench(preset("quick"), out_dir=Path("bench-results/bench-quick"))
    result["arms"]["materialize_exact:chunks"]["speedup_hit_only"]

One run builds a labelled workload (``semkv.bench.workload``), runs it through one engine per
arm (``semkv.bench.config.ARMS``: disabled, discovery_only, materialize_exact,
materialize_semantic per provider, and a wrong-donor control; ``semkv_vllm.bench.runner``) or,
for the frontier presets, through one engine whose arms are request options
(``semkv_vllm.bench.frontier``), and writes ``bench.json`` (raw rows and summaries),
``bench.md`` (tables) and PNG plots to ``out_dir``. What is engine-free (presets, workloads,
rows, summaries, targets, reports) is the core's ``semkv.bench``; this package is what needs an
engine, and the ``semkv bench`` command comes from this distribution's plugin
(``semkv_vllm.cli_plugin``). Heavy libraries (vLLM, torch, matplotlib) are imported only inside
the functions that run the engine or draw.

NOTE: rows carry counts, times and scores only: never prompt text or token ids.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from semkv.bench.config import BenchConfig

__all__ = ["run_bench"]


def _machine() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{os.cpu_count()} CPUs visible, load average {load:.1f} at start "
            f"(shared machine: other processes may compete for the same cores)")


def run_bench(config: BenchConfig, out_dir: Path, *, show_progress: bool = True,
              plots: bool = True, describe: Callable[[str], Any] | None = None,
              command: str | None = None) -> dict[str, Any]:
    """Run every arm of ``config`` and write JSON, markdown and plots into ``out_dir``."""
    config.validate()
    from semkv_vllm.bench.engine import configure_process

    configure_process(config.cores)  # before vLLM is imported anywhere below
    from semkv.bench.summary import build_rows, summarize_arm
    from semkv.bench.targets import check_targets
    from semkv.bench.workload import load_workload
    from semkv_vllm.bench.runner import run_all

    started = time.time()
    machine = _machine()
    wl = load_workload(config)
    if config.runner == "frontier":
        return _frontier(config, wl, out_dir, show_progress=show_progress, plots=plots,
                         command=command, started=started, machine=machine)
    results = run_all(config, wl, show_progress=show_progress, describe=describe)
    rows = build_rows(results, wl)
    arms = {name: summarize_arm(name, res, rows) for name, res in results.items()}
    result: dict[str, Any] = {
        "command": command or " ".join(["semkv", *sys.argv[1:]]),
        "config": config.as_dict(),
        "machine": machine,
        "python": platform.python_version(),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": time.time() - started,
        "load_average_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "workload": {"targets": len(wl.targets), "donors": len(wl.donors),
                     "kinds": sorted(set(wl.kind.values()))},
        "arms": arms,
        "targets": check_targets(rows, arms),
        "rows": rows,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    from semkv.bench.report import markdown
    from semkv.bench.report import plots as draw

    result["plots"] = [str(p) for p in draw(result, out_dir)] if plots else []
    (out_dir / "bench.json").write_text(json.dumps(result, indent=2))
    (out_dir / "bench.md").write_text(markdown(result))
    return result


def _frontier(config: BenchConfig, wl: Any, out_dir: Path, *, show_progress: bool, plots: bool,
              command: str | None, started: float, machine: str) -> dict[str, Any]:
    """The frontier runner's result: rows, per kind and arm summaries, targets, plot."""
    from semkv.bench import frontier_report as report
    from semkv_vllm.bench.frontier import run_frontier

    raw = run_frontier(config, wl, show_progress=show_progress)
    summary = report.summarize(raw["rows"])
    result: dict[str, Any] = {
        "command": command or " ".join(["semkv", *sys.argv[1:]]),
        "config": config.as_dict(), "machine": machine, "python": platform.python_version(),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": time.time() - started,
        "load_average_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "workload": {"targets": len(wl.targets), "donors": len(wl.donors),
                     "kinds": sorted(set(wl.kind.values()))},
        "engine": raw["engine"], "summary": summary,
        "negatives": report.negatives(raw["rows"]),
        "request_only_violations": raw["request_only_violations"],
        "targets": report.check(summary, raw["rows"], raw["request_only_violations"]),
        "rows": raw["rows"],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(result, indent=2))  # before any plot fails
    result["plots"] = [str(p) for p in report.plot(result, out_dir)] if plots else []
    (out_dir / "bench.json").write_text(json.dumps(result, indent=2))
    (out_dir / "bench.md").write_text(report.markdown(result))
    return result
