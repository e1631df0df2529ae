"""pytest plugin of the conformance kit (registered through the ``pytest11`` entry point)."""

from __future__ import annotations

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
def semkv_provider_config() -> dict[str, Any]:
    """Override to hand ``provider_config`` to providers built by name."""
    return {}
