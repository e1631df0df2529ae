"""``semkv bench`` aggregation, targets and report on hand-built runs (no engine).

The engine run itself is tested in tests/test_bench.py; here the rows are built from
hand-written ``Run`` records, so every rule (hits only from loaded tokens, false positives only
for non-exact tiers, target verdicts) is checked on values chosen to make it fail if broken.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from semkv.bench.config import ARMS, preset
from semkv.bench.report import markdown, plots
from semkv.bench.results import ArmResult, Run, Snapshot
from semkv.bench.summary import build_rows, percentile, summarize_arm
from semkv.bench.targets import check_targets
from semkv.bench.workload import Workload
from semkv.cli import main

LOADED = "vllm:semkv_loaded_tokens"


def _run(ttft: float, output: list[int], *, loaded: int = 0, tier: str | None = None,
         reason: str | None = None, external: int | None = None) -> Run:
    summary = {"provenance": "x", "tier": tier, "fallback_reason": reason,
               "external_tokens": loaded if external is None else external}
    return Run(ttft_s=ttft, e2e_s=ttft + 0.5, output=output, summary=summary,
               delta=Snapshot({LOADED: float(loaded), "vllm:semkv_lookup_seconds:sum": 0.002,
                               "vllm:semkv_lookup_seconds:count": 1.0}), prompt_tokens=600)


@pytest.fixture
def run() -> tuple[dict, Workload]:
    wl = Workload(
        ids={}, kind={"pos": "exact_control", "sem": "cross_instruction",
                      "neg": "negative_unrelated", "neg2": "negative_same_topic"},
        negative={"pos": False, "sem": False, "neg": True, "neg2": True},
        donor_of={"pos": "d1", "sem": "d2", "neg": None, "neg2": "d3"},
        true_donor={"pos": True, "sem": True, "neg": False, "neg2": False},
        targets=["pos", "sem", "neg", "neg2"], donors=["d1", "d2", "d3"])
    cold_out = {"pos": [1, 2, 3, 4], "sem": [5, 6, 7, 8], "neg": [9, 9, 9, 9],
                "neg2": [4, 3, 2, 1]}
    base = ArmResult(arm=ARMS["disabled"])
    for t, out in cold_out.items():
        base.miss[t] = _run(2.0, out, reason="provider_disabled")
        base.reuse[t] = _run(2.0, out, reason="provider_disabled")
        base.vllm_hit[t] = _run(0.1, out)
        base.logprob[t], base.logprob_summary[t] = {i: -1.0 for i in range(4)}, {}
    base.donors = {"d1": _run(1, [1, 2, 3, 4]), "d2": _run(1, [5, 6, 0, 0]),
                   "d3": _run(1, [0, 0, 0, 0])}
    sem = ArmResult(arm=ARMS["materialize_semantic:minhash"])
    sem.reuse = {"pos": _run(0.2, [1, 2, 3, 4], loaded=576, tier="exact"),
                 "sem": _run(0.4, [5, 6, 7, 0], loaded=512, tier="semantic"),
                 # claimed but never loaded: not a hit
                 "neg": _run(2.0, [9, 9, 9, 9], external=64, tier="semantic"),
                 # exact hit on a shared prefix: not a false positive
                 "neg2": _run(1.5, [4, 3, 2, 1], loaded=32, tier="exact")}
    for t in cold_out:
        sem.miss[t] = _run(2.04, cold_out[t], reason="provider_miss")
        # "sem": positions 0-1 served from reused KV in the log-likelihood run (not scored)
        sem.logprob[t] = ({i: -1.0 for i in range(4)} if t != "sem"
                          else {2: -1.2, 3: -1.4})
        sem.logprob_summary[t] = {"external_tokens": sem.reuse[t].summary["external_tokens"]}
    results = {"disabled": base, "materialize_semantic:minhash": sem}
    return results, wl


def test_hits_come_from_loaded_tokens_and_fp_only_from_non_exact_tiers(run) -> None:
    results, wl = run
    rows = build_rows(results, wl)
    by = {(r["arm"], r["prompt_id"]): r for r in rows}
    assert not by[("materialize_semantic:minhash", "neg")]["hit"]  # claimed, not loaded
    assert by[("materialize_semantic:minhash", "neg2")]["hit"]
    assert not by[("materialize_semantic:minhash", "neg2")]["false_positive"]
    s = summarize_arm("materialize_semantic:minhash", results["materialize_semantic:minhash"],
                      rows)
    assert s["hits"] == 3 and s["loaded_tokens"] == 576 + 512 + 32
    assert s["external_tokens"] == s["loaded_tokens"] + 64
    assert s["false_positive_rate"] == 0.0
    assert s["speedup_hit_only"] == pytest.approx(2.0 / 0.4)  # median of 10, 5, 1.33
    assert s["miss"]["over_cold_median"] == pytest.approx(1.02)
    q = s["quality_by_kind"]["cross_instruction"]
    assert q["rouge_l_median"] == pytest.approx(0.75) and q["exact_match_rate"] == 0.0
    assert q["first_divergence_median"] == 3
    assert q["logprob_delta_median"] == pytest.approx(-0.3)  # on positions 2-3 only
    assert by[("materialize_semantic:minhash", "sem")]["logprob_scored_tokens"] == 2
    assert q["response_cache_rouge_l_median"] == pytest.approx(0.5)


def test_targets_and_report(run, tmp_path: Path) -> None:
    results, wl = run
    rows = build_rows(results, wl)
    arms = {n: summarize_arm(n, r, rows) for n, r in results.items()}
    t = check_targets(rows, arms)
    assert t["exact_tier"]["met"] and t["exact_tier"]["exact_hits"] == 2
    assert not t["miss_cost"]["materialize_semantic:minhash"]["met_ratio"]  # 1.02 is not < 1.02
    sem = t["semantic_tier"]["materialize_semantic:minhash"]
    assert not sem["default_on"] and "0.75 < 0.9" in sem["reasons_off"][0]
    result = {"config": preset("quick").as_dict(), "machine": "test", "arms": arms,
              "targets": t, "rows": rows, "workload": {"targets": 4, "donors": 3}}
    text = markdown(result)
    assert "| materialize_semantic:minhash | cross_instruction | 1 | 1 | 0% | 0.75 |" in text
    assert "ships OFF" in text
    for path in plots(result, tmp_path):
        assert path.read_bytes()[:4] == b"\x89PNG"


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)


def test_bad_arm_or_preset_fails_with_a_clear_error(capsys) -> None:
    assert main(["bench", "--arms", "disabled", "nope"]) == 2
    assert "unknown bench arm(s) ['nope']" in capsys.readouterr().err
    assert main(["bench", "--arms", "materialize_exact:chunks"]) == 2
    assert "needs the 'disabled' arm" in capsys.readouterr().err
    assert main(["bench", "--preset", "huge"]) == 2
    assert "unknown bench preset 'huge'" in capsys.readouterr().err


def test_realized_span_columns_split_tokens_and_compare_to_exact_and_response_cache() -> None:
    wl = Workload(
        ids={}, kind={"rag": "multi_passage_rag", "neg": "negative_unrelated"},
        negative={"rag": False, "neg": True}, donor_of={"rag": "d1", "neg": None},
        true_donor={"rag": True, "neg": False}, targets=["rag", "neg"],
        donors=["d1", "d2", "d3"], donor_ids={"rag": ["d1", "d2", "d3"]})
    cold_out = {"rag": [1, 2, 3, 4], "neg": [9, 9, 9, 9]}
    base = ArmResult(arm=ARMS["disabled"])
    for t, out in cold_out.items():
        base.miss[t] = base.reuse[t] = _run(2.0, out, reason="provider_disabled")
        base.vllm_hit[t] = _run(0.1, out)
        base.logprob[t], base.logprob_summary[t] = {i: -1.0 for i in range(4)}, {}
    # the best labelled donor's answer stands for the response cache (d2, not d1)
    base.donors = {"d1": _run(1, [0, 0, 0, 0]), "d2": _run(1, [1, 2, 0, 0]),
                   "d3": _run(1, [0, 0, 0, 4])}
    exact = ArmResult(arm=ARMS["materialize_exact:chunks"])
    realized = ArmResult(arm=ARMS["materialize_realized:minhash"])
    rag = _run(0.5, [1, 2, 3, 4], loaded=480, tier="verified")
    rag.summary["span"] = {"local": 0, "span": 480, "copied": 416, "shifted": 300,
                           "computed": 64, "donors": 3, "segments": 7, "class": "multi_donor",
                           "predicted_gain": 3.0}
    rag.delta = rag.delta - Snapshot({"vllm:semkv_span_tokens:copied": -416.0,
                                      "vllm:semkv_span_tokens:shifted": -300.0,
                                      "vllm:semkv_span_tokens:computed": -64.0,
                                      "vllm:semkv_realize_seconds:sum": -0.25})
    realized.reuse = {"rag": rag, "neg": _run(2.0, [9, 9, 9, 9], reason="provider_miss")}
    exact.reuse = {"rag": _run(1.0, [1, 2, 3, 4]), "neg": _run(2.0, [9, 9, 9, 9])}
    for res in (exact, realized):
        for t, out in cold_out.items():
            res.miss[t] = _run(2.0, out, reason="provider_miss")
            res.logprob[t], res.logprob_summary[t] = {i: -1.0 for i in range(4)}, {}
    results = {"disabled": base, "materialize_exact:chunks": exact,
               "materialize_realized:minhash": realized}
    rows = build_rows(results, wl)
    row = next(r for r in rows if r["arm"] == "materialize_realized:minhash"
               and r["prompt_id"] == "rag")
    assert (row["donor_tokens"], row["span_shifted_tokens"], row["span_computed_tokens"],
            row["vllm_computed_tokens"]) == (416, 300, 64, 600 - 480)
    assert row["span_donors"] == 3 and row["realize_s"] == pytest.approx(0.25)
    assert row["plan_class"] == "multi_donor"
    assert row["speedup_vs_exact_arm"] == pytest.approx(2.0)
    assert row["response_cache_rouge_l"] == pytest.approx(0.5)
    assert row["response_cache_exact_match"] is False
    arms = {n: summarize_arm(n, r, rows) for n, r in results.items()}
    k = arms["materialize_realized:minhash"]["span_by_kind"]["multi_passage_rag"]
    assert (k["realized"], k["donor_tokens"], k["speedup_vs_own_miss_median"]) == (1, 416, 4.0)
    assert k["plan_classes"] == {"multi_donor": 1}
    # the cost gate's 3.0x against the 4.0x measured over its own miss: 25 % conservative
    assert k["cost_gate"]["priced"] == 1 and k["cost_gate"]["error_median"] == pytest.approx(-0.25)
    assert k["realize_ms_median"] == pytest.approx(250.0)
    assert k["exact_match_rate"] == 1.0 and k["response_cache_rouge_l_median"] == 0.5
    neg = arms["materialize_realized:minhash"]["span_by_kind"]["negative_unrelated"]
    assert neg["false_positive_rate"] == 0.0 and neg["response_cache_rouge_l_median"] is None
    # exact hits: every loaded token is a donor token, nothing computed inside the span
    ex = arms["materialize_exact:chunks"]["span_by_kind"]["multi_passage_rag"]
    assert ex["donor_tokens"] == ex["span_computed_tokens"] == 0
    assert ex["vllm_computed_tokens"] == 600
    result = {"config": preset("realized").as_dict(), "machine": "test", "arms": arms,
              "targets": check_targets(rows, arms), "rows": rows,
              "workload": {"targets": 2, "donors": 3}}
    assert ("| materialize_realized:minhash | multi_passage_rag | 1 | 1 | 1 | multi_donor 1 | "
            "416 (69%) | "
            "300 (50%) | 64 (11%) | 120 (20%) | 4.00x | 2.00x | 3.00x | -25% (25%) | 250 | "
            "100% | 1.00 | 0% | "
            "0.50 | – |") in markdown(result)
    for r in rows:  # the row stays flat: the span plan's dict is not copied into it
        assert not any(isinstance(v, list | dict) for v in r.values())


def test_realized_arms_keep_the_token_swap_arms_apart() -> None:
    for name in ("materialize_realized:minhash", "materialize_realized:chunks"):
        arm = ARMS[name]
        assert arm.extra["realize_spans"] and arm.extra["semantic_tiers"] == ["verified"]
        assert arm.commit_policy and arm.mode == "materialize_semantic"
    assert "provider_config" not in ARMS["materialize_realized:minhash"].extra  # its defaults
    assert ARMS["materialize_semantic:minhash"].extra["realize_spans"] is False
    assert "materialize_realized:minhash" in preset("realized").arms
