"""A layer-by-layer forward pass over an explicit KV cache, for selective recompute.

Protocol: ``LayerwiseModel.from_pretrained(path)`` wraps a transformers causal LM of a family
``semkv.realize.family.MODEL_TYPES`` lists (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Gemma 2,
Gemma 3 text). ``run_layers(cache, hidden, positions, layers)`` runs the given decoder layers for
the tokens at ``positions`` only (any subset, in increasing order): each layer writes those
tokens' fresh keys and values into ``cache`` first, then lets them attend causally (key
position <= query position, inside the layer's sliding window where it has one) over every
cached position up to the last query. Positions not computed keep what the cache holds: reused,
re-rotated donor KV. With every position computed this is a plain prefill
(``tests/test_research.py`` and ``tests/test_research_families.py`` check it against the
model's own forward), and decoding is the same call for one new position.

``LayerwiseModel`` implements ``semkv.realize.LayerRunner``; the vLLM adapter's
``semkv_vllm.models`` implements the same protocol over the serving engine's loaded model, and
both read what a family's layers compute from ``semkv.realize.family``.

The math is the model's own: its modules (norms, projections, q/k norms, MLP or MoE block), its
rotary embedding (per layer type where the config has several) and transformers'
``apply_rotary_pos_emb`` / ``repeat_kv``; only the attention is spelled out (as transformers'
eager attention, soft cap included) because the queries are a subset of the keys.

NOTE: weights, prompts and KV stay in memory; nothing here logs or writes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from semkv.realize.cache import KVCache
from semkv.realize.family import MODEL_TYPES, block, layer_window, soft_cap, visible
from semkv.realize.runner import check_positions
from semkv.research.rope import LayerRotator, layer_rope_types

# KVCache lives in semkv.realize (shared with the engine's layer runner); re-exported here.
__all__ = ["SUPPORTED_MODEL_TYPES", "KVCache", "LayerwiseModel"]

SUPPORTED_MODEL_TYPES = frozenset(MODEL_TYPES)


class LayerwiseModel:
    """A transformers causal LM run layer by layer over an explicit ``KVCache``."""

    def __init__(self, model: Any) -> None:
        config = model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(
                f"semkv.research supports {sorted(SUPPORTED_MODEL_TYPES)} models, "
                f"not {model_type!r}"
            )
        self.model = model.eval()
        self.config = config
        self.family = MODEL_TYPES[model_type]
        self.num_layers = int(config.num_hidden_layers)
        self.num_heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None)
                            or config.hidden_size // config.num_attention_heads)
        self.windows = [layer_window(config, i) for i in range(self.num_layers)]
        cap = getattr(config, "attn_logit_softcapping", None)
        self.soft_caps = [float(cap) if cap else None] * self.num_layers
        self._rope_types = layer_rope_types(config)  # None: one rotary for every layer
        self.rotator = LayerRotator.from_model(model)
        self.dtype: torch.dtype = next(model.parameters()).dtype
        self.device: torch.device = next(model.parameters()).device

    @classmethod
    def from_pretrained(cls, path: str | Path,
                        dtype: torch.dtype = torch.float32) -> LayerwiseModel:
        from transformers import AutoModelForCausalLM

        # eager attention: the reference forward then does the same arithmetic as run_layers.
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, attn_implementation="eager"
        )
        return cls(model)

    # -- building blocks --------------------------------------------------------------------

    def empty_cache(self, capacity: int) -> KVCache:
        return KVCache.zeros(self.num_layers, self.kv_heads, self.head_dim, capacity,
                             self.dtype, self.device)

    def embed(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        with torch.no_grad():  # Gemma's embedding module scales by sqrt(hidden) itself
            return self.model.model.embed_tokens(ids[None, :])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[tokens, vocab]`` (fp32) from last-layer hidden states."""
        with torch.no_grad():
            out = self.model.lm_head(self.model.model.norm(hidden))
        cap = getattr(self.config, "final_logit_softcapping", None)
        return soft_cap(out[0].to(torch.float32), float(cap) if cap else None)

    def _rope(self, hidden: torch.Tensor, positions: torch.Tensor,
              layers: range) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin at ``positions`` for each of ``layers`` (one computation per rotary)."""
        rotary = self.model.model.rotary_emb
        at = positions[None, :]
        if self._rope_types is None:
            both = rotary(hidden, at)
            return dict.fromkeys(layers, both)
        by_type = {t: rotary(hidden, at, t) for t in {self._rope_types[i] for i in layers}}
        return {i: by_type[self._rope_types[i]] for i in layers}

    def run_layers(
        self,
        cache: KVCache,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        layers: range | None = None,
        *,
        attention: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``layers`` (all by default) for the tokens at ``positions``; returns their hidden.

        ``hidden`` is ``[1, len(positions), hidden_size]``: embeddings before layer 0, or the
        output of the previous layer. ``positions`` must increase strictly. ``attention``
        accumulates the queries' softmax weights per key (``semkv.realize.runner``).
        """
        layers = range(self.num_layers) if layers is None else layers
        positions = positions.to(device=self.device, dtype=torch.long)
        if positions.numel() == 0:
            return hidden
        context = check_positions(positions, cache.capacity)
        key_positions = torch.arange(context, device=self.device)
        masks: dict[int | None, torch.Tensor] = {}  # additive, one per distinct window
        for window in {self.windows[i] for i in layers}:
            blocked = ~visible(key_positions, positions, window)
            mask = torch.zeros(blocked.shape, dtype=self.dtype, device=self.device)
            masks[window] = mask.masked_fill(blocked, torch.finfo(self.dtype).min)[None, None]
        with torch.no_grad():
            ropes = self._rope(hidden, positions, layers)
            for index in layers:
                hidden = self._layer(index, cache, hidden, positions, context,
                                     masks[self.windows[index]], ropes[index], attention)
        return hidden

    def _layer(self, index: int, cache: KVCache, hidden: torch.Tensor, positions: torch.Tensor,
               context: int, mask: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               attention: torch.Tensor | None = None) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

        layer = self.model.model.layers[index]
        attn = layer.self_attn
        tokens = hidden.shape[1]
        shape = (1, tokens, -1, self.head_dim)

        def attend(x: torch.Tensor) -> torch.Tensor:
            q, k = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
            if self.family.qk_norms:  # per head, before RoPE (Qwen3, Gemma 3)
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *rope)
            v = attn.v_proj(x).view(shape).transpose(1, 2)
            # Fresh KV first, so computed tokens attend to each other's fresh values.
            cache.keys[index][:, :, positions] = k
            cache.values[index][:, :, positions] = v
            groups = self.num_heads // self.kv_heads
            keys = repeat_kv(cache.keys[index][:, :, :context], groups)
            values = repeat_kv(cache.values[index][:, :, :context], groups)
            scores = soft_cap(torch.matmul(q, keys.transpose(2, 3)) * attn.scaling,
                              self.soft_caps[index]) + mask
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
            if attention is not None:
                attention[:context] += weights.sum(dim=(0, 1, 2))
            out = torch.matmul(weights.to(q.dtype), values)
            return attn.o_proj(out.transpose(1, 2).reshape(1, tokens, -1))

        return block(self.family, layer, hidden, attend)

    # -- whole passes -----------------------------------------------------------------------

    def forward(self, cache: KVCache, token_ids: Sequence[int] | torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        """Logits ``[len(positions), vocab]`` for ``token_ids`` at ``positions`` (all layers)."""
        return self.logits(self.run_layers(cache, self.embed(token_ids), positions))

    def full_prefill(self, token_ids: Sequence[int], capacity: int | None = None, *,
                     all_logits: bool = True) -> tuple[KVCache, torch.Tensor]:
        """The reference: every prompt token computed. Returns (cache, logits).

        Logits are ``[N, vocab]``, or ``[1, vocab]`` for the last token only with
        ``all_logits=False`` (the LM head over a long prompt costs about a tenth of a small
        model's prefill).
        """
        n = len(token_ids)
        cache = self.empty_cache(max(n, capacity or 0))
        hidden = self.run_layers(cache, self.embed(token_ids), torch.arange(n))
        return cache, self.logits(hidden if all_logits else hidden[:, -1:])
