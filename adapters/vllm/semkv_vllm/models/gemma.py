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

Refused at construction (``base.py``): layers without the four norms, a Gemma 3 layer without
q/k norms (a Gemma 2 layer with them), and what every family refuses.

NOTE: nothing here imports vLLM; it only calls the modules of the model it is handed.
"""

from __future__ import annotations

from semkv.realize.family import GEMMA2, GEMMA3
from semkv_vllm.models.base import DecoderLayerRunner


class Gemma2LayerRunner(DecoderLayerRunner):
    """The engine's loaded Gemma 2 model run layer by layer over an explicit ``KVCache``."""

    family = GEMMA2


class Gemma3LayerRunner(DecoderLayerRunner):
    """Gemma 2's layers with q/k norms per head (and no soft cap, which vLLM never sets)."""

    family = GEMMA3
