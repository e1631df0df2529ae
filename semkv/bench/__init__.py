"""``semkv bench``'s engine-free half: presets, workloads, rows, summaries, targets, reports.

What a run measures (``semkv.bench.config``: the arms, the presets), the labelled workload
tokenized (``semkv.bench.workload``), the records a run leaves (``semkv.bench.results``), and
everything computed from them: rows and per-arm summaries (``summary``, ``spans``), the issue's
targets (``targets``), the markdown and plots (``report``), and the frontier runner's rows and
report (``frontier``, ``frontier_report``).

Driving an engine is the vLLM adapter's job: ``semkv_vllm.bench.run_bench`` (distribution
``semkv-vllm``, which also adds the ``semkv bench`` command through its plugin)::

    from semkv.bench import preset
    from semkv_vllm.bench import run_bench

    result = run_bench(preset("quick"), out_dir=Path("bench-results/bench-quick"))

Nothing in this package imports vLLM or torch; matplotlib and transformers are imported only
inside the functions that draw or tokenize.

NOTE: rows carry counts, times and scores only: never prompt text or token ids.
"""

from __future__ import annotations

from semkv.bench.config import ARMS, PRESETS, BenchConfig, preset

__all__ = ["ARMS", "PRESETS", "BenchConfig", "preset"]
