"""The ``semkv`` command line: plugins, config, model-path, kv-cache-bytes, and plugins' commands.

The core's own commands need no engine. Plugins add theirs through the ``register_commands``
hook (``semkv.hookspecs``): the vLLM adapter (distribution ``semkv-vllm``) adds ``semkv bench``.
A command that comes with a distribution that is not installed (or not loaded) still parses and
says which distribution to install (``ADAPTER_COMMANDS``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

# commands that plugins of semkv's own distributions add -> the distribution to install
ADAPTER_COMMANDS = {"bench": "semkv-vllm", "calibrate": "semkv-vllm"}
_MISSING = "missing_command"  # set on the placeholder of a command no loaded plugin adds


def _cmd_plugins(args: argparse.Namespace) -> int:
    from semkv.plugins import plugin_commands, plugin_versions

    print(json.dumps(plugin_commands() if args.commands else plugin_versions(), indent=2))
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


def _cmd_model_path(args: argparse.Namespace) -> int:
    from semkv.bundled_model import ensure_model

    print(ensure_model(args.model))
    return 0


def _cmd_kv_cache_bytes(args: argparse.Namespace) -> int:
    from semkv.bundled_model import DEFAULT, MODELS, ensure_model
    from semkv.kv_sizing import kv_cache_bytes

    if args.model is None or args.model in MODELS:  # a bundled model, by name
        args.model = str(ensure_model(args.model or DEFAULT))
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
    cmd.add_argument("--model", help="model folder with config.json, or a bundled model's name "
                                     "(smollm2-135m, the default; gemma3-270m)")
    cmd.add_argument("--max-model-len", type=int, default=kv_sizing.DEFAULT_MAX_MODEL_LEN)
    cmd.add_argument("--max-num-seqs", type=int, default=kv_sizing.DEFAULT_MAX_NUM_SEQS,
                     help="requests resident at full length at once")
    cmd.add_argument("--block-size", type=int, default=kv_sizing.DEFAULT_BLOCK_SIZE)
    cmd.add_argument("--kv-dtype", default="float32", help="the KV cache's dtype")
    cmd.set_defaults(func=_cmd_kv_cache_bytes)


def _cmd_missing(args: argparse.Namespace) -> int:
    """A command no loaded plugin adds: which distribution to install, and why it is missing."""
    import importlib.metadata

    from semkv import plugins

    command = getattr(args, _MISSING)
    dist = ADAPTER_COMMANDS[command]

    def say(line: str) -> None:
        print(f"semkv {command}: {line}", file=sys.stderr)

    say(f"this command comes with the vLLM adapter; install it: pip install {dist}")
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return 2
    broken = plugins.load_errors()
    if plugins.excluded(dist):
        say(f"{dist} {version} is installed, but SEMKV_LOAD_PLUGINS="
            f"{os.environ.get('SEMKV_LOAD_PLUGINS', '')!r} leaves its plugin out")
    elif broken:
        for plugin, why in broken.items():
            say(f"plugin {plugin!r} failed to load ({why})")
    else:
        say(f"the installed {dist} {version} does not add it (pip install -U {dist})")
    return 2


def _add_missing(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    for command, dist in ADAPTER_COMMANDS.items():
        if command not in sub.choices:
            # add_help=False: `semkv bench --help` also says what to install
            sub.add_parser(command, add_help=False, help=f"(needs {dist}: pip install {dist})"
                           ).set_defaults(func=_cmd_missing, **{_MISSING: command})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="semkv", description="Semantic KV-cache reuse SDK.")
    sub = parser.add_subparsers(dest="command", required=True)
    plugins = sub.add_parser("plugins", help="installed providers with versions, as JSON")
    plugins.add_argument("--commands", action="store_true",
                         help="the commands plugins add instead, with their distributions")
    plugins.set_defaults(func=_cmd_plugins)
    config = sub.add_parser("config", help="validate and print the effective config")
    config.add_argument("--extra-config", help="JSON as given in kv_connector_extra_config")
    config.add_argument("--file", help="a YAML config file")
    config.set_defaults(func=_cmd_config)
    from semkv.bundled_model import DEFAULT, MODELS

    model_path = sub.add_parser(
        "model-path", help="local folder of a converted bundled model (converts if missing)")
    model_path.add_argument("--model", choices=sorted(MODELS), default=DEFAULT,
                            help=f"which bundled model (default {DEFAULT})")
    model_path.set_defaults(func=_cmd_model_path)
    _add_kv_cache_bytes(sub)
    from semkv.plugins import add_commands

    add_commands(sub)  # every plugin's register_commands hook, after the core's own
    _add_missing(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not hasattr(args, _MISSING):  # a missing command's arguments are not checked
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
