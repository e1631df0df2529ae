"""semkv's provider conformance kit.

Third-party providers run the same contract as the built-ins. Either subclass the contract in
your own tests and say how to build your provider::

    from semkv.testing import ProviderContract

    class TestMyProvider(ProviderContract):
        @pytest.fixture
        def make_provider(self, semkv_context):
            return lambda: MyProvider.from_config({}, semkv_context)

or run it against installed providers by name, with no code at all::

    pytest --pyargs semkv.testing --semkv-provider my_provider

The fixtures (``semkv_context``, ``semkv_corpus``) come from the pytest plugin that semkv
registers under the ``pytest11`` entry point. A provider that can keep its index in a shared
discovery store runs the same contract there too (``--semkv-provider-config
'{"discovery_store": "redis://..."}'``); each build gets a private key space
(``semkv.testing.stores.isolated``).
"""

from semkv.testing.contract import ProviderContract
from semkv.testing.delegating import DelegatingProvider
from semkv.testing.synthetic import SyntheticCorpus, synthetic_detokenize

__all__ = ["DelegatingProvider", "ProviderContract", "SyntheticCorpus", "synthetic_detokenize"]
