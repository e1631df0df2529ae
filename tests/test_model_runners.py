"""What the family layer runners refuse, and that they refuse it when built (the worker's
start-up), naming the architecture and the reason (issue #49). Without an engine: each fake is
a plain torch module shaped like the vLLM model it stands for, named so; only the attributes
the refusal reads exist. The runners on real engine models: tests/test_engine_families.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from semkv_vllm.models import RUNNERS, UnsupportedModelError, runner_for  # noqa: E402


class FakeAttention(torch.nn.Module):
    def __init__(self, *, norms: bool = False, dual_chunk: bool = False) -> None:
        super().__init__()
        self.qkv_proj = torch.nn.Linear(4, 12)
        if norms:
            self.q_norm, self.k_norm = torch.nn.LayerNorm(4), torch.nn.LayerNorm(4)
        self.dual_chunk_attention_config = {"chunk_size": 8} if dual_chunk else None


class FakeLayer(torch.nn.Module):
    def __init__(self, *, gemma_norms: bool = False, **attention: bool) -> None:
        super().__init__()
        self.self_attn = FakeAttention(**attention)
        if gemma_norms:
            for name in ("input_layernorm", "post_attention_layernorm",
                         "pre_feedforward_layernorm", "post_feedforward_layernorm"):
                setattr(self, name, torch.nn.LayerNorm(4))


def fake_model(architecture: str, layers: int = 2, **attention: bool) -> torch.nn.Module:
    inner = torch.nn.Module()
    inner.layers = torch.nn.ModuleList(FakeLayer(**attention) for _ in range(layers))
    model = type(architecture, (torch.nn.Module,), {})()
    model.model = inner
    return model


@pytest.mark.parametrize(("architecture", "attention", "reason"), [
    ("Qwen2ForCausalLM", {"norms": True}, "per-head q/k norms"),
    ("Qwen3ForCausalLM", {}, "attention without Qwen3's q/k norms"),
    ("Qwen3ForCausalLM", {"norms": True, "dual_chunk": True}, "dual-chunk attention"),
    ("LlamaForCausalLM", {"dual_chunk": True}, "dual-chunk attention"),
    ("Gemma2ForCausalLM", {}, "a decoder layer without Gemma 2's four norms"),
    ("Gemma2ForCausalLM", {"gemma_norms": True, "norms": True}, "per-head q/k norms"),
    ("Gemma3ForCausalLM", {"gemma_norms": True}, "attention without Gemma 3's q/k norms"),
])
def test_a_variant_the_family_runner_cannot_run_exactly_is_refused_by_name(
        architecture, attention, reason):
    with pytest.raises(UnsupportedModelError, match=f"{architecture}: {reason} is not supported"):
        runner_for(fake_model(architecture, **attention))


def test_a_pipeline_parallel_shard_and_an_empty_model_are_refused():
    shard = fake_model("LlamaForCausalLM", layers=4)
    shard.model.start_layer, shard.model.end_layer = 2, 4
    with pytest.raises(UnsupportedModelError, match="pipeline-parallel shard"):
        runner_for(shard)
    with pytest.raises(UnsupportedModelError, match="no decoder layers"):
        runner_for(fake_model("LlamaForCausalLM", layers=0))


@pytest.mark.parametrize("architecture", [
    "DeepseekV3ForCausalLM",  # MLA: a latent cache, no per-head K/V to copy or re-rotate
    "JambaForCausalLM",  # hybrid SSM: state, not positions
    "Qwen3NextForCausalLM",  # linear attention beside full attention
])
def test_an_architecture_without_a_runner_is_refused_naming_the_supported_ones(architecture):
    assert architecture not in RUNNERS
    with pytest.raises(UnsupportedModelError, match=f"no layer runner for architecture "
                                                    f"'{architecture}'; supported: .*Qwen3"):
        runner_for(fake_model(architecture))


def test_the_worker_logs_why_it_cannot_realize_legibly_and_reports_it_whole(caplog):
    """The reason for an architecture without a runner lists the supported ones: longer than a
    log line's string bound (``semkv.log.MAX_STRING``, past which a value is redacted as
    payload). The log keeps its legible start; the scheduler gets it whole."""
    import logging

    from semkv_vllm.realization import SpanRealizer

    caplog.set_level(logging.INFO, logger="semkv")
    why = SpanRealizer.build(fake_model("DeepseekV3ForCausalLM"), object(), {}, {})
    assert isinstance(why, str) and why.endswith("Qwen3MoeForCausalLM") and len(why) > 96
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "realization_unavailable" in logged and "redacted" not in logged
    assert "no layer runner for architecture 'DeepseekV3ForCausalLM'" in logged
