"""The ``semkv`` command line: plugins, config, model-path."""

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
