"""``LlamaLayerRunner``: the Llama family of vLLM 0.32 (``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM``), which shares one module layout:
``model.model.embed_tokens``, per layer ``input_layernorm`` (RMSNorm), ``self_attn.qkv_proj``
split by ``q_size``/``kv_size`` (Qwen2 with biases), the engine's own ``rotary_emb``, ``o_proj``,
``post_attention_layernorm``, ``mlp``; then ``model.model.norm`` and ``model.compute_logits``.
Everything but what the family may not have is the shared ``DecoderLayerRunner``
(``base.py``): sliding windows (Mistral's, Qwen2's) are each layer's own mask there.

Refused at construction: per-head q/k norms (a Qwen2 variant's ``qk_norm``, or ``q_norm`` /
``k_norm`` modules: another family's runner applies them), Llama-4 position scaling of the
attention, time-conditioned norms, pipeline-parallel shards. Under tensor parallelism each rank
holds its own heads: every rank must make the same calls (the projections all-reduce), and
logits exist on the first rank.

NOTE: nothing here imports vLLM; it only calls the modules of the model it is handed.
"""

from __future__ import annotations

from typing import Any

from semkv_vllm.models.base import DecoderLayerRunner, ShiftRotator, UnsupportedModelError


def llama_refusal(model: Any) -> str | None:
    """What a Llama-family model may hold beyond the family's layers (None when nothing); q/k
    norms and what every family refuses are ``base.py``'s."""
    for layer in model.model.layers:
        attn = layer.self_attn
        if getattr(attn, "do_llama_4_scaling", False):
            return "Llama-4 attention scaling by position"
        if getattr(layer, "ada_rms_norm_t_cond", None) is not None:
            return "time-conditioned RMSNorm"
    return None


class LlamaLayerRunner(DecoderLayerRunner):
    """The engine's loaded Llama-family model run layer by layer over an explicit ``KVCache``."""

    refusal = staticmethod(llama_refusal)


__all__ = ["LlamaLayerRunner", "ShiftRotator", "UnsupportedModelError", "llama_refusal"]
