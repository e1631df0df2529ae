"""semkv.research: exactness of KV assembly, re-rotation and recompute on the bundled model.

Short random token sequences (ids well inside the vocabulary, no special tokens), fp32, eager
attention; the model is loaded once for the module.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from semkv.research import (  # noqa: E402
    DonorStore,
    LayerwiseModel,
    Strategy,
    assemble,
    plan_reuse,
    prefill,
)
from semkv.research._deps import require  # noqa: E402
from semkv.research.flops import FlopModel  # noqa: E402
from semkv.research.generate import answer_logprob, greedy  # noqa: E402
from semkv.research.quality import (  # noqa: E402
    first_divergence,
    lcs_length,
    rouge_l,
    score_generation,
    token_f1,
)
from tests.bundled_lm import bundled_layerwise_model  # noqa: E402

LOGIT_ATOL = 1e-3  # logits are O(10); fp32 noise of a different but equivalent op order
KV_ATOL = 1e-4


@pytest.fixture(scope="module")
def lm() -> Iterator[LayerwiseModel]:
    with bundled_layerwise_model() as model:
        yield model


def _tokens(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 20000, (n,), generator=gen).tolist()


def _hf_logits(lm: LayerwiseModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return lm.model(torch.tensor([ids])).logits[0].to(torch.float32)


def _store(lm: LayerwiseModel, **donors: list[int]) -> DonorStore:
    store = DonorStore(lm, chunk_tokens=32)
    for name, ids in donors.items():
        store.add(name, ids)
    return store


# -- exactness -------------------------------------------------------------------------------

def test_full_prefill_matches_the_models_own_forward(lm: LayerwiseModel) -> None:
    ids = _tokens(1, 40)
    _, logits = lm.full_prefill(ids)
    assert torch.allclose(logits, _hf_logits(lm, ids), atol=LOGIT_ATOL)


def test_every_token_recomputed_equals_full_prefill(lm: LayerwiseModel) -> None:
    shared = _tokens(2, 40)
    donor, target = _tokens(3, 9) + shared, _tokens(4, 5) + shared + _tokens(5, 6)
    store = _store(lm, donor=donor)
    plan = plan_reuse(target, store.token_map(), chunk_tokens=32)
    assert plan.reused_tokens >= 36 and plan.shifted_tokens > 0  # a shifted chunk is reused
    reference_cache, reference = lm.full_prefill(target)
    for strategy in (Strategy.blend(1.0), Strategy.first(64)):
        result = prefill(lm, target, plan, store, strategy)
        assert result.reused_tokens == 0
        assert torch.allclose(result.logits, reference[-1], atol=LOGIT_ATOL)
        for layer in range(lm.num_layers):
            assert torch.allclose(result.cache.keys[layer], reference_cache.keys[layer],
                                  atol=KV_ATOL)
            assert torch.allclose(result.cache.values[layer], reference_cache.values[layer],
                                  atol=KV_ATOL)
    assert torch.allclose(reference[-1], _hf_logits(lm, target)[-1], atol=LOGIT_ATOL)


def test_identical_tokens_at_identical_positions_need_no_recompute(lm: LayerwiseModel) -> None:
    prefix = _tokens(6, 40)
    donor, target = prefix + _tokens(7, 12), prefix + _tokens(8, 12)
    store = _store(lm, donor=donor)
    plan = plan_reuse(target, store.token_map(), chunk_tokens=32)
    assert plan.reused_tokens == 40 and plan.shifted_tokens == 0
    result = prefill(lm, target, plan, store, Strategy.none())
    assert result.reused_tokens == 40
    assert torch.allclose(result.logits, _hf_logits(lm, target)[-1], atol=LOGIT_ATOL)


# -- re-rotation -----------------------------------------------------------------------------

def test_rotation_by_d_then_minus_d_is_the_identity(lm: LayerwiseModel) -> None:
    keys = torch.randn(1, lm.kv_heads, 16, lm.head_dim, generator=torch.Generator().manual_seed(9))
    deltas = torch.randint(-3000, 3000, (16,), generator=torch.Generator().manual_seed(10))
    back = lm.rotator.rotate(lm.rotator.rotate(keys, deltas, 0), -deltas, 0)
    assert torch.allclose(back, keys, atol=1e-5)
    assert torch.equal(lm.rotator.rotate(keys, torch.zeros(16, dtype=torch.long), 0), keys)


def test_rerotation_equals_the_models_rotary_embedding_at_the_new_position(
    lm: LayerwiseModel,
) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(11)
    raw = torch.randn(1, lm.kv_heads, 24, lm.head_dim, generator=gen)  # keys before RoPE
    q_pos = torch.randint(0, 2048, (24,), generator=gen)
    p_pos = torch.randint(0, 2048, (24,), generator=gen)
    rotary = lm.model.model.rotary_emb

    def model_rope(positions: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary(raw, positions[None, :])
        _, k = apply_rotary_pos_emb(raw, raw, cos, sin)
        return k

    moved = lm.rotator.rotate(model_rope(q_pos), p_pos - q_pos, 0)
    # The model itself computes angles in fp32 (position * inv_freq loses ~position * 6e-8
    # radians), so at positions up to 2K its own keys carry errors of ~1e-4.
    assert torch.allclose(moved, model_rope(p_pos), atol=3e-4)


def test_shifted_chunk_needs_rerotation(lm: LayerwiseModel) -> None:
    chunk = _tokens(12, 40)
    donor, target = _tokens(13, 90) + chunk, _tokens(14, 10) + chunk + _tokens(15, 6)
    store = _store(lm, donor=donor)
    plan = plan_reuse(target, store.token_map(), chunk_tokens=32)
    assert [(s.target_start, s.donor_start, s.length) for s in plan.segments] == [(10, 90, 40)]
    reference_cache, reference = lm.full_prefill(target)
    rotated = assemble(plan, store, lm)
    unrotated = assemble(plan, store, lm, rotate=False)
    span = slice(10, 50)
    # Layer 0 KV is context-free: re-rotated donor keys are exactly the target's own.
    want = reference_cache.keys[0][:, :, span]
    assert torch.allclose(rotated.keys[0][:, :, span], want, atol=KV_ATOL)
    assert (unrotated.keys[0][:, :, span] - want).abs().max() > 0.1
    assert torch.allclose(rotated.values[0][:, :, span], reference_cache.values[0][:, :, span],
                          atol=KV_ATOL)
    # Deeper layers differ by the missing context only; without re-rotation, by much more.
    with_rotation = prefill(lm, target, plan, store, Strategy.none())
    without = prefill(lm, target, plan, store, Strategy.none(), rotate=False)
    error = (with_rotation.logits - reference[-1]).norm()
    assert error < (without.logits - reference[-1]).norm()


def test_several_donors_serve_their_own_chunks(lm: LayerwiseModel) -> None:
    first, second = _tokens(16, 32), _tokens(17, 32)
    store = _store(lm, a=_tokens(18, 5) + first, b=second + _tokens(19, 20))
    target = second + first + _tokens(20, 4)
    plan = plan_reuse(target, store.token_map(), chunk_tokens=32)
    assert [(s.donor_id, s.target_start, s.donor_start) for s in plan.segments] == [
        ("b", 0, 0), ("a", 32, 5)]
    cache = assemble(plan, store, lm)
    reference_cache, _ = lm.full_prefill(target)
    assert torch.allclose(cache.keys[0][:, :, :64], reference_cache.keys[0][:, :, :64],
                          atol=KV_ATOL)


# -- strategies, generation, costs -----------------------------------------------------------

def test_strategies_compute_what_they_promise(lm: LayerwiseModel) -> None:
    shared = _tokens(21, 48)
    store = _store(lm, donor=_tokens(22, 7) + shared)
    target = _tokens(23, 3) + shared + _tokens(24, 5)
    plan = plan_reuse(target, store.token_map(), chunk_tokens=32)
    n, flops = len(target), FlopModel.from_config(lm.config)
    none = prefill(lm, target, plan, store, Strategy.none())
    first = prefill(lm, target, plan, store, Strategy.first(4))
    blend = prefill(lm, target, plan, store, Strategy.blend(0.25))
    assert none.recomputed_tokens == n - plan.reused_tokens
    assert first.recomputed_tokens == none.recomputed_tokens + 4 * len(plan.segments)
    assert blend.recomputed_tokens == none.recomputed_tokens + round(0.25 * n)
    assert [len(layers) for layers, _ in blend.passes] == [2, lm.num_layers - 2]
    saved = [flops.saved(r.passes, n, lm.num_layers) for r in (none, first, blend)]
    assert 1.0 > saved[0] > saved[1] > saved[2] > 0.0


def test_greedy_and_logprob_match_the_models_own(lm: LayerwiseModel) -> None:
    prompt = _tokens(25, 20)
    store = _store(lm)
    result = prefill(lm, prompt, plan_reuse(prompt, {}), store, Strategy.full(), capacity=26)
    answer = greedy(lm, result, 5)
    with torch.no_grad():
        generated = lm.model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False,
                                      min_new_tokens=5)
    assert answer == generated[0, 20:].tolist()
    logprobs = torch.log_softmax(_hf_logits(lm, prompt + answer)[19:24], dim=-1)
    want = float(logprobs[torch.arange(5), torch.tensor(answer)].mean())
    assert answer_logprob(lm, result, answer) == pytest.approx(want, abs=1e-4)
    assert greedy(lm, result, 1, suppress_ids={answer[0]})[0] != answer[0]


# -- provider discovery ----------------------------------------------------------------------

def test_providers_discover_the_true_donor_and_record_negatives(lm: LayerwiseModel) -> None:
    from transformers import AutoTokenizer

    from semkv.bundled_model import ensure_model
    from semkv.research.study import StudyConfig, run_study

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model()))
    config = StudyConfig(clusters_per_type=1, target_tokens=64, max_new_tokens=3,
                         kinds=("exact_control", "negative_unrelated"),
                         strategies=(Strategy.none(),), controls=False)
    providers = ("chunks", "minhash")
    result = run_study(lm, tokenizer, config, providers=providers)
    # per target: the reference, the ground-truth donor, one discovered run per provider
    assert len(result.runs) == 2 * (2 + len(providers))
    assert result.config["providers"] == list(providers)
    runs = {(r["kind"], r["donor_mode"], r.get("provider")): r for r in result.runs}
    summary = result.summary()
    true = runs["exact_control", "true_donor", None]
    assert summary["exact_control"]["true_donor"]["none"]["n"] == 1.0  # old keys unchanged
    for provider in providers:
        found = runs["exact_control", "discovered", provider]
        assert found["proposed"] and found["discovered_correct"] is True
        assert found["donor_id"] == true["donor_id"] and found["false_positive"] is None
        assert found["reused_tokens"] == true["reused_tokens"] > 0
        negative = runs["negative_unrelated", "discovered", provider]
        assert negative["discovered_correct"] is None
        if negative["donor_id"] is None:  # nothing proposed: a full prefill, the reference
            assert negative["false_positive"] is False and negative["no_donor"]
            assert negative["reused_tokens"] == 0 and negative["exact_match"]
            assert negative["flops_saved"] == 0.0
        else:
            assert negative["false_positive"] is True and negative["candidates"] >= 1
        means = summary["negative_unrelated"][f"discovered:{provider}"]["none"]
        assert means["false_positive"] == float(negative["donor_id"] is not None)
        assert summary["exact_control"][f"discovered:{provider}"]["none"][
            "discovered_correct"] == 1.0


# -- metrics and packaging -------------------------------------------------------------------

def test_quality_metrics_on_hand_made_tokens() -> None:
    assert lcs_length([1, 2, 3, 4], [1, 3, 4, 5]) == 3
    assert rouge_l([1, 2, 3, 4], [1, 3, 4, 5]) == pytest.approx(0.75)
    assert rouge_l([], []) == 1.0 and rouge_l([1], []) == 0.0
    assert token_f1([1, 1, 2], [1, 2, 2]) == pytest.approx(2 / 3)
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    scores = score_generation([7, 8, 9], [7, 8, 9], reference_logprob=-1.0, reuse_logprob=-1.5)
    assert scores.exact_match and scores.first_divergence == 3 and scores.rouge_l == 1.0
    assert scores.logprob_delta == pytest.approx(-0.5)
    assert not score_generation([7, 9], [7, 8]).exact_match


def test_missing_dependency_names_the_extra() -> None:
    with pytest.raises(ImportError, match=r"semkv\[research\]"):
        require("semkv_surely_not_installed_module")
