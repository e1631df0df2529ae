"""Every built-in provider passes the conformance kit, loaded by name as an operator would."""

import pytest

from semkv.testing import ProviderContract

BUILTIN = ["chunks", "minhash", "semblend", "embedding"]


class TestBuiltinProviders(ProviderContract):
    @pytest.fixture(params=BUILTIN)
    def make_provider(self, request, semkv_context):
        from semkv.plugins import get_provider_class

        cls = get_provider_class(request.param)
        return lambda: cls.from_config({}, semkv_context)
