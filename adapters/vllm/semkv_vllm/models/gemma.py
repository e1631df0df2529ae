"""The Gemma family of vLLM 0.32: ``Gemma2LayerRunner`` (``Gemma2ForCausalLM``) and
``Gemma3LayerRunner`` (``Gemma3ForCausalLM``, the text model; Gemma 3 270M is one).

What differs from the Llama layout, as ``Gemma2DecoderLayer`` / ``Gemma3DecoderLayer`` compute it:
- four norms per layer (GemmaRMSNorm, ``1 + w``): the attention output is normed
  (``post_attention_layernorm``) before it joins the residual, the MLP's input
  (``pre_feedforward_layernorm``) and output (``post_feedforward_layernorm``) likewise
  (``semkv.realize.family``'s ``sandwich_norms``);
- the embedding scaled by ``sqrt(hidden_size)``: the engine's own ``embed_input_ids``
  (``DecoderLayerRunner``'s embedding);
- interleaved sliding-window and full layers, each with its own rotary embedding (Gemma 3's
  window layers turn at another base than its full layers): each layer's own window mask and
  rotary table (``base.py``);
- Gemma 2's attention logits soft cap (``tanh(s / cap) * cap``, ``base.py``); Gemma 3 has none;
- Gemma 3's q/k norms per head before RoPE (``qk_norms``).

Refused at construction: layers without the four norms, a Gemma 3 layer without q/k norms, and
what ``common_refusal`` refuses.

NOTE: nothing here imports vLLM; it only calls the modules of the model it is handed.
"""

from __future__ import annotations

from typing import Any

from semkv.realize.family import GEMMA2, GEMMA3
from semkv_vllm.models.base import DecoderLayerRunner, common_refusal

NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
         "post_feedforward_layernorm")


def gemma2_refusal(model: Any) -> str | None:
    """Why this model's layers are not Gemma's (None when they are)."""
    reason = common_refusal(model)
    if reason is not None:
        return reason
    for layer in model.model.layers:
        if any(getattr(layer, name, None) is None for name in NORMS):
            return "a decoder layer without Gemma's four norms"
    return None


def gemma3_refusal(model: Any) -> str | None:
    """Why this model's layers are not Gemma 3's (None when they are)."""
    reason = gemma2_refusal(model)
    if reason is not None:
        return reason
    for layer in model.model.layers:
        attn = layer.self_attn
        if getattr(attn, "q_norm", None) is None or getattr(attn, "k_norm", None) is None:
            return "attention without Gemma 3's q/k norms"
    return None


class Gemma2LayerRunner(DecoderLayerRunner):
    """The engine's loaded Gemma 2 model run layer by layer over an explicit ``KVCache``."""

    refusal = staticmethod(gemma2_refusal)
    family = GEMMA2


class Gemma3LayerRunner(DecoderLayerRunner):
    """Gemma 2's layers with q/k norms per head (and no soft cap, which vLLM never sets)."""

    refusal = staticmethod(gemma3_refusal)
    family = GEMMA3
