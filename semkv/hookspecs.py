"""The plugin seam: one hook through which a distribution registers providers by name.

A provider distribution declares an entry point in the ``semkv`` group that names a module
with a ``register_providers`` function decorated by ``semkv.hookimpl``::

    [project.entry-points.semkv]
    my_provider = "my_package.plugin"

    # my_package/plugin.py
    import semkv

    @semkv.hookimpl
    def register_providers(register):
        register(MyProvider)          # registered under MyProvider.name

Built-in providers register exactly this way.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

hookspec = pluggy.HookspecMarker("semkv")
hookimpl = pluggy.HookimplMarker("semkv")


@hookspec
def register_providers(register: Callable[..., None]) -> None:
    """Call ``register(provider_class)`` (or ``register(cls, name=...)``) for each provider."""
