"""What every family's layer runner shares: the ``semkv.realize.LayerRunner`` protocol over the
vLLM engine's own loaded modules, with the attention spelled out.

Protocol (the same as ``semkv.research.LayerwiseModel``, so the research strategies drive it):
``run_layers(cache, hidden, positions, layers)`` runs the given decoder layers for the tokens at
``positions`` only (any strictly increasing subset). Each layer writes those tokens' fresh K/V
into ``cache`` (``semkv.realize.KVCache``, ``[1, kv_heads, capacity, head_dim]`` per layer, keys
post-RoPE) first, then lets them attend causally by position (key position <= query position,
and inside the layer's sliding window where it has one) over every cached position up to the
last query. Positions not computed keep what the cache holds: reused, re-rotated donor KV.
``hidden`` is the residual stream ``[1, tokens, hidden]``.

A family module (``llama.py``, ...) subclasses ``DecoderLayerRunner`` and says only what
differs: ``refusal`` (what of the family it cannot run exactly) and ``family``
(``semkv.realize.family``: q/k norms, Gemma's four norms; the description research's runner
reads too). The embedding is the model's own ``embed_input_ids`` (Gemma's scaling included).
Attention uses ``torch.nn.functional.scaled_dot_product_attention`` (``[1, heads, tokens,
head_dim]`` and ``enable_gqa=True``, which keeps torch on its flash kernel on CPU;
``scale=self_attn.scaling``; a soft-capped layer computes its weights itself): vLLM's paged
``self_attn.attn`` needs the engine's forward context and attends over the whole prefix, while
here the queries may be any subset of the positions. Each layer's window is read from its paged
attention (``attn.sliding_window``, the value vLLM's kernel uses: a query sees itself and the
``window - 1`` keys before it).

NOTE: nothing here imports vLLM; it only calls the modules of the model it is handed. Runs on
whatever device the model's weights live on, under ``torch.no_grad`` (not inference mode: the
research assembly writes into the cache outside it, which inference tensors refuse).
NOTE: ``context`` (a constructor argument; ``engine_setup.forward_context`` in the engine) is
entered around every layer pass: vLLM's fused MoE looks its layer up in the engine's forward
context, which exists only inside the engine's own forward otherwise.
NOTE: the rotator is built at construction (the worker's start-up): a rotary embedding whose
angles cannot be moved by one rotation refuses the model there, never inside a realization.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from semkv.realize import KVCache
from semkv.realize.family import (
    LLAMA,
    SANDWICH_NORMS,
    Family,
    block,
    per_head,
    soft_cap,
    visible,
)
from semkv.realize.memory import Geometry
from semkv.realize.runner import check_positions
from semkv_vllm.rope import RopeShift


class UnsupportedModelError(ValueError):
    """The engine's model is not one the layer runners can drive exactly."""


class ShiftRotator:
    """``semkv.realize.KeyRotator`` over each layer's ``RopeShift`` (the engine's own rotary
    angles; ``None``: a layer without RoPE, whose keys do not move)."""

    def __init__(self, shifts: Sequence[RopeShift | None]) -> None:
        self.shifts = list(shifts)
        # Per distinct table, the last deltas rotated by (a copy) and their factors: a
        # realization rotates every layer's keys by the same deltas, so the factors are computed
        # once per realization and table (layers built by one ``get_rope`` call share it).
        self._last: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}

    @classmethod
    def of_layers(cls, rotaries: Sequence[Any], neox: bool) -> ShiftRotator:
        """From each layer's vLLM rotary embedding (``None``: no RoPE in that layer); raises
        ``UnsupportedModelError`` naming what a shift cannot move."""
        built: dict[int, RopeShift] = {}
        shifts: list[RopeShift | None] = []
        for rotary in rotaries:
            if rotary is None:
                shifts.append(None)
                continue
            if id(rotary) not in built:
                shift = RopeShift.from_rotary(rotary, bool(getattr(rotary, "is_neox_style",
                                                                   neox)))
                if shift is None:
                    raise UnsupportedModelError(
                        f"rotary embedding {type(rotary).__name__}: {RopeShift.refusal(rotary)}")
                built[id(rotary)] = shift
            shifts.append(built[id(rotary)])
        return cls(shifts)

    def rotate(self, keys: torch.Tensor, deltas: torch.Tensor, layer: int) -> torch.Tensor:
        """``keys`` [..., T, head_dim] (post-RoPE) of ``layer`` moved by ``deltas`` [T]."""
        shift = self.shifts[layer]
        if shift is None:
            return keys
        # RopeShift takes token-major [T, heads, D]: bring the token axis first, flatten the rest.
        moved = keys.movedim(-2, 0)
        flat = moved.reshape(moved.shape[0], -1, moved.shape[-1])
        # RopeShift's tables live on the CPU (built once from the engine's rotary cache).
        on_cpu = deltas.to(torch.long).cpu()
        last = self._last.get(id(shift))
        if last is None or not torch.equal(last[0], on_cpu):  # [T] longs: cheap beside a layer
            last = self._last[id(shift)] = (on_cpu.clone(), shift.factors(on_cpu))
        out = shift.rotate(flat.cpu(), on_cpu, last[1]).to(keys.device)
        return out.reshape(moved.shape).movedim(0, -2)


def common_refusal(model: Any) -> str | None:
    """What no runner here drives exactly, whatever the family (None when nothing)."""
    inner = model.model
    layers = list(inner.layers)
    if not layers:
        return "no decoder layers"
    if getattr(inner, "start_layer", 0) != 0 or getattr(inner, "end_layer", len(layers)) != len(
            layers):
        return "pipeline-parallel shard (not every layer is local)"
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or getattr(attn, "qkv_proj", None) is None:
            return "a decoder layer without q/k/v-projected self-attention"
        if getattr(attn, "dual_chunk_attention_config", None):
            return "dual-chunk attention"
    return None


def family_refusal(model: Any, family: Family) -> str | None:
    """Why this model's layers are not what ``family`` computes (None when they are): its q/k
    norms present exactly where the family has them, Gemma's four norms where it has them."""
    for layer in model.model.layers:
        attn = layer.self_attn
        norms = getattr(attn, "q_norm", None) is not None and getattr(
            attn, "k_norm", None) is not None
        if family.qk_norms and not norms:
            return f"attention without {family.name}'s q/k norms"
        if not family.qk_norms and (norms or getattr(attn, "qk_norm", False)):
            return "per-head q/k norms"
        if family.sandwich_norms and any(getattr(layer, n, None) is None for n in SANDWICH_NORMS):
            return f"a decoder layer without {family.name}'s four norms"
    return None


def window_of(attn: Any) -> int | None:
    """The sliding window vLLM's kernel applies in this layer (None: full attention)."""
    window = getattr(getattr(attn, "attn", None), "sliding_window", None)
    return int(window) if window else None


def soft_cap_of(attn: Any) -> float | None:
    """The attention logits soft cap of this layer's kernel (None: none)."""
    cap = getattr(getattr(getattr(attn, "attn", None), "impl", None), "logits_soft_cap", None)
    return float(cap) if cap else None


def _intermediate(mlp: Any) -> int:
    """This rank's MLP width per token: gate and up of a dense MLP; of a sparse MoE block, its
    experts per token times an expert's width (what its fused kernel holds per token)."""
    gate_up = getattr(mlp, "gate_up_proj", None)
    if gate_up is not None:
        width = getattr(gate_up, "output_size_per_partition", None)  # this rank's gate + up
        return int(width if width is not None else gate_up.weight.shape[0]) // 2
    moe = getattr(getattr(mlp, "experts", None), "moe_config", None)
    if moe is not None:
        return int(moe.experts_per_token) * int(moe.intermediate_size)
    raise UnsupportedModelError(f"MLP {type(mlp).__name__}: width unknown")


class DecoderLayerRunner:
    """The engine's loaded decoder-only model run layer by layer over an explicit ``KVCache``.

    Subclasses (one per family) set ``family`` and, for what else the family may hold that
    the runner cannot run, ``refusal``."""

    refusal: Callable[[Any], str | None] = staticmethod(lambda model: None)
    neox = True  # the rotary pairing the family passes to vLLM's get_rope
    family: Family = LLAMA  # what its layers compute around the attention

    def __init__(self, model: Any,
                 context: Callable[[], AbstractContextManager[Any]] | None = None) -> None:
        reason = (common_refusal(model) or family_refusal(model, self.family)
                  or type(self).refusal(model))
        if reason is not None:
            raise UnsupportedModelError(f"{type(model).__name__}: {reason} is not supported")
        self.model = model
        self.context = context or nullcontext
        self._layers = list(model.model.layers)
        first = self._layers[0].self_attn
        self.num_layers = len(self._layers)
        self.num_heads = int(first.num_heads)  # this rank's heads under tensor parallelism
        self.kv_heads = int(first.num_kv_heads)
        self.head_dim = int(first.head_dim)
        weight = model.model.embed_tokens.weight
        self.dtype: torch.dtype = weight.dtype
        self.device: torch.device = weight.device
        self.windows = [window_of(layer.self_attn) for layer in self._layers]
        self.soft_caps = [soft_cap_of(layer.self_attn) for layer in self._layers]
        try:
            self.rotator = ShiftRotator.of_layers(
                [getattr(layer.self_attn, "rotary_emb", None) for layer in self._layers],
                self.neox)
            # read once here: every realization's memory check asks for it, and an MLP whose
            # width is unknown refuses the model at start-up, not inside a realization
            self._geometry = Geometry(
                layers=self.num_layers, kv_heads=self.kv_heads, heads=self.num_heads,
                head_dim=self.head_dim, hidden=int(weight.shape[1]),
                intermediate=max(_intermediate(layer.mlp) for layer in self._layers),
                dtype_bytes=self.dtype.itemsize)
        except UnsupportedModelError as exc:
            raise UnsupportedModelError(f"{type(model).__name__}: {exc}") from None

    @property
    def geometry(self) -> Geometry:
        """This rank's shape, for a realization's memory estimate (``semkv.realize.memory``)."""
        return self._geometry

    # -- building blocks --------------------------------------------------------------------

    def empty_cache(self, capacity: int) -> KVCache:
        return KVCache.zeros(self.num_layers, self.kv_heads, self.head_dim, capacity,
                             self.dtype, self.device)

    def embed(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        with torch.no_grad():
            return self._embed(ids)[None]

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        inner = self.model.model
        embed = getattr(inner, "embed_input_ids", None)  # the engine's own (scaled: Gemma)
        return embed(ids) if callable(embed) else inner.embed_tokens(ids)

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
        # where torch's own causal flag is the mask (and the cheapest path) unless a window
        # narrows it. One mask per distinct window, built once for all the layers.
        prefix = positions.numel() == context
        keys_at = torch.arange(context, device=self.device)
        masks: dict[int | None, torch.Tensor | None] = {}
        h = hidden[0]
        with torch.no_grad(), self.context():
            for index in layers:
                window = self.windows[index]
                if window is not None and window >= context:
                    window = None  # no key lies out of this window: plain causal attention
                if window not in masks:
                    masks[window] = (None if prefix and window is None
                                     else visible(keys_at, positions, window))
                h = self._layer(index, cache, h, positions, context, masks[window], attention)
        return h[None]

    def _layer(self, index: int, cache: KVCache, h: torch.Tensor, positions: torch.Tensor,
               context: int, mask: torch.Tensor | None,
               attention: torch.Tensor | None) -> torch.Tensor:
        def attend(x: torch.Tensor) -> torch.Tensor:
            return self._attend(index, cache, x, positions, context, mask, attention)

        return block(self.family, self._layers[index], h, attend)

    def _attend(self, index: int, cache: KVCache, x: torch.Tensor, positions: torch.Tensor,
                context: int, mask: torch.Tensor | None,
                attention: torch.Tensor | None) -> torch.Tensor:
        """One layer's attention output (after ``o_proj``) for the normed input ``x``."""
        attn = self._layers[index].self_attn
        tokens = x.shape[0]
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        if self.family.qk_norms:
            q, k = per_head(attn.q_norm, q, self.head_dim), per_head(attn.k_norm, k, self.head_dim)
        rotary = getattr(attn, "rotary_emb", None)
        if rotary is not None:
            q, k = rotary(positions, q, k)  # the engine's own RoPE (in place on CPU)
        q = q.reshape(tokens, self.num_heads, self.head_dim).transpose(0, 1)[None]
        k = k.reshape(tokens, self.kv_heads, self.head_dim).transpose(0, 1)[None]
        v = v.reshape(tokens, self.kv_heads, self.head_dim).transpose(0, 1)[None]
        # Fresh KV first, so computed tokens attend to each other's fresh values.
        cache.keys[index][:, :, positions] = k.to(cache.keys[index].dtype)
        cache.values[index][:, :, positions] = v.to(cache.values[index].dtype)
        keys = cache.keys[index][:, :, :context]
        values = cache.values[index][:, :, :context]
        cap = self.soft_caps[index]
        if attention is not None or cap is not None:
            weights = self._weights(q, keys, positions, attn.scaling, cap, mask)
            if attention is not None:
                attention[:context] += weights.sum(dim=(0, 1)).to(attention.device)
        if cap is None:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=mask is None, scale=attn.scaling,
                enable_gqa=True)[0]
        else:  # SDPA has no soft cap: the weights computed above, applied
            groups = self.num_heads // self.kv_heads
            out = torch.matmul(weights.to(values.dtype),
                               values[0].repeat_interleave(groups, dim=0))
        out = out.transpose(0, 1).reshape(tokens, self.num_heads * self.head_dim)
        o, _ = attn.o_proj(out)
        return o

    def _weights(self, q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                 scale: float, cap: float | None,
                 mask: torch.Tensor | None) -> torch.Tensor:
        """The queries' softmax weights ``[heads, queries, keys]`` (fp32), soft cap applied:
        what SDPA computes without returning it. The query probe asks for a few queries
        (``semkv.realize.query``); a soft-capped layer uses them as its attention."""
        groups = self.num_heads // self.kv_heads
        k = keys[0].to(torch.float32).repeat_interleave(groups, dim=0)  # [heads, ctx, D]
        scores = torch.matmul(q[0].to(torch.float32), k.transpose(1, 2)) * scale
        scores = soft_cap(scores, cap)
        seen = mask if mask is not None else visible(
            torch.arange(k.shape[1], device=q.device), positions, None)
        scores = scores.masked_fill(~seen[None], float("-inf"))
        return torch.softmax(scores, dim=-1)

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
