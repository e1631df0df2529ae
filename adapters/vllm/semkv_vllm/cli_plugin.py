"""The vLLM adapter's ``semkv`` plugin: the commands that drive an engine (``semkv bench``).

Declared in this distribution's ``[project.entry-points.semkv]``, the way every provider
registers itself. It is loaded wherever semkv's plugin host loads (the CLI, and any process that
resolves a provider, the engine's among them), so its top imports nothing heavy;
what a command runs is imported inside the command.
"""

from __future__ import annotations

import argparse
import sys

import semkv


def _cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from semkv.bench import preset

    try:
        config = preset(args.preset, arms=tuple(args.arms) if args.arms else None,
                        kinds=tuple(args.kinds) if args.kinds else None,
                        clusters_per_type=args.clusters, target_tokens=args.target_tokens,
                        max_tokens=args.max_tokens, concurrency=args.concurrency,
                        seed=args.seed, cores=args.cores)
    except ValueError as exc:
        print(f"semkv bench: {exc}", file=sys.stderr)
        return 2
    from semkv.eval import WorkloadSizeError
    from semkv_vllm.bench import run_bench

    out = Path(args.out or f"bench-results/bench-{config.preset}")
    try:
        result = run_bench(config, out, show_progress=not args.no_progress,
                           plots=not args.no_plots,
                           describe=lambda arm: print(f"semkv bench: arm {arm}", file=sys.stderr))
    except WorkloadSizeError as exc:  # before any engine starts: the corpora are too small
        print(f"semkv bench: {exc}", file=sys.stderr)
        return 2
    print((out / "bench.md").read_text())
    print(f"raw JSON: {out / 'bench.json'}; plots: {', '.join(result['plots']) or 'none'}")
    return 0


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser(
        "bench", help="speed and quality of every mode and provider on the vLLM CPU engine")
    bench.add_argument("--preset", default="quick",
                       help="quick (9 min measured on 2 shared cores), full (est. 20-30 min), "
                            "realized (realized spans beside the exact tier, est. 11-20 min), "
                            "frontier or frontier-long (docs/frontier.md)")
    bench.add_argument("--arms", nargs="+",
                       help="override the preset's arms (semkv.bench.config: ARMS, FRONTIER_ARMS)")
    bench.add_argument("--kinds", nargs="+", help="override the preset's cluster kinds")
    bench.add_argument("--clusters", type=int, help="clusters per cluster type")
    bench.add_argument("--target-tokens", type=int, help="approximate prompt length")
    bench.add_argument("--max-tokens", type=int, help="greedy output tokens per answer")
    bench.add_argument("--concurrency", type=int, help="requests in flight (throughput phase)")
    bench.add_argument("--seed", type=int, help="workload seed")
    bench.add_argument("--cores", help="VLLM_CPU_OMP_THREADS_BIND for every engine (default 0)")
    bench.add_argument("--out", help="output folder (default bench-results/bench-<preset>)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    bench.set_defaults(func=_cmd_bench)


@semkv.hookimpl
def register_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``semkv bench`` (and, once it exists, ``semkv calibrate``)."""
    _add_bench(subparsers)
