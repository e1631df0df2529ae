"""The contract, run against installed providers: ``pytest --pyargs semkv.testing``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from semkv.provider import DonorProvider, ProviderContext
from semkv.testing.contract import ProviderContract
from semkv.testing.stores import isolated


class TestInstalledProvider(ProviderContract):
    @pytest.fixture
    def make_provider(
        self,
        semkv_provider_name: str,
        semkv_context: ProviderContext,
        semkv_provider_config: dict[str, Any],
    ) -> Callable[[], DonorProvider]:
        from semkv.plugins import get_provider_class

        cls = get_provider_class(semkv_provider_name)
        return lambda: cls.from_config(isolated(semkv_provider_config), semkv_context)
