"""``semkv.research.LayerwiseModel`` on every family it runs (issue #49), against transformers'
own forward of the same model: tiny random-weight models of tests/tiny_engine_model.py (Mistral
with and without a window, Qwen2, Qwen3, Qwen3-MoE, Gemma 2 with a binding soft cap, Gemma 3
with per-type rotary bases), a ~580-token prompt crossing their 64-token windows nine times.

- a full prefill's logits at every position equal the model's own eager forward (fp32, 1e-3
  absolute on logits of magnitude ~10), and where the model has windows or a soft cap, the
  runner without them is off by more than 10x that (the check can fail);
- the second half computed over a cache whose first half a first call filled equals one pass
  (2e-4 on K/V, 1e-3 on logits): the subset-of-positions path the strategies use;
- the rotator moves each layer's keys by that layer's own table: keys computed at positions q
  and moved to p equal the keys computed at p, layer by layer (layer 0's keys depend only on
  the token and its position).

The engine's runner on the same models: tests/test_engine_families.py, which also checks that
engine and research recompute the same tokens under one plan.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.bundled_lm import layerwise_model  # noqa: E402
from tests.engine_utils import essay_prompts  # noqa: E402
from tests.tiny_engine_model import WINDOW, tiny_model_dir  # noqa: E402

FAMILIES = ["mistral", "mistral-windowed", "qwen2", "qwen3", "qwen3-moe", "gemma2",
            "gemma3-norms"]
LOGIT_ATOL, KV_ATOL = 1e-3, 2e-4


@pytest.fixture(scope="module", params=FAMILIES)
def lm(request: pytest.FixtureRequest) -> Iterator[Any]:
    with layerwise_model(tiny_model_dir(request.param)) as model:
        yield model


@pytest.fixture(scope="module")
def ids(lm: Any) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(lm.model.name_or_path)
    out = list(tok(essay_prompts(1, seed=5)[0])["input_ids"])
    assert len(out) >= 8 * WINDOW
    return out


def own_logits(lm: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return lm.model(torch.tensor([ids])).logits[0].to(torch.float32)


def test_a_prefill_equals_the_models_own_forward(lm, ids):
    want = own_logits(lm, ids)
    _, got = lm.full_prefill(ids)
    error = float((got - want).abs().max())
    assert error <= LOGIT_ATOL, error
    for kind in ("windows", "soft_caps"):
        if not any(getattr(lm, kind)):
            continue
        kept = getattr(lm, kind)
        setattr(lm, kind, [None] * lm.num_layers)
        try:
            _, dropped = lm.full_prefill(ids)
        finally:
            setattr(lm, kind, kept)
        assert float((dropped - want).abs().max()) > 10 * LOGIT_ATOL, kind


def test_the_second_half_over_the_first_halfs_cache_equals_one_pass(lm, ids):
    one, logits = lm.full_prefill(ids)
    half = len(ids) // 2
    cache = lm.empty_cache(len(ids))
    lm.run_layers(cache, lm.embed(ids[:half]), torch.arange(half))
    rest = lm.forward(cache, ids[half:], torch.arange(half, len(ids)))
    assert float((rest - logits[half:]).abs().max()) <= LOGIT_ATOL
    for layer in range(lm.num_layers):
        assert torch.allclose(cache.keys[layer], one.keys[layer], atol=KV_ATOL)
        assert torch.allclose(cache.values[layer], one.values[layer], atol=KV_ATOL)


def test_each_layers_keys_move_by_its_own_table(lm, ids):
    """Layer 0's keys depend on the token and its position only: computed at q, moved by p - q,
    they equal the same tokens computed at p; each layer's table is checked on the rotary
    embedding itself (its keys past layer 0 depend on the context)."""
    n = 64
    tokens = ids[:n]
    shift = 300
    at_q = lm.empty_cache(n)
    lm.run_layers(at_q, lm.embed(tokens), torch.arange(n), range(1))
    at_p = lm.empty_cache(n + shift)
    # the same tokens at positions shift..shift+n-1, each its own first token (no context:
    # one call per token would be slow; layer 0's keys are the projection and RoPE only)
    lm.run_layers(at_p, lm.embed(tokens), torch.arange(shift, shift + n), range(1))
    moved = lm.rotator.rotate(at_q.keys[0][0], torch.full((n,), shift), 0)
    assert torch.allclose(moved, at_p.keys[0][0][:, shift:], atol=KV_ATOL)
    types = {id(r) for r in lm.rotator.layers}
    if lm.model.config.model_type == "gemma3_text":
        assert len(types) == 2  # window layers and full layers turn at their own bases
