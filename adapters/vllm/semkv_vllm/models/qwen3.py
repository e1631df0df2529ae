"""``Qwen3LayerRunner``: vLLM 0.32's ``Qwen3ForCausalLM``, the Llama layout with one change: an
RMSNorm over each head of q and of k (``self_attn.q_norm`` / ``k_norm``, ``head_dim`` wide)
between the projection and RoPE, as ``Qwen3Attention.forward`` applies them
(``semkv.realize.family.QWEN3``). The rest (windows where a layer has one, the residual
structure, the passes) is ``DecoderLayerRunner``'s. Qwen3-MoE has the same layers with vLLM's
fused MoE as the MLP, called inside the engine's forward context (``base.py``).

Refused at construction: a layer without both norms (not Qwen3's attention), dual-chunk
attention (``common_refusal``).

NOTE: nothing here imports vLLM; it only calls the modules of the model it is handed.
"""

from __future__ import annotations

from typing import Any

from semkv.realize.family import QWEN3
from semkv_vllm.models.base import DecoderLayerRunner, common_refusal


def qwen3_refusal(model: Any) -> str | None:
    """Why this model's layers are not Qwen3's (None when they are)."""
    reason = common_refusal(model)
    if reason is not None:
        return reason
    for layer in model.model.layers:
        attn = layer.self_attn
        if getattr(attn, "q_norm", None) is None or getattr(attn, "k_norm", None) is None:
            return "attention without Qwen3's q/k norms"
    return None


class Qwen3LayerRunner(DecoderLayerRunner):
    """The engine's loaded Qwen3 model run layer by layer over an explicit ``KVCache``."""

    refusal = staticmethod(qwen3_refusal)
    family = QWEN3
