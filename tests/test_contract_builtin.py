"""Every built-in provider passes the conformance kit, loaded by name as an operator would.

``chunks`` and ``minhash`` run it twice: on their in-process index and on a shared discovery
store (a real Redis-protocol server started per test, ``tests/redis_utils.py``), each provider
build on a private key space (``semkv.testing.stores.isolated``).
"""

import pytest

from semkv.testing import ProviderContract
from semkv.testing.stores import isolated
from tests.redis_utils import redis_server, redis_url  # noqa: F401 - fixtures

BUILTIN = ["chunks", "minhash", "semblend", "embedding"]
SHARED = ["chunks", "minhash"]  # providers that can keep their index in a shared store
PARAMS = [*BUILTIN, *(pytest.param(f"{name}@redis", id=f"{name}-redis") for name in SHARED)]


class TestBuiltinProviders(ProviderContract):
    @pytest.fixture(params=PARAMS)
    def make_provider(self, request, semkv_context):
        from semkv.plugins import get_provider_class

        name, _, store = request.param.partition("@")
        config = {}
        if store == "redis":
            pytest.importorskip("redis", reason="needs redis-py (make test installs it)")
            # Generous socket timeouts: the contract checks behaviour, not latency, on a
            # shared 2-core machine.
            config = {"discovery_store": request.getfixturevalue("redis_url"),
                      "store_timeout_ms": 5000.0, "store_write_timeout_ms": 5000.0}
        cls = get_provider_class(name)
        return lambda: cls.from_config(isolated(config), semkv_context)
