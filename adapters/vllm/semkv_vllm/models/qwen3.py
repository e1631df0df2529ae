"""``Qwen3LayerRunner``: vLLM 0.32's ``Qwen3ForCausalLM``, the Llama layout with one change: an
RMSNorm over each head of q and of k (``self_attn.q_norm`` / ``k_norm``, ``head_dim`` wide)
between the projection and RoPE, as ``Qwen3Attention.forward`` applies them
(``semkv.realize.family.QWEN3``). The rest (windows where a layer has one, the residual
structure, the passes) is ``DecoderLayerRunner``'s. Qwen3-MoE has the same layers with vLLM's
fused MoE as the MLP, called inside the engine's forward context (``base.py``).

Refused at construction (``base.py``): a layer without both norms, dual-chunk attention.

NOTE: nothing here imports vLLM; it only calls the modules of the model it is handed.
"""

from __future__ import annotations

from semkv.realize.family import QWEN3
from semkv_vllm.models.base import DecoderLayerRunner


class Qwen3LayerRunner(DecoderLayerRunner):
    """The engine's loaded Qwen3 model run layer by layer over an explicit ``KVCache``."""

    family = QWEN3
