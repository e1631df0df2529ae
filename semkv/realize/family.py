"""What a decoder layer computes, per architecture family: the one description both runners
read, so the engine's (``semkv_vllm.models``, over vLLM's modules) and research's
(``semkv.research.LayerwiseModel``, over transformers') compute each family alike.

Both libraries name the modules of these families the same way (``input_layernorm``,
``self_attn.q_norm`` / ``k_norm``, ``post_attention_layernorm``, ``pre_feedforward_layernorm``,
``post_feedforward_layernorm``, ``mlp``), which is what makes one description enough. What a
runner owns itself is the attention (its projections, its rotary embedding, its cache).

- ``Family``: ``qk_norms`` (an RMSNorm over each head of q and of k between the projection and
  RoPE: Qwen3, Gemma 3), ``sandwich_norms`` (Gemma: the attention output and the MLP's input
  and output normed too; four norms per layer).
- ``MODEL_TYPES``: transformers' ``model_type`` of each family the research side runs.
- ``block(family, layer, h, attend)``: the residual structure around ``attend`` (the layer's
  attention output for a normed input) and the MLP.
- ``visible(keys_at, positions, window)``: which keys each query attends: causal by position,
  and inside the window where the layer has one (a query sees itself and the ``window - 1``
  keys before it, as vLLM's kernels and transformers' sliding-window masks do).
- ``soft_cap(scores, cap)``: Gemma 2's attention logits soft cap.
- ``layer_window(config, index)``: a layer's window from a transformers config.

NOTE: the unfused norm form everywhere: vLLM's fused (x, residual) kernels update their inputs
in place, and ``h`` may be the caller's tensor; the residual additions are the same single
additions the fused kernels make.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Family:
    name: str
    qk_norms: bool = False
    sandwich_norms: bool = False


LLAMA = Family("Llama")
QWEN3 = Family("Qwen3", qk_norms=True)
GEMMA2 = Family("Gemma 2", sandwich_norms=True)
GEMMA3 = Family("Gemma 3", qk_norms=True, sandwich_norms=True)
SANDWICH_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm")

MODEL_TYPES: dict[str, Family] = {
    "llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA,
    "qwen3": QWEN3, "qwen3_moe": QWEN3,
    "gemma2": GEMMA2, "gemma3_text": GEMMA3,
}


def per_head(norm: Any, x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``norm`` over each ``head_dim``-wide head of ``x`` ``[..., heads * head_dim]``."""
    return norm(x.reshape(*x.shape[:-1], -1, head_dim)).reshape(x.shape)


def block(family: Family, layer: Any, h: torch.Tensor,
          attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One decoder layer's output for the residual stream ``h``."""
    if not family.sandwich_norms:
        h = h + attend(layer.input_layernorm(h))
        return h + layer.mlp(layer.post_attention_layernorm(h))
    h = h + layer.post_attention_layernorm(attend(layer.input_layernorm(h)))
    return h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))


def visible(keys_at: torch.Tensor, positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """[queries, keys] True where a query at ``positions`` attends a key at ``keys_at``."""
    seen = keys_at[None, :] <= positions[:, None]
    if window is not None:
        seen &= keys_at[None, :] > positions[:, None] - window
    return seen


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    return scores if cap is None else torch.tanh(scores / cap) * cap


def layer_window(config: Any, index: int) -> int | None:
    """Layer ``index``'s sliding window from a transformers config (None: full attention):
    per ``layer_types`` where the config lists them (Gemma, Qwen2), else the model-wide one
    (Mistral)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return int(window) if types[index] == "sliding_attention" else None
    return int(window)
