"""The example third-party provider (examples/provider-trigram), installed as its own distribution.

It is found through the ``semkv`` entry-point group like any plugin and passes the same
conformance kit as the built-ins. ``tests/test_serve.py`` serves requests with it through
``vllm serve``.
"""

from __future__ import annotations

import importlib.metadata

import pytest

from semkv.plugins import get_provider_class, plugin_versions
from semkv.provider import DonorRecord, LookupQuery
from semkv.testing import ProviderContract


def test_registered_by_its_own_distribution():
    rows = {r["provider"]: r for r in plugin_versions()}
    assert rows["trigram"]["distribution"] == "semkv-example-trigram"
    dist = importlib.metadata.distribution("semkv-example-trigram")
    assert "semkv" in {ep.group for ep in dist.entry_points}


class TestTrigramContract(ProviderContract):
    @pytest.fixture
    def make_provider(self, semkv_context):
        cls = get_provider_class("trigram")  # by name, as the connector does
        return lambda: cls.from_config({}, semkv_context)


def test_ranks_by_shared_trigrams_and_honours_min_shared(semkv_context):
    provider = get_provider_class("trigram").from_config({"min_shared": 0.5}, semkv_context)
    ns = "ns"
    provider.register_donor(DonorRecord(donor_id="half", namespace=ns, token_ids=tuple(range(60))))
    provider.register_donor(DonorRecord(donor_id="all", namespace=ns, token_ids=tuple(range(100))))
    provider.register_donor(DonorRecord(donor_id="few", namespace=ns, token_ids=tuple(range(20))))
    found = provider.lookup(LookupQuery(request_id="r", namespace=ns, token_ids=tuple(range(100))))
    # 98 distinct trigrams: "all" holds 98, "half" 58 (0.59), "few" 18 (0.18 < min_shared)
    assert [c.donor_id for c in found] == ["all", "half"]
    assert found[0].similarity == 1.0 and found[1].similarity == pytest.approx(58 / 98)
    assert all(c.num_tokens == 0 for c in found)  # spans are left to semkv's verifier


def test_bad_provider_config_names_the_key(semkv_context):
    cls = get_provider_class("trigram")
    with pytest.raises(ValueError, match="min_shared"):
        cls.from_config({"min_shared": 0}, semkv_context)
    with pytest.raises(ValueError, match="min_sharde"):
        cls.from_config({"min_sharde": 0.3}, semkv_context)
