"""RoPE re-rotation of cached keys, built from the model config and checked against the model.

Protocol: ``RopeRotator.from_model(model)`` reads the rotary parameters from the Hugging Face
config (``rope_parameters``: theta, rope type and scaling; ``head_dim``), computes the inverse
frequencies with transformers' own initialiser for that rope type, and then checks them against
the model's own rotary embedding (``model.model.rotary_emb``): its ``inv_freq`` buffer and the
cos/sin it returns for sample positions. ``rotate(keys, deltas)`` moves keys computed at donor
position q to target position p = q + delta. ``LayerRotator.from_model(model)`` is the
runner's ``KeyRotator``: one ``RopeRotator`` per layer, per layer type where the config keeps
rotary parameters per type (Gemma 3).

Why one extra rotation is exact: RoPE rotates each channel pair by ``position * inv_freq``, and
rotations of the same plane compose, so R(p) = R(p - q) R(q). The model may scale cos and sin by
a constant (YaRN's attention factor); a cached key already carries it, so the extra rotation is
a pure one (unit cos/sin). Rope types whose angles depend on the sequence length (dynamic NTK,
longrope) are refused: a cached key's angle could not be moved by one rotation.

Channel pairing is the neox ("rotate_half") pairing that Llama uses in transformers: channel i
pairs with channel i + rotary_dim / 2.

NOTE: rotation runs in fp32 (angles in fp64) whatever the cache dtype, then casts back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# Rope types whose angle is position * inv_freq with inv_freq fixed: movable by one rotation.
LINEAR_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn", "proportional"})
CHECK_POSITIONS = (0, 1, 7, 100, 1000, 4095)
# transformers computes the angles in fp32: at position 4,095 one carries up to ~2.4e-4 rad of
# rounding (seen on Gemma 3 270M's 128 frequencies); a wrong base or rope type is off by O(1).
CHECK_ATOL = 1e-4 + 2 * max(CHECK_POSITIONS) * float(torch.finfo(torch.float32).eps)


class UnsupportedRope(ValueError):
    """The model's rotary embedding cannot be moved by a single extra rotation."""


def layer_rope_types(config: Any) -> list[str] | None:
    """Each layer's rotary parameters' key where the config keeps one set per layer type
    (Gemma 3: ``rope_parameters[layer_types[i]]``), else None (one set for every layer)."""
    params = getattr(config, "rope_parameters", None) or {}
    types = getattr(config, "layer_types", None)
    if types is None or not all(isinstance(params.get(t), dict) for t in set(types)):
        return None
    return list(types)


def _rope_type(config: Any, layer_type: str | None = None) -> str:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    return str(params.get("rope_type", "default"))


def _inv_freq_from_config(config: Any, rotary_cls: Any,
                          layer_type: str | None = None) -> torch.Tensor:
    """Inverse frequencies exactly as transformers derives them from this config (for one
    layer type where the config keeps several)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = _rope_type(config, layer_type)
    if rope_type not in LINEAR_ROPE_TYPES:
        raise UnsupportedRope(f"rope type {rope_type!r}: angles are not linear in the position")
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    if rope_type == "default":
        inv_freq, _ = rotary_cls.compute_default_rope_parameters(config, **kwargs)
    else:
        inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, **kwargs)
    return torch.as_tensor(inv_freq, dtype=torch.float32).detach().cpu()


@dataclass(frozen=True)
class RopeRotator:
    """Rotate keys ``[..., tokens, head_dim]`` by per-token position deltas."""

    inv_freq: torch.Tensor  # [rotary_dim // 2], fp32
    head_dim: int

    @property
    def rotary_dim(self) -> int:
        return 2 * int(self.inv_freq.shape[0])

    @classmethod
    def from_model(cls, model: Any, layer_type: str | None = None) -> RopeRotator:
        """The rotator for a transformers causal LM (for the layers of ``layer_type`` where the
        config keeps one rotary per layer type), verified against its rotary embedding."""
        config = model.config
        rotary = model.model.rotary_emb
        head_dim = int(getattr(config, "head_dim", None)
                       or config.hidden_size // config.num_attention_heads)
        rotator = cls(_inv_freq_from_config(config, type(rotary), layer_type), head_dim)
        rotator.check_against(rotary, layer_type)
        return rotator

    def check_against(self, rotary: Any, layer_type: str | None = None) -> None:
        """Raise UnsupportedRope unless the model's rotary embedding uses these angles."""
        prefix = "" if layer_type is None else f"{layer_type}_"
        own = getattr(rotary, f"{prefix}inv_freq").detach().to("cpu", torch.float32)
        if own.shape != self.inv_freq.shape or not torch.allclose(own, self.inv_freq, rtol=1e-6):
            raise UnsupportedRope("config-derived inverse frequencies differ from the model's")
        if self.rotary_dim != self.head_dim:
            raise UnsupportedRope("partial rotary embeddings are not supported")
        positions = torch.tensor([CHECK_POSITIONS], dtype=torch.long)
        probe = torch.zeros(1, dtype=torch.float32)
        extra = () if layer_type is None else (layer_type,)
        cos, sin = rotary(probe, positions, *extra)  # [1, P, head_dim], x attention_scaling
        cos, sin = cos[0].to(torch.float32), sin[0].to(torch.float32)
        scale = torch.sqrt(cos * cos + sin * sin)
        want_cos, want_sin = self._cos_sin(positions[0])
        if not (torch.allclose(cos / scale, want_cos, atol=CHECK_ATOL)
                and torch.allclose(sin / scale, want_sin, atol=CHECK_ATOL)):
            raise UnsupportedRope("the model's rotary angles are not position * inv_freq")

    def _cos_sin(self, deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of delta * inv_freq, duplicated over both neox halves: [T, head_dim]."""
        # fp64 angles: delta * inv_freq reaches thousands of radians, where fp32 loses ~1e-4.
        angles = deltas.to(torch.float64)[:, None] * self.inv_freq.to(torch.float64)[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(torch.float32), angles.sin().to(torch.float32)

    def rotate(self, keys: torch.Tensor, deltas: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """``keys`` [..., T, head_dim] (post-RoPE) moved by ``deltas`` [T] positions (one table:
        ``layer`` is unused; ``LayerRotator`` picks a table per layer)."""
        if keys.shape[-2] != deltas.shape[0]:
            raise ValueError("one delta per token")
        if keys.shape[-1] != self.head_dim:
            raise ValueError("keys must end with head_dim channels")
        cos, sin = self._cos_sin(deltas.cpu())
        cos, sin = cos.to(keys.device), sin.to(keys.device)
        k = keys.to(torch.float32)
        half = self.head_dim // 2
        rotated_half = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
        return (k * cos + rotated_half * sin).to(keys.dtype)


@dataclass(frozen=True)
class LayerRotator:
    """``semkv.realize.KeyRotator`` of a transformers causal LM: each layer's own table (one for
    every layer, or one per layer type: Gemma 3's window layers turn at another base)."""

    layers: tuple[RopeRotator, ...]

    @classmethod
    def from_model(cls, model: Any) -> LayerRotator:
        types = layer_rope_types(model.config)
        if types is None:
            return cls((RopeRotator.from_model(model),) * int(model.config.num_hidden_layers))
        by_type = {t: RopeRotator.from_model(model, t) for t in sorted(set(types))}
        return cls(tuple(by_type[t] for t in types))

    def rotate(self, keys: torch.Tensor, deltas: torch.Tensor, layer: int) -> torch.Tensor:
        return self.layers[layer].rotate(keys, deltas)
