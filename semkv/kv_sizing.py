"""How many bytes of KV cache an engine needs, from what the run needs: never a host fraction.

vLLM's CPU worker, given no ``kv_cache_memory_bytes``, takes ``gpu_memory_utilization`` x the
NUMA node's memory minus its own resident memory: the same setting is ample on one host and
negative (start-up refused) on another. Every engine this project starts therefore gets an
explicit size from ``kv_cache_bytes``: the model's KV bytes per token x the tokens the run
keeps resident (``max_num_seqs`` requests of ``max_model_len`` tokens, in whole blocks).

``semkv kv-cache-bytes`` prints the same figure for ``vllm serve --kv-cache-memory-bytes``.

NOTE: only the model's ``config.json`` is read (no torch, no vLLM): layers x KV heads x head
size x 2 (K and V) x the KV dtype's width.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

KV_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
                  "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_MAX_NUM_SEQS = 4
DEFAULT_BLOCK_SIZE = 128  # vLLM-CPU's default


def kv_bytes_per_token(model: str | Path, dtype: str = "float32") -> int:
    """K and V of one token over every layer, for the model folder's ``config.json``."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the model config {path}: {exc}") from exc
    config = config.get("text_config", config)  # multimodal wrappers keep the LM's config inside
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path} lacks the attention geometry ({exc})") from exc
    if dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {dtype!r}; known: {', '.join(sorted(KV_DTYPE_BYTES))}")
    return layers * kv_heads * head_dim * 2 * KV_DTYPE_BYTES[dtype]


def kv_cache_bytes(model: str | Path, *, max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                   max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                   block_size: int = DEFAULT_BLOCK_SIZE, dtype: str = "float32") -> int:
    """Bytes that hold ``max_num_seqs`` requests of ``max_model_len`` tokens, in whole blocks."""
    if max_model_len < 1 or max_num_seqs < 1 or block_size < 1:
        raise ValueError("max_model_len, max_num_seqs and block_size must be positive")
    blocks = max_num_seqs * math.ceil(max_model_len / block_size)
    return blocks * block_size * kv_bytes_per_token(model, dtype)


def bundled_kv_cache_bytes(*, max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                           max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                           block_size: int = DEFAULT_BLOCK_SIZE, dtype: str = "float32") -> int:
    """``kv_cache_bytes`` for the bundled SmolLM2 model (converted on first use)."""
    from semkv.bundled_model import ensure_model

    return kv_cache_bytes(ensure_model(), max_model_len=max_model_len,
                          max_num_seqs=max_num_seqs, block_size=block_size, dtype=dtype)


def kv_dtype_of(dtype: str, kv_cache_dtype: str, folder: str | Path) -> str:
    """The KV dtype's name for sizing, from an engine's ``dtype`` and ``kv_cache_dtype``
    (``auto``: the model's own, read from its ``config.json``); unsure: fp32, an over-estimate."""
    if kv_cache_dtype in KV_DTYPE_BYTES:
        return kv_cache_dtype
    if dtype in KV_DTYPE_BYTES:
        return dtype
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    named = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    return named if named in KV_DTYPE_BYTES else "float32"
