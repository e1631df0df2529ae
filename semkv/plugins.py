"""The plugin host: loads ``semkv`` entry points, resolves providers by name, adds commands.

``SEMKV_LOAD_PLUGINS`` (comma-separated entry-point or distribution names) restricts what
loads; set it empty to load no external plugin at all.

NOTE: a provider class with ``fault_injection = True`` (``faulty`` of ``semkv.testing``) is
listed, marked ``testing_only``, but resolving it by name is refused unless
``SEMKV_ALLOW_FAULT_INJECTION=1`` is set (tests and chaos runs set it): an operator cannot
put a fault injector in front of real traffic by a typo in the provider name.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading
from typing import TYPE_CHECKING

import pluggy

from semkv import hookspecs
from semkv.log import get_logger
from semkv.provider import DonorProvider

if TYPE_CHECKING:
    import argparse

    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

GROUP = "semkv"
ALLOW_FAULT_INJECTION = "SEMKV_ALLOW_FAULT_INJECTION"
_lock = threading.Lock()
_manager: pluggy.PluginManager | None = None
_dists: dict[str, importlib.metadata.Distribution | None] = {}
_broken: dict[str, str] = {}  # entry-point name -> why it could not be loaded
log = get_logger("semkv.plugins")


class UnknownProviderError(LookupError):
    """The configured provider name is not installed."""


class TestingOnlyProviderError(UnknownProviderError):
    """The configured provider injects faults on purpose and fault injection is not allowed."""


def testing_only(cls: type[DonorProvider]) -> bool:
    return bool(getattr(cls, "fault_injection", False))


def fault_injection_allowed() -> bool:
    return os.environ.get(ALLOW_FAULT_INJECTION, "").strip().lower() in ("1", "true", "yes")


def _allowed(ep: importlib.metadata.EntryPoint) -> bool:
    wanted = os.environ.get("SEMKV_LOAD_PLUGINS")
    if wanted is None:
        return True
    names = {n.strip() for n in wanted.split(",") if n.strip()}
    dist = ep.dist.name if ep.dist is not None else None
    return ep.name in names or dist in names


def plugin_manager() -> pluggy.PluginManager:
    global _manager
    with _lock:
        if _manager is None:
            pm = pluggy.PluginManager(GROUP)
            pm.add_hookspecs(hookspecs)
            for ep in importlib.metadata.entry_points(group=GROUP):
                if not _allowed(ep) or pm.get_plugin(ep.name) is not None:
                    continue
                try:
                    pm.register(ep.load(), name=ep.name)  # a hook of the wrong shape raises
                except Exception as exc:  # noqa: BLE001 - one broken plugin must not hide the rest
                    _broken[ep.name] = f"{type(exc).__name__}: {exc}"
                    log.warning("plugin_failed_to_load", plugin=ep.name, error=_broken[ep.name])
                    continue
                _dists[ep.name] = ep.dist
            _manager = pm
        return _manager


def load_errors() -> dict[str, str]:
    """Plugins that could not be loaded (or whose hooks raised): name -> why."""
    plugin_manager()
    return dict(_broken)


def excluded(distribution: str) -> bool:
    """``distribution`` has ``semkv`` entry points and ``SEMKV_LOAD_PLUGINS`` leaves them out."""
    eps = [ep for ep in importlib.metadata.entry_points(group=GROUP)
           if ep.dist is not None and ep.dist.name == distribution]
    return bool(eps) and not any(_allowed(ep) for ep in eps)

def providers() -> dict[str, type[DonorProvider]]:
    """Every installed provider, by name."""
    found: dict[str, type[DonorProvider]] = {}

    def register(cls: type[DonorProvider], name: str | None = None) -> None:
        if not (isinstance(cls, type) and issubclass(cls, DonorProvider)):
            raise TypeError(f"{cls!r} is not a semkv DonorProvider subclass")
        key = name or cls.name
        if key in found and found[key] is not cls:
            raise ValueError(f"two plugins register a provider named {key!r}")
        found[key] = cls

    plugin_manager().hook.register_providers(register=register)
    return found


def get_provider_class(name: str) -> type[DonorProvider]:
    installed = providers()
    if name not in installed:
        listed = ", ".join(sorted(installed)) or "none"
        broken = "".join(f"; plugin {p!r} failed to load ({why})" for p, why in _broken.items())
        raise UnknownProviderError(
            f"semkv provider {name!r} is not installed; installed providers: {listed}{broken}"
        )
    cls = installed[name]
    if testing_only(cls) and not fault_injection_allowed():
        raise TestingOnlyProviderError(
            f"semkv provider {name!r} injects faults on purpose (tests and chaos runs only); "
            f"set {ALLOW_FAULT_INJECTION}=1 in the engine's environment to select it"
        )
    return cls


def plugin_versions() -> list[dict[str, str | bool]]:
    """Installed providers with the plugin and distribution that brought them.

    ``testing_only`` marks fault injectors, refused unless ``SEMKV_ALLOW_FAULT_INJECTION=1``.
    """
    pm = plugin_manager()
    rows: list[dict[str, str | bool]] = []
    for plugin_name, plugin in pm.list_name_plugin():
        dist = _dists.get(plugin_name)
        names: list[tuple[str, type[DonorProvider]]] = []

        def register(cls: type[DonorProvider], name: str | None = None,
                     into: list[tuple[str, type[DonorProvider]]] = names) -> None:
            into.append((name or cls.name, cls))

        hook = getattr(plugin, "register_providers", None)  # pluggy hands plugins as objects
        if hook is not None:
            hook(register=register)
        for provider, cls in names:
            rows.append(
                {
                    "provider": provider,
                    "plugin": plugin_name,
                    "distribution": dist.name if dist else "",
                    "version": dist.version if dist else "",
                    "testing_only": testing_only(cls),
                }
            )
    return sorted(rows, key=lambda r: str(r["provider"]))


def add_commands(subparsers: Subparsers) -> dict[str, str]:
    """Every plugin's ``register_commands`` hook into ``subparsers``: command -> plugin name.

    A plugin whose hook raises is skipped (logged, and listed by ``load_errors``): one broken
    plugin must not take the other commands with it.
    """
    added: dict[str, str] = {}
    for impl in plugin_manager().hook.register_commands.get_hookimpls():
        before = set(subparsers.choices)
        try:
            impl.function(subparsers=subparsers)
        except Exception as exc:  # noqa: BLE001 - the CLI's own commands must still run
            _broken[impl.plugin_name] = f"register_commands: {type(exc).__name__}: {exc}"
            log.warning("plugin_commands_failed", plugin=impl.plugin_name,
                        error=_broken[impl.plugin_name])
            continue
        added.update(dict.fromkeys(sorted(set(subparsers.choices) - before), impl.plugin_name))
    return added


def plugin_commands() -> list[dict[str, str]]:
    """The ``semkv`` commands plugins add, with the plugin and distribution that brought them."""
    import argparse

    added = add_commands(argparse.ArgumentParser(prog="semkv").add_subparsers())
    rows = []
    for command, plugin_name in sorted(added.items()):
        dist = _dists.get(plugin_name)
        rows.append({"command": command, "plugin": plugin_name,
                     "distribution": dist.name if dist else "",
                     "version": dist.version if dist else ""})
    return rows


def _reset_for_tests() -> None:
    global _manager
    with _lock:
        _manager = None
        _dists.clear()
        _broken.clear()
