"""semkv refuses vLLM's sleep mode (``enable_sleep_mode``), through vLLM's own connector hook.

vLLM 0.33 asks the connector class, at config time (``VllmConfig._verify_kv_transfer_compat``,
run from ``VllmConfig.__post_init__`` when ``model_config.enable_sleep_mode`` is set), whether it
can follow the KV cache remap of sleep mode: ``supports_sleep_mode(cls, kv_transfer_config)``, a
classmethod of ``KVConnectorBase_V1`` that answers True by default. A False answer makes vLLM
refuse the engine at start-up ("... does not support sleep mode.").

semkv cannot follow it: around sleep the GPU worker calls ``unregister_kv_caches`` /
``restore_kv_caches``, and the KV tensors semkv took at ``register_kv_caches`` (the worker's
block copies, the page layout probe, the span realizer) would then point at freed or remapped
memory. So the connector declares sleep mode unsupported rather than load from stale pages.
vLLM 0.32 has no such hook (nor sleep-mode KV remapping with connectors): the method is then
unused and harmless.

NOTE: mix ``SleepModeUnsupported`` in FIRST among the connector's bases, so that its
``supports_sleep_mode`` comes before ``KVConnectorBase_V1``'s in the MRO.
"""

from __future__ import annotations

from typing import Any


class SleepModeUnsupported:
    """Connector mixin: vLLM's ``supports_sleep_mode`` hook answers False."""

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """Whether the connector can follow the KV cache remap of sleep mode: never."""
        del kv_transfer_config  # the answer holds for every semkv configuration
        return False
