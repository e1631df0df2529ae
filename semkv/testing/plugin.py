"""pytest plugin of the conformance kit (registered through the ``pytest11`` entry point)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from semkv.provider import ProviderContext
from semkv.testing.synthetic import SyntheticCorpus, synthetic_detokenize


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("semkv")
    group.addoption(
        "--semkv-provider",
        action="append",
        default=[],
        help="run the semkv provider contract against this installed provider (repeatable)",
    )
    group.addoption(
        "--semkv-provider-config",
        default="{}",
        help="provider_config (JSON) for providers built by name, e.g. "
        '\'{"discovery_store": "redis://127.0.0.1:6379/0"}\' to run the kit on a shared store',
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "semkv_provider_name" in metafunc.fixturenames:
        from semkv.plugins import providers

        names = metafunc.config.getoption("semkv_provider") or sorted(
            name for name, cls in providers().items() if not getattr(cls, "fault_injection", False)
        )
        metafunc.parametrize("semkv_provider_name", names)


@pytest.fixture
def semkv_context() -> ProviderContext:
    return ProviderContext(block_size=16, detokenize=synthetic_detokenize)


@pytest.fixture
def semkv_corpus() -> SyntheticCorpus:
    return SyntheticCorpus(seed=1234)


@pytest.fixture
def semkv_provider_config(request: pytest.FixtureRequest) -> dict[str, Any]:
    """``provider_config`` for providers built by name (``--semkv-provider-config``); override
    it to hand options from code. A shared store gets a private key space per build
    (``semkv.testing.stores.isolated``)."""
    config = json.loads(request.config.getoption("semkv_provider_config") or "{}")
    if not isinstance(config, dict):
        raise pytest.UsageError("--semkv-provider-config must be a JSON object")
    return config
