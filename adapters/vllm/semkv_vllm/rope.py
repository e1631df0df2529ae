"""Positional re-rotation of cached keys: move a key computed at donor position q to target p.

Rotary embeddings rotate each (pair of) key channel(s) by ``position * inv_freq``; for every
rotary variant whose angle is linear in the position (default, linear, dynamic-NTK, llama3,
YaRN: YaRN also scales cos and sin by one constant, which cancels out here), moving a key from q
to p is one more rotation by ``p - q``. ``RopeShift`` reads the angles from the model's own
vLLM rotary embedding (``get_rope`` with the parameters from the engine's model config) and
checks that they really are linear before it agrees to shift anything.

NOTE: keys are rotated in fp32 whatever the cache dtype, then cast back.
NOTE: architectures are listed with their channel pairing (neox halves or interleaved pairs)
as their vLLM model code declares it; an unlisted architecture gets no shifts, and requests
that would need one are rejected with a counted reason, never served.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# Architecture -> is_neox_style, exactly as the vLLM model code passes it to get_rope.
NEOX_STYLE: dict[str, bool] = {
    "LlamaForCausalLM": True,
    "MistralForCausalLM": True,
    "Qwen2ForCausalLM": True,
    "Qwen3ForCausalLM": True,
    "Qwen3MoeForCausalLM": True,
    "GPTJForCausalLM": False,
}


@dataclass(frozen=True)
class RopeShift:
    """Rotate keys by per-token position deltas using the model's own rotary angles."""

    cos: torch.Tensor  # [max_position, rotary_dim // 2], unit magnitude, fp32
    sin: torch.Tensor
    rotary_dim: int
    neox: bool

    @staticmethod
    def refusal(rotary: Any) -> str:
        """Why ``from_rotary`` gave no shift for ``rotary``."""
        if getattr(rotary, "cos_sin_cache", None) is None:
            return "no cos/sin table (its angles depend on more than the position)"
        return "angles are not linear in the position"

    @classmethod
    def from_rotary(cls, rotary: Any, neox: bool) -> RopeShift | None:
        """The shift for a vLLM rotary embedding, or None: a variant without one cos/sin table
        (LongRoPE, dual-chunk) or whose angles are not linear in the position (``refusal``)."""
        table = getattr(rotary, "cos_sin_cache", None)
        if table is None:
            return None
        cache = table.detach().to("cpu", torch.float32)
        half = cache.shape[-1] // 2
        cos, sin = cache[:, :half], cache[:, half:]
        magnitude = torch.sqrt(cos * cos + sin * sin).clamp_min(1e-12)
        shift = cls(cos / magnitude, sin / magnitude, int(rotary.rotary_dim), neox)
        return shift if shift.is_linear() else None

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> RopeShift | None:
        """The shift for the engine's model, or None when its positions cannot be moved."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.rotary_embedding import get_rope

        model_config = vllm_config.model_config
        neox = NEOX_STYLE.get((model_config.architectures or [""])[0])
        hf = model_config.hf_text_config
        if neox is None or getattr(model_config, "uses_mrope", False):
            return None
        with set_current_vllm_config(vllm_config):
            rotary = get_rope(model_config.get_head_size(),
                              max_position=hf.max_position_embeddings,
                              rope_parameters=getattr(hf, "rope_parameters", None),
                              is_neox_style=neox, dtype=torch.float32)
        return cls.from_rotary(rotary, neox)

    def is_linear(self, samples: int = 64) -> bool:
        """angle(p) - angle(q) == angle(p - q) for sampled positions (mod 2*pi)."""
        n = self.cos.shape[0]
        if n < 2:
            return False
        gen = torch.Generator().manual_seed(0)
        p = torch.randint(0, n, (samples,), generator=gen)
        q = torch.randint(0, n, (samples,), generator=gen)
        p, q = torch.maximum(p, q), torch.minimum(p, q)
        # cos/sin of (p - q) from the table vs from the angle difference identities. The
        # engine builds its table in fp32: an angle near position n carries a rounding error
        # up to n * eps / 2 radians (2e-3 at Gemma 3's 32,768 positions), which the identities
        # add up three times; a rotary whose angles are not linear is off by O(1).
        atol = 1e-3 + 2 * n * torch.finfo(torch.float32).eps
        c = self.cos[p] * self.cos[q] + self.sin[p] * self.sin[q]
        s = self.sin[p] * self.cos[q] - self.cos[p] * self.sin[q]
        return bool(torch.allclose(c, self.cos[p - q], atol=atol)
                    and torch.allclose(s, self.sin[p - q], atol=atol))

    @property
    def max_shift(self) -> int:
        return int(self.cos.shape[0]) - 1

    def factors(self, deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ``[tokens, 1, rotary_dim // 2]`` of ``deltas`` [tokens]: the same
        for every layer of a realization, so its worker computes them once (``rotate``)."""
        if deltas.numel() and int(deltas.abs().max()) > self.max_shift:
            raise ValueError("position shift beyond the rotary table")
        idx = deltas.abs().long()
        cos = self.cos[idx].unsqueeze(1)
        sin = (self.sin[idx] * torch.sign(deltas).to(torch.float32).unsqueeze(1)).unsqueeze(1)
        return cos, sin

    def rotate(self, keys: torch.Tensor, deltas: torch.Tensor,
               factors: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``keys`` [tokens, heads, head_size] moved by ``deltas`` [tokens] positions
        (``factors``: ``self.factors(deltas)``, when the caller already has them)."""
        if keys.shape[0] != deltas.shape[0]:
            raise ValueError("one delta per token")
        cos, sin = self.factors(deltas) if factors is None else factors
        k = keys.to(torch.float32)
        rot = k[..., : self.rotary_dim]
        if self.neox:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        out = k.clone()
        if self.neox:
            out[..., : self.rotary_dim] = torch.cat((y1, y2), dim=-1)
        else:
            out[..., 0 : self.rotary_dim : 2], out[..., 1 : self.rotary_dim : 2] = y1, y2
        return out.to(keys.dtype)
