"""Running the conformance kit against a shared discovery store.

A shared store outlives the providers built on it: donors registered by one test's provider
(under its random instance id) would show up in the next test as another engine's donors. The
kit therefore builds every provider on a private key space: ``isolated`` gives a
``provider_config`` naming a shared store a fresh ``store_prefix`` (a memory config is
returned unchanged), so each build starts empty, as an in-process index does.
"""

from __future__ import annotations

import uuid
from typing import Any


def isolated(provider_config: dict[str, Any]) -> dict[str, Any]:
    """``provider_config`` with a store prefix of its own when it names a shared store."""
    if provider_config.get("discovery_store", "memory") == "memory":
        return dict(provider_config)
    prefix = str(provider_config.get("store_prefix", "semkv-kit"))[:40]
    return {**provider_config, "store_prefix": f"{prefix}-{uuid.uuid4().hex[:12]}"}
