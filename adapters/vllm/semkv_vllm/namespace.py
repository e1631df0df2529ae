"""The semkv namespace of a vLLM engine, read from its ``VllmConfig``.

NOTE: any value that cannot be read is left unknown (``None``), which makes the namespace
match nothing: a donor is never shared on a guess.
NOTE: the model's path and revision do not tell weights apart (a local folder's revision is
"none"): the weights' own digest is a field too, so new weights rolled out under the same path
never meet the old ones' donors, in Redis or LMCache alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from semkv.log import MAX_STRING, get_logger
from semkv.namespace import ABSENT, Namespace, canonical

log = get_logger("semkv.vllm.namespace")


def _read(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - an unreadable field stays unknown
        return None


def dtype_name(value: Any) -> str | None:
    """A dtype as config text: ``torch.float32`` -> ``float32`` (None stays unknown)."""
    if value is None:
        return None
    return str(value).removeprefix("torch.")


def _optional(value: Any) -> str:
    return ABSENT if value is None else str(value)


def _positional(model_config: Any) -> str | None:
    hf = model_config.hf_text_config
    fields = {
        "rope_parameters": getattr(hf, "rope_parameters", None),
        "rope_scaling": getattr(hf, "rope_scaling", None),
        "rope_theta": getattr(hf, "rope_theta", None),
        "partial_rotary_factor": getattr(hf, "partial_rotary_factor", None),
        "max_position_embeddings": getattr(hf, "max_position_embeddings", None),
        "max_model_len": model_config.max_model_len,
        "sliding_window": getattr(hf, "sliding_window", None),
    }
    if fields["rope_parameters"] is None and fields["rope_theta"] is None:
        return None  # a rotary model whose positions we cannot read: unknown
    return canonical(fields)


def _quantization(model_config: Any) -> str | None:
    """How vLLM quantizes the weights as it serves them: the method (``--quantization``, or
    the one the checkpoint declares) and the user-facing config; the same checkpoint served
    online-quantized (``fp8_per_tensor``) writes other KV than served as is."""
    config = getattr(model_config, "quantization_config", None)
    if isinstance(config, dict):
        described = canonical(config)
    else:
        described = ABSENT if config is None else repr(config)
        if " at 0x" in described:
            return None  # no stable description: unknown
    return canonical({"method": _optional(model_config.quantization), "config": described})


def _kv_quantization(cache_config: Any) -> str:
    """How a quantized KV cache is scaled beyond its dtype: scales computed from the first
    batch (``calculate_kv_scales``, in the vLLM versions that have it) or loaded with the
    weights, and the layers kept unquantized (``kv_cache_dtype_skip_layers``)."""
    computed = getattr(cache_config, "calculate_kv_scales", None)
    skipped = getattr(cache_config, "kv_cache_dtype_skip_layers", None)
    return canonical({
        "calculate_kv_scales": ABSENT if computed is None else bool(computed),
        "skip_layers": ABSENT if skipped is None else sorted(str(x) for x in skipped),
    })


def _tokenizer_settings(model_config: Any) -> str:
    settings = {
        "mode": str(model_config.tokenizer_mode),
        "trust_remote_code": bool(model_config.trust_remote_code),
        "skip_init": bool(model_config.skip_tokenizer_init),
    }
    template = _read(lambda: _chat_template_digest(model_config.tokenizer))
    settings["chat_template"] = template or ABSENT
    return canonical(settings)


def _chat_template_digest(tokenizer_path: str) -> str | None:
    import os

    for name in ("chat_template.jinja", "tokenizer_config.json"):
        path = os.path.join(tokenizer_path, name)
        if os.path.isfile(path):
            with open(path, "rb") as fh:
                return hashlib.sha256(fh.read()).hexdigest()[:16]
    return None


def _attention_isa(vllm_config: Any, head_size: int) -> str:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return ABSENT  # GPU pages are token-major; the backend and layout say enough
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(
        _get_attn_isa(
            vllm_config.model_config.dtype,
            vllm_config.cache_config.block_size,
            head_size,
            vllm_config.cache_config.cache_dtype,
        )
    )


def _attention_backend(vllm_config: Any, head_size: int) -> Any:
    """The attention backend class vLLM selects for this engine's decoder layers.

    vLLM's own selector (``get_attn_backend``, deterministic and cached) with the arguments its
    attention layer passes (``model_executor/layers/attention/attention.py``): head size, model
    dtype (the default dtype while the model is built), KV cache dtype, MLA, sliding window,
    multimodal prefix. The platform decides (``current_platform.get_attn_backend_cls``; an
    explicit ``--attention-backend`` is validated there, and the CPU platform always answers
    ``CPU_ATTN``), so the scheduler process and every worker derive the same class. A selector
    that cannot run here (a GPU platform without its device) raises: the field stays unknown.
    """
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    with set_current_vllm_config(vllm_config):
        return get_attn_backend(
            head_size,
            mc.dtype,
            cc.cache_dtype,
            use_mla=bool(mc.use_mla),
            use_mm_prefix=bool(getattr(mc, "is_mm_prefix_lm", False)),
            has_sliding_window=getattr(cc, "sliding_window", None) is not None,
        )


def _kv_layout(vllm_config: Any, backend: Any) -> str:
    """The physical KV cache layout (a ``KVCacheLayout`` name, e.g. ``LBNHC``).

    The engine core resolves it once before the KV cache exists and records it on
    ``CacheConfig.kv_cache_layout`` (its scheduler and every worker's connector are built after
    that, vLLM 0.32 and 0.33 alike): a recorded layout is the answer. Before resolution (a
    config not yet in an engine) the same resolution is run on a copy of the config: vLLM's
    ``resolve_kv_cache_layout`` over the layouts the selected backend supports, honouring
    ``VLLM_KV_CACHE_LAYOUT`` and a connector's required layout, as the engine core would.
    """
    import copy

    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )

    cc = vllm_config.cache_config
    if cc.kv_cache_layout is not None:
        return str(cc.kv_cache_layout)
    supported = [layout.name for layout in get_supported_kv_cache_layouts([backend])]
    probe = copy.copy(vllm_config)  # resolution writes the layout into its cache config
    object.__setattr__(probe, "cache_config", copy.copy(cc))
    return str(resolve_kv_cache_layout(probe, [supported]).name)


def _weights(model_config: Any) -> str | None:
    """The digest of the weights vLLM loads (None, and a warning, when they cannot be read:
    the namespace then matches nothing, so no donor is shared on a guess)."""
    from semkv.model_identity import ModelIdentityError, model_folder, weights_identity

    folder = model_folder(str(model_config.model), getattr(model_config, "revision", None))
    if folder is None:
        log.warning("namespace_weights_unknown", why="no local model folder",
                    effect="no donor is shared or served")
        return None
    try:
        return weights_identity(folder)
    except (ModelIdentityError, OSError) as exc:
        log.warning("namespace_weights_unknown", why=str(exc)[: MAX_STRING - 1],
                    effect="no donor is shared or served")
        return None


def namespace_from_vllm_config(vllm_config: Any) -> Namespace:
    """The engine-wide namespace; add each request's LoRA and salt with ``for_request``."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    head_size = _read(mc.get_head_size)
    backend = None if head_size is None else _read(lambda: _attention_backend(vllm_config,
                                                                                head_size))
    lora = vllm_config.lora_config
    return Namespace(
        model_id=_read(lambda: str(mc.model)),
        model_revision=_read(lambda: _optional(mc.revision)),
        model_weights=_read(lambda: _weights(mc)),
        tokenizer_id=_read(lambda: str(mc.tokenizer)),
        tokenizer_revision=_read(lambda: _optional(mc.tokenizer_revision)),
        tokenizer_settings=_read(lambda: _tokenizer_settings(mc)),
        dtype=_read(lambda: dtype_name(mc.dtype)),
        kv_cache_dtype=_read(lambda: dtype_name(cc.cache_dtype)),
        quantization=_read(lambda: _quantization(mc)),
        kv_quantization=_read(lambda: _kv_quantization(cc)),
        block_size=_read(lambda: int(cc.block_size)),
        kv_layout=None if backend is None else _read(lambda: _kv_layout(vllm_config, backend)),
        attention_isa=_read(lambda: _attention_isa(vllm_config, head_size)),
        attention_backend=None if backend is None else _read(lambda: str(backend.get_name())),
        tensor_parallel_size=_read(lambda: int(pc.tensor_parallel_size)),
        pipeline_parallel_size=_read(lambda: int(pc.pipeline_parallel_size)),
        rank_layout=_read(
            lambda: canonical(
                {
                    "dp": pc.data_parallel_size,
                    "dcp": getattr(pc, "decode_context_parallel_size", 1),
                    "pcp": getattr(pc, "prefill_context_parallel_size", 1),
                    "heads": mc.get_total_num_kv_heads(),
                }
            )
        ),
        lora_identity=ABSENT if lora is None else None,  # per request, see for_request
        positional=_read(lambda: _positional(mc)),
        cache_salt=ABSENT,
    )


def namespace_after_reset(current: Namespace, vllm_config: Any, *,
                          shared_kv: bool) -> Namespace:
    """The engine's namespace after a cache reset (``reset_prefix_cache(reset_connector=True)``),
    read again: weights reloaded in place (an RL step's update, ``reload_weights``) give it a
    new digest, so the donors of the old weights (the host store's, Redis's) never meet it.

    NOTE: ``shared_kv`` (``donor_store: lmcache``): LMCache's keys keep the namespace of
    start-up, so KV stored under them by the old weights would still load; the namespace is
    left unknown instead (every request prefills normally, counted ``namespace_mismatch``)
    until the engine restarts, and the log says so.
    """
    now = namespace_from_vllm_config(vllm_config)
    if now.digest == current.digest:
        return current
    if shared_kv:
        log.error("namespace_changed_restart_needed", before=current.digest, after=now.digest,
                  why="the weights changed in place; LMCache's keys keep the start-up namespace",
                  effect="no reuse (normal prefill, counted) until the engine restarts")
        return now.model_copy(update={"model_weights": None})
    log.warning("namespace_changed", before=current.digest, after=now.digest,
                why="the weights (or the model's files) changed since the last reset",
                effect="donors of the old weights are never served")
    return now


def request_lora_identity(lora_request: Any) -> str | None:
    """A LoRA adapter's identity: its name, id and path (None for the base model)."""
    if lora_request is None:
        return None
    return canonical(
        {
            "name": getattr(lora_request, "lora_name", None),
            "id": getattr(lora_request, "lora_int_id", None),
            "path": getattr(lora_request, "lora_path", None),
        }
    )
