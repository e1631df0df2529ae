"""``LlamaLayerRunner``: ``semkv.realize.LayerRunner`` over the vLLM engine's own Llama modules.

Protocol (the same as ``semkv.research.LayerwiseModel``, so the research strategies drive it):
``run_layers(cache, hidden, positions, layers)`` runs the given decoder layers for the tokens at
``positions`` only (any strictly increasing subset). Each layer writes those tokens' fresh K/V
into ``cache`` (``semkv.realize.KVCache``, ``[1, kv_heads, capacity, head_dim]`` per layer, keys
post-RoPE) first, then lets them attend causally by position (key position <= query position)
over every cached position up to the last query. Positions not computed keep what the cache
holds: reused, re-rotated donor KV. ``hidden`` is the residual stream ``[1, tokens, hidden]``.

The math is the engine's: ``model.model.embed_tokens``, per layer ``input_layernorm`` (RMSNorm),
``self_attn.qkv_proj`` split by ``q_size``/``kv_size``, the engine's own ``rotary_emb``,
``o_proj``, ``post_attention_layernorm``, ``mlp``; then ``model.model.norm`` and
``model.compute_logits``. Only the attention is spelled out, with
``torch.nn.functional.scaled_dot_product_attention`` (``[1, heads, tokens, head_dim]`` and
``enable_gqa=True``, which keeps torch on its flash kernel on CPU; ``scale=self_attn.scaling``):
vLLM's paged ``self_attn.attn`` needs the engine's forward context and attends over the whole
prefix, while here the queries may be any subset of the positions.

Applies to the Llama-family modules of vLLM 0.32 (LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM); variants whose attention differs from plain causal RoPE attention (sliding
window, soft cap, per-head q/k norms, Llama-4 position scaling, pipeline-parallel shards) are
refused at construction. Under tensor parallelism each rank holds its own heads: every rank
must make the same calls (the projections all-reduce), and logits exist on the first rank.

NOTE: nothing here imports vLLM; it only calls the modules of the model it is handed. Runs on
whatever device the model's weights live on, under ``torch.no_grad`` (not inference mode: the
research assembly writes into the cache outside it, which inference tensors refuse).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from semkv.realize import KVCache
from semkv.realize.memory import Geometry
from semkv.realize.runner import check_positions
from semkv_vllm.rope import RopeShift


class UnsupportedModelError(ValueError):
    """The engine's model is not one the layer runners can drive exactly."""


class ShiftRotator:
    """``semkv.realize.KeyRotator`` over ``RopeShift`` (the engine's own rotary angles)."""

    def __init__(self, shift: RopeShift) -> None:
        self.shift = shift
        # The last deltas rotated by (a copy) and their factors: a realization rotates every
        # layer's keys by the same deltas, so the factors are computed once per realization.
        self._last: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None

    def rotate(self, keys: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """``keys`` [..., T, head_dim] (post-RoPE) moved by ``deltas`` [T] positions."""
        # RopeShift takes token-major [T, heads, D]: bring the token axis first, flatten the rest.
        moved = keys.movedim(-2, 0)
        flat = moved.reshape(moved.shape[0], -1, moved.shape[-1])
        # RopeShift's tables live on the CPU (built once from the engine's rotary cache).
        on_cpu = deltas.to(torch.long).cpu()
        last = self._last
        if last is None or not torch.equal(last[0], on_cpu):  # [T] longs: cheap beside a layer
            last = self._last = (on_cpu.clone(), self.shift.factors(on_cpu))
        out = self.shift.rotate(flat.cpu(), on_cpu, last[1]).to(keys.device)
        return out.reshape(moved.shape).movedim(0, -2)


def _refusal(model: Any) -> str | None:
    """Why this model's attention is not plain causal RoPE attention (None when it is)."""
    inner = model.model
    layers = list(inner.layers)
    if not layers:
        return "no decoder layers"
    if getattr(inner, "start_layer", 0) != 0 or getattr(inner, "end_layer", len(layers)) != len(
            layers):
        return "pipeline-parallel shard (not every layer is local)"
    for layer in layers:
        attn = layer.self_attn
        paged = getattr(attn, "attn", None)
        if getattr(paged, "sliding_window", None) is not None:
            return "sliding-window attention"
        if getattr(getattr(paged, "impl", None), "logits_soft_cap", None):
            return "attention logits soft cap"
        if getattr(attn, "qk_norm", False):
            return "per-head q/k norms"
        if getattr(attn, "do_llama_4_scaling", False):
            return "Llama-4 attention scaling by position"
        if getattr(layer, "ada_rms_norm_t_cond", None) is not None:
            return "time-conditioned RMSNorm"
    return None


class LlamaLayerRunner:
    """The engine's loaded Llama-family model run layer by layer over an explicit ``KVCache``."""

    def __init__(self, model: Any) -> None:
        reason = _refusal(model)
        if reason is not None:
            raise UnsupportedModelError(f"{type(model).__name__}: {reason} is not supported")
        self.model = model
        self._layers = list(model.model.layers)
        first = self._layers[0].self_attn
        self.num_layers = len(self._layers)
        self.num_heads = int(first.num_heads)  # this rank's heads under tensor parallelism
        self.kv_heads = int(first.num_kv_heads)
        self.head_dim = int(first.head_dim)
        weight = model.model.embed_tokens.weight
        self.dtype: torch.dtype = weight.dtype
        self.device: torch.device = weight.device
        self._rotator: ShiftRotator | None = None

    @property
    def rotator(self) -> ShiftRotator:
        """Key re-rotation from the engine's own rotary table (built on first use)."""
        if self._rotator is None:
            rotary = self._layers[0].self_attn.rotary_emb
            shift = RopeShift.from_rotary(rotary, bool(getattr(rotary, "is_neox_style", True)))
            if shift is None:
                raise UnsupportedModelError(
                    f"{type(self.model).__name__}: rotary angles are not linear in the position")
            self._rotator = ShiftRotator(shift)
        return self._rotator

    @property
    def geometry(self) -> Geometry:
        """This rank's shape, for a realization's memory estimate (``semkv.realize.memory``)."""
        gate_up = self._layers[0].mlp.gate_up_proj
        width = getattr(gate_up, "output_size_per_partition", None)  # this rank's gate + up
        if width is None:
            width = gate_up.weight.shape[0]
        return Geometry(layers=self.num_layers, kv_heads=self.kv_heads, heads=self.num_heads,
                        head_dim=self.head_dim,
                        hidden=int(self.model.model.embed_tokens.weight.shape[1]),
                        intermediate=int(width) // 2, dtype_bytes=self.dtype.itemsize)

    # -- building blocks --------------------------------------------------------------------

    def empty_cache(self, capacity: int) -> KVCache:
        return KVCache.zeros(self.num_layers, self.kv_heads, self.head_dim, capacity,
                             self.dtype, self.device)

    def embed(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        with torch.no_grad():
            return self.model.model.embed_tokens(ids)[None]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[tokens, vocab]`` (fp32) from last-layer hidden states."""
        with torch.no_grad():
            out = self.model.compute_logits(self.model.model.norm(hidden[0]))
        if out is None:  # tensor parallelism gathers the vocabulary on the first rank only
            raise RuntimeError("logits are gathered on the first tensor-parallel rank only")
        return out.to(torch.float32)

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
        # Strictly increasing and ending at context - 1 with context entries: exactly 0..n-1,
        # where torch's own causal flag is the mask (and the cheapest path).
        prefix = positions.numel() == context
        mask = None
        if not prefix:
            keys_at = torch.arange(context, device=self.device)
            mask = keys_at[None, :] <= positions[:, None]  # True: attend (causal by position)
        h = hidden[0]
        with torch.no_grad():
            for index in layers:
                h = self._layer(index, cache, h, positions, context, mask, prefix, attention)
        return h[None]

    def _layer(self, index: int, cache: KVCache, h: torch.Tensor, positions: torch.Tensor,
               context: int, mask: torch.Tensor | None, causal: bool,
               attention: torch.Tensor | None = None) -> torch.Tensor:
        layer = self._layers[index]
        attn = layer.self_attn
        tokens = h.shape[0]
        # The unfused RMSNorm form: vLLM's fused (x, residual) kernel updates its inputs in
        # place, and ``h`` may be the caller's tensor. The residual adds below are the same
        # single fp32 additions the fused kernel makes.
        x = layer.input_layernorm(h)
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(positions, q, k)  # the engine's own RoPE (in place on CPU)
        q = q.reshape(tokens, self.num_heads, self.head_dim).transpose(0, 1)[None]
        k = k.reshape(tokens, self.kv_heads, self.head_dim).transpose(0, 1)[None]
        v = v.reshape(tokens, self.kv_heads, self.head_dim).transpose(0, 1)[None]
        # Fresh KV first, so computed tokens attend to each other's fresh values.
        cache.keys[index][:, :, positions] = k.to(cache.keys[index].dtype)
        cache.values[index][:, :, positions] = v.to(cache.values[index].dtype)
        if attention is not None:
            attention[:context] += self._weights(q, cache.keys[index][:, :, :context], positions,
                                                 attn.scaling).to(attention.device)
        out = F.scaled_dot_product_attention(
            q, cache.keys[index][:, :, :context], cache.values[index][:, :, :context],
            attn_mask=mask, is_causal=causal, scale=attn.scaling, enable_gqa=True)
        out = out[0].transpose(0, 1).reshape(tokens, self.num_heads * self.head_dim)
        o, _ = attn.o_proj(out)
        h = h + o
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _weights(self, q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                 scale: float) -> torch.Tensor:
        """Per key, the softmax weights the queries give it, summed over heads and queries
        (fp32; the attention SDPA computes without returning it). Only the query probe asks,
        for a few queries (``semkv.realize.query``)."""
        groups = self.num_heads // self.kv_heads
        k = keys[0].to(torch.float32).repeat_interleave(groups, dim=0)  # [heads, ctx, D]
        scores = torch.matmul(q[0].to(torch.float32), k.transpose(1, 2)) * scale
        blocked = torch.arange(k.shape[1], device=q.device)[None, :] > positions[:, None]
        scores = scores.masked_fill(blocked[None], float("-inf"))
        return torch.softmax(scores, dim=-1).sum(dim=(0, 1))

    # -- whole passes -----------------------------------------------------------------------

    def forward(self, cache: KVCache, token_ids: Sequence[int] | torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        """Logits ``[len(positions), vocab]`` for ``token_ids`` at ``positions`` (all layers)."""
        return self.logits(self.run_layers(cache, self.embed(token_ids), positions))

    def full_prefill(self, token_ids: Sequence[int], capacity: int | None = None, *,
                     all_logits: bool = True) -> tuple[KVCache, torch.Tensor]:
        """Every prompt token computed. Returns (cache, logits ``[N, vocab]`` or ``[1, vocab]``)."""
        n = len(token_ids)
        cache = self.empty_cache(max(n, capacity or 0))
        hidden = self.run_layers(cache, self.embed(token_ids), torch.arange(n))
        return cache, self.logits(hidden if all_logits else hidden[:, -1:])
