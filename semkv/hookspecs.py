"""The plugin seam: the hooks through which a distribution adds providers and CLI commands.

A distribution declares an entry point in the ``semkv`` group that names a module with
``semkv.hookimpl``-decorated functions::

    [project.entry-points.semkv]
    my_provider = "my_package.plugin"

    # my_package/plugin.py
    import semkv

    @semkv.hookimpl
    def register_providers(register):
        register(MyProvider)          # registered under MyProvider.name

    @semkv.hookimpl
    def register_commands(subparsers):
        cmd = subparsers.add_parser("my-command", help="...")
        cmd.set_defaults(func=lambda args: 0)   # returns the exit status

Built-in providers and the vLLM adapter (``semkv bench``) register exactly this way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import argparse

hookspec = pluggy.HookspecMarker("semkv")
hookimpl = pluggy.HookimplMarker("semkv")


@hookspec
def register_providers(register: Callable[..., None]) -> None:
    """Call ``register(provider_class)`` (or ``register(cls, name=...)``) for each provider."""


@hookspec
def register_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``semkv`` subcommands: ``subparsers.add_parser(name, ...)`` for each, with
    ``set_defaults(func=...)``, a function of the parsed arguments returning the exit status.
    Keep it cheap: import what a command runs inside its function, not here."""
