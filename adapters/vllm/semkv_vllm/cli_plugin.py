"""The vLLM adapter's ``semkv`` plugin: the commands that drive an engine (``semkv bench``,
``semkv calibrate``).

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
                        seed=args.seed, cores=args.cores, model=args.model, dtype=args.dtype)
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
    bench.add_argument("--model", help="a bundled model's name (smollm2-135m, the default; "
                                       "gemma3-270m) or a model folder")
    bench.add_argument("--dtype", help="compute dtype (default: float32 for a bundled model, "
                                       "else the model's own)")
    bench.add_argument("--cores", help="VLLM_CPU_OMP_THREADS_BIND for every engine (default 0)")
    bench.add_argument("--out", help="output folder (default bench-results/bench-<preset>)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    bench.set_defaults(func=_cmd_bench)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from dataclasses import replace
    from pathlib import Path

    from semkv_vllm.bench.calibrate import CalibrateError, Options, calibrate, parse_engine_arg

    def fail(why: object) -> int:
        print(f"semkv calibrate: {why}", file=sys.stderr)
        return 2

    try:
        opts = Options(
            model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
            block_size=args.block_size, max_model_len=args.max_model_len,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            engine_args=dict(parse_engine_arg(a) for a in args.engine_arg or ()),
            prompts=Path(args.prompts) if args.prompts else None, donors=args.donors,
            target_tokens=args.target_tokens, targets_per_kind=args.targets_per_kind,
            max_tokens=args.max_tokens, min_samples=args.min_samples, min_gain=args.min_gain,
            seed=args.seed, cores=args.cores, out=Path(args.out),
            show_progress=not args.no_progress)
        if args.kinds:
            opts = replace(opts, kinds=tuple(args.kinds))
        if args.strategies:
            opts = replace(opts, strategies=tuple(args.strategies))
        opts.validate()  # before anything heavy is imported
        result = calibrate(opts, command=" ".join(["semkv", *sys.argv[1:]]))
    except CalibrateError as exc:
        return fail(exc)
    policy = result["policy"]
    print(result["table"])
    print()
    served = [c.value for c in policy.served_classes()] or ["none"]
    print(f"served: {', '.join(served)}; wall time {result['wall_s']:.0f} s "
          f"({result['wall_s'] / 60:.1f} min)")
    print(f"gate policy: {result['out']}; raw rows: {result['rows_out']}")
    print(f'add to kv_connector_extra_config: "gate_policy": "{Path(result["out"]).resolve()}"')
    return 0


def _add_calibrate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from semkv.bench.config import STRATEGIES
    from semkv.calibrate import MIN_GAIN, MIN_SAMPLES
    from semkv.calibrate_prompts import DONORS
    from semkv_vllm.bench.calibrate import DEFAULT_KINDS, DEFAULT_STRATEGIES

    cmd = sub.add_parser(
        "calibrate", help="certify plan classes for your model and engine: a gate policy file",
        description=(
            "Measure the quality frontier of realized spans on your model with the engine "
            "arguments you serve with (one in-process vLLM engine), per plan class and "
            "recompute strategy, against the fp8-KV floor of the same run, and write the gate "
            "policy the connector loads with \"gate_policy\": \"<file>\" (docs/calibrate.md). "
            "A class is served with the cheapest strategy whose mean KL from cold is at or "
            "below the floor's on the same targets and whose median TTFT gain is at least "
            "--min-gain; a class with fewer than --min-samples targets is refused."))
    eng = cmd.add_argument_group("engine (as vllm serve takes them)")
    eng.add_argument("--model", help="model folder or cached Hugging Face id "
                                     "(default: the bundled SmolLM2-135M-Instruct)")
    eng.add_argument("--dtype", help="compute dtype (default: float32 for the bundled model, "
                                     "else auto)")
    eng.add_argument("--kv-cache-dtype", default="auto", help="KV cache dtype (default auto)")
    eng.add_argument("--block-size", type=int, help="KV block size (default: vLLM's)")
    eng.add_argument("--max-model-len", type=int,
                     help="default: the longest prompt plus its answer, in whole blocks")
    eng.add_argument("--kv-cache-memory-bytes", type=int,
                     help="default: 4 requests of --max-model-len (semkv kv-cache-bytes)")
    eng.add_argument("--engine-arg", action="append", metavar="KEY=VALUE",
                     help="any other LLM() argument, repeatable; VALUE is JSON where it "
                          "parses (enforce_eager=false, max_num_batched_tokens=4096)")
    work = cmd.add_argument_group("prompts")
    work.add_argument("--prompts", metavar="FILE.jsonl",
                      help='your prompts, one JSON object a line: {"prompt": str, "group": '
                           'str (optional), "id": str (optional)}; a prompt reuses from the '
                           "earlier prompts of its group (default: the bundled workloads)")
    work.add_argument("--donors", type=int, default=DONORS,
                      help=f"--prompts: earlier prompts a target may reuse (default {DONORS})")
    work.add_argument("--kinds", nargs="+",
                      help=f"bundled workload kinds (default: {' '.join(DEFAULT_KINDS)})")
    work.add_argument("--target-tokens", type=int, default=1024,
                      help="bundled workloads: approximate prompt length (default 1024)")
    work.add_argument("--targets-per-kind", type=int, default=8,
                      help="bundled workloads: targets per kind (default 8)")
    dec = cmd.add_argument_group("measurement and decision")
    dec.add_argument("--strategies", nargs="+",
                     help=f"recompute strategies measured (default: "
                          f"{' '.join(DEFAULT_STRATEGIES)}; known: {' '.join(STRATEGIES)})")
    dec.add_argument("--max-tokens", type=int, default=32,
                     help="greedy answer tokens per request, teacher forced for KL (default 32)")
    dec.add_argument("--min-samples", type=int, default=MIN_SAMPLES,
                     help=f"fewest targets to certify a class (default {MIN_SAMPLES})")
    dec.add_argument("--min-gain", type=float, default=MIN_GAIN,
                     help=f"least median TTFT gain over cold (default {MIN_GAIN}, "
                          "realize_min_gain's default)")
    dec.add_argument("--seed", type=int, default=0, help="bundled workloads' seed")
    cmd.add_argument("--cores", help="VLLM_CPU_OMP_THREADS_BIND (default: every core)")
    cmd.add_argument("--out", default="semkv-gate-policy.json",
                     help="the policy file (default semkv-gate-policy.json); the raw rows are "
                          "written beside it as <stem>.rows.json")
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar")
    cmd.set_defaults(func=_cmd_calibrate)


@semkv.hookimpl
def register_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``semkv bench`` and ``semkv calibrate``."""
    _add_bench(subparsers)
    _add_calibrate(subparsers)
