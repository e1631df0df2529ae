"""Optional dependencies of ``semkv.research``: fail early, naming the extra to install."""

from __future__ import annotations

import importlib.util

EXTRA_HINT = "pip install 'semkv[research]'"


def require(*modules: str) -> None:
    """Raise ImportError naming the ``research`` extra when any of ``modules`` is missing."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(
            f"semkv.research needs {', '.join(missing)}: {EXTRA_HINT}", name=missing[0]
        )
