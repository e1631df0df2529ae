"""The ``semkv`` command line: plugins, config, model-path, kv-cache-bytes, bench."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _cmd_plugins(_args: argparse.Namespace) -> int:
    from semkv.plugins import plugin_versions

    print(json.dumps(plugin_versions(), indent=2))
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from semkv.config import ConfigError, SemkvConfig
    from semkv.plugins import UnknownProviderError, get_provider_class
    from semkv.types import Mode

    extra = json.loads(args.extra_config) if args.extra_config else {}
    if args.file:
        extra["config_file"] = args.file
    try:
        config = SemkvConfig.load(extra)
        if config.semantic_mode is not Mode.DISABLED:
            provider_cls = get_provider_class(config.provider)
            provider_cls.Config.model_validate(config.provider_config)
    except (ConfigError, UnknownProviderError, ValueError) as exc:
        print(f"semkv: {exc}", file=sys.stderr)
        return 2
    print(config.model_dump_json(indent=2))
    return 0


def _cmd_model_path(_args: argparse.Namespace) -> int:
    from semkv.bundled_model import ensure_model

    print(ensure_model())
    return 0


def _cmd_kv_cache_bytes(args: argparse.Namespace) -> int:
    from semkv.kv_sizing import kv_cache_bytes

    if args.model is None:
        from semkv.bundled_model import ensure_model

        args.model = str(ensure_model())
    try:
        print(kv_cache_bytes(args.model, max_model_len=args.max_model_len,
                             max_num_seqs=args.max_num_seqs, block_size=args.block_size,
                             dtype=args.kv_dtype))
    except ValueError as exc:
        print(f"semkv kv-cache-bytes: {exc}", file=sys.stderr)
        return 2
    return 0


def _add_kv_cache_bytes(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from semkv import kv_sizing

    cmd = sub.add_parser(
        "kv-cache-bytes",
        help="bytes of KV cache for --kv-cache-memory-bytes: the model's KV per token x the "
             "tokens the run keeps (max-num-seqs x max-model-len, whole blocks)")
    cmd.add_argument("--model", help="model folder with config.json (default: the bundled one)")
    cmd.add_argument("--max-model-len", type=int, default=kv_sizing.DEFAULT_MAX_MODEL_LEN)
    cmd.add_argument("--max-num-seqs", type=int, default=kv_sizing.DEFAULT_MAX_NUM_SEQS,
                     help="requests resident at full length at once")
    cmd.add_argument("--block-size", type=int, default=kv_sizing.DEFAULT_BLOCK_SIZE)
    cmd.add_argument("--kv-dtype", default="float32", help="the KV cache's dtype")
    cmd.set_defaults(func=_cmd_kv_cache_bytes)


def _cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from semkv.bench import preset, run_bench

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


def _add_bench(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = sub.add_parser(
        "bench", help="speed and quality of every mode and provider on the vLLM CPU engine")
    bench.add_argument("--preset", default="quick",
                       help="quick (9 min measured on 2 shared cores), full (est. 20-30 min) or "
                            "realized (realized spans beside the exact tier, est. 11-20 min)")
    bench.add_argument("--arms", nargs="+", help="override the preset's arms (see semkv.bench)")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="semkv", description="Semantic KV-cache reuse SDK.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plugins", help="installed providers with versions, as JSON").set_defaults(
        func=_cmd_plugins
    )
    config = sub.add_parser("config", help="validate and print the effective config")
    config.add_argument("--extra-config", help="JSON as given in kv_connector_extra_config")
    config.add_argument("--file", help="a YAML config file")
    config.set_defaults(func=_cmd_config)
    sub.add_parser(
        "model-path", help="local folder of the converted bundled model (converts if missing)"
    ).set_defaults(func=_cmd_model_path)
    _add_kv_cache_bytes(sub)
    _add_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
