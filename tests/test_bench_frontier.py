"""``semkv bench --preset frontier`` end to end on the real vLLM CPU engine, very small.

On the tiny random-weight Gemma 3 of tests/tiny_engine_model.py (``--model`` a folder: the
bundled tokenizer, Gemma 3's layer pattern, vLLM's hybrid KV-cache manager with six groups as
for Gemma 3 270M; the mechanism, not the model's quality: the frontier's figures on the bundled
models are measured with the same command in docs/frontier.md). One subprocess (the bench
switches vLLM to in-process engines through environment variables), one cluster of a shifted
multi-donor kind and a same-topic negative at ~512 tokens, the cold, fp8-floor and two strategy
arms. Checks what could be wrong: cold scores itself perfectly, the fp8 floor is close to cold
but not equal, realized requests are served from donors and teacher forced on every answer
position, negatives are not served, no realized block stays in the prefix cache, rows carry no
text. Pure-Python checks of the summaries and targets follow.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from semkv.bench import preset
from semkv.bench.frontier_report import check, negatives, summarize
from tests.tiny_engine_model import tiny_model_dir

ARMS = ["cold", "fp8_floor", "realized:none", "realized:first_k16+blend15"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def frontier(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("frontier")
    cmd = [sys.executable, "-m", "semkv.cli", "bench", "--preset", "frontier", "--model",
           str(tiny_model_dir("gemma3")), "--dtype", "float32", "--arms", *ARMS,
           "--kinds", "multi_passage_rag", "negative_same_topic", "--clusters", "1",
           "--target-tokens", "512", "--max-tokens", str(MAX_TOKENS), "--no-progress",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    header = f"Preset `frontier` on {tiny_model_dir('gemma3')} (float32)"
    assert (out / "bench.md").read_text().startswith(header)
    assert (out / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads((out / "bench.json").read_text())


@pytest.mark.engine
def test_frontier_arms_on_the_engine(frontier: dict) -> None:
    rows = {r["arm"]: r for r in frontier["rows"] if not r["negative"]}
    assert set(rows) == set(ARMS)
    cold, floor = rows["cold"], rows["fp8_floor"]
    assert cold["kl_mean"] == 0.0 and cold["rouge_l"] == 1.0
    assert cold["scored_positions"] == MAX_TOKENS
    # the target's own KV through fp8: served (loaded), measurably perturbed, still near cold
    assert floor["served"] and floor["donor_fraction"] > 0.8
    assert 0.0 < floor["kl_mean"] < 0.1
    for arm in ("realized:none", "realized:first_k16+blend15"):
        r = rows[arm]
        assert r["served"] and r["provenance"] == "request_only_semantic_reuse", r
        assert r["donor_fraction"] >= 0.5 and r["scored_positions"] == MAX_TOKENS
        assert r["kl_mean"] is not None and r["kl_mean"] > 0.0
    assert rows["realized:none"]["recomputed"] == 0
    assert rows["realized:first_k16+blend15"]["recomputed"] > 0
    neg = [r for r in frontier["rows"] if r["negative"]]
    assert neg and not any(r["served"] for r in neg)
    assert frontier["request_only_violations"] == 0
    assert set(frontier["targets"]) == {"realized:none", "realized:first_k16+blend15"}
    for row in frontier["rows"]:
        for value in row.values():
            assert not isinstance(value, list | dict), row
            assert not (isinstance(value, str) and len(value) > 64), row


def _row(arm: str, kind: str = "multi_passage_rag", **kw: object) -> dict:
    base = {"target": f"{kind}/0", "kind": kind, "negative": False, "arm": arm,
            "prompt_tokens": 2048, "served": True, "donor_fraction": 0.8, "recomputed": 0,
            "computed_in_span": 100, "speedup": 3.0, "rouge_l": 0.95, "exact_match": False,
            "first_divergence": 20, "cold_margin_at_divergence": 0.1, "kl_mean": 0.002,
            "logprob_delta": -0.01, "response_cache_rouge_l": 0.3}
    return {**base, **kw}


def test_targets_compare_each_strategy_with_the_fp8_floor() -> None:
    rows = [_row("cold", kl_mean=0.0, rouge_l=1.0, first_divergence=None, exact_match=True),
            _row("fp8_floor", kl_mean=0.003),
            _row("realized:none", kl_mean=0.01, cold_margin_at_divergence=0.9),
            _row("realized:first_k16", kl_mean=0.002),
            _row("negative", kind="negative_same_topic", negative=True, served=False)]
    rows[-1]["arm"] = "realized:none"
    summary = summarize(rows)
    assert summary["multi_passage_rag"]["realized:none"]["divergences_near_tie"] == 0
    result = check(summary, rows, request_only_violations=0)
    assert result["realized:first_k16"] == {"met": True, "reasons_off": []}
    reasons = " ".join(result["realized:none"]["reasons_off"])
    assert "fp8 floor" in reasons and "cold margin" in reasons
    assert negatives(rows) == {"targets": 1, "false_positives": 0, "false_positive_rate": 0.0}
    # a false positive, a slow long prompt or a leaked block fails every arm
    rows[-1]["served"] = True
    slow = [*rows[:3], _row("realized:first_k16", kl_mean=0.002, speedup=2.0), rows[-1]]
    failed = check(summarize(slow), slow, request_only_violations=1)["realized:first_k16"]
    text = " ".join(failed["reasons_off"])
    assert not failed["met"] and "false positive" in text and "2.00x" in text
    assert "prefix cache" in text


def test_rows_are_summarized_per_plan_class_against_their_own_targets_floor() -> None:
    from semkv.bench.frontier_report import markdown, summarize_by_class

    rows = []
    for kind, cls, floor, kl in (("multi_passage_rag", "multi_donor", 0.004, 0.04),
                                 ("cross_instruction", "one_donor_in_order", 0.002, 0.001)):
        t = {"target": f"{kind}/0", "kind": kind}
        rows += [_row("cold", **t, kl_mean=0.0, first_divergence=None),
                 _row("fp8_floor", **t, kl_mean=floor),
                 _row("realized:first_k16", **t, kl_mean=kl, plan_class=cls)]
    # a request of a strategy arm that was not served has no class and joins none
    rows.append(_row("realized:none", target="multi_passage_rag/0", served=False,
                     plan_class=None))
    by_class = summarize_by_class(rows)
    assert list(by_class) == ["multi_donor", "one_donor_in_order"]
    rag = by_class["multi_donor"]
    assert set(rag) == {"cold", "fp8_floor", "realized:first_k16"}
    assert rag["fp8_floor"]["kl_mean"] == 0.004 and rag["realized:first_k16"]["kl_mean"] == 0.04
    assert by_class["one_donor_in_order"]["fp8_floor"]["kl_mean"] == 0.002
    summary = summarize(rows)
    result = {"config": preset("frontier").as_dict(), "machine": "test", "wall_s": 60.0,
              "summary": summary, "negatives": negatives(rows), "request_only_violations": 0,
              "targets": check(summary, rows, 0), "rows": rows}
    text = markdown(result)
    assert text.startswith("Preset `frontier` on smollm2-135m (float32):")
    assert "Per plan class" in text and "| plan class | arm |" in text
    assert "| one_donor_in_order | realized:first_k16 | 1/1 |" in text


def test_frontier_presets_validate() -> None:
    assert preset("frontier").runner == "frontier"
    assert preset("frontier-long").target_tokens >= 4096
    with pytest.raises(ValueError, match="unknown frontier arm"):
        preset("frontier", arms=("cold", "disabled"))
    with pytest.raises(ValueError, match="needs the 'cold' arm"):
        preset("frontier", arms=("fp8_floor", "realized:none"))
    assert preset("frontier", model="gemma3-270m").model == "gemma3-270m"
    with pytest.raises(ValueError, match="neither a bundled model .* nor a model folder"):
        preset("frontier", model="/no/such/model")


def test_a_row_scores_a_request_against_cold_without_an_engine() -> None:
    from semkv.bench.frontier import SPAN, planned_requests, row, teacher_scores
    from semkv.bench.results import Run, Snapshot
    from semkv.bench.workload import Workload

    wl = Workload(ids={"t": [], "d": []}, kind={"t": "multi_passage_rag"},
                  negative={"t": False}, donor_of={"t": "d"}, true_donor={"t": True},
                  targets=["t"], donors=["d"])
    cold = Run(ttft_s=2.0, e2e_s=2.5, output=[1, 2, 3, 4], summary={}, delta=Snapshot(),
               prompt_tokens=100)
    run = Run(ttft_s=0.5, e2e_s=1.0, output=[1, 2, 9, 9],
              summary={"provenance": "request_only_semantic_reuse",
                       "span": {"donors": 2, "segments": 3, "class": "multi_donor"}},
              delta=Snapshot({f"{SPAN}:copied": 60.0, f"{SPAN}:computed": 20.0,
                              f"{SPAN}:recomputed": 5.0}), prompt_tokens=100)
    cold_dists: list[dict[int, float] | None] = [
        {1: -0.1, 5: -2.5}, {2: -0.1, 5: -2.5}, {3: -0.5, 9: -0.6}, {4: -0.1, 5: -2.5}]
    dists: list[dict[int, float] | None] = [{1: -0.1, 5: -2.5}, {2: -0.3, 5: -1.5}, None,
                                            {4: -0.1, 5: -2.5}]
    teacher = teacher_scores(dists, cold_dists, [1, 2, 3, 4])
    assert teacher["scored_positions"] == 3 and teacher["kl_mean"] > 0
    assert teacher["logprob_delta"] == pytest.approx(-0.2 / 3)
    r = row("t", wl, "realized:none", run, cold, cold_dists, teacher, 0.3)
    assert r["served"] and r["donor_tokens"] == 60 and r["donor_fraction"] == 0.6
    assert r["computed_in_span"] == 20 and r["recomputed"] == 5 and r["span_donors"] == 2
    assert r["plan_class"] == "multi_donor"
    assert row("t", wl, "cold", cold, cold, cold_dists, teacher, 0.3)["plan_class"] is None
    assert r["speedup"] == 4.0 and not r["exact_match"] and r["first_divergence"] == 2
    assert r["cold_margin_at_divergence"] == pytest.approx(0.1)
    # one donor and the cold request, then per strategy a request and its teacher forcing,
    # and the same for the fp8 floor
    assert planned_requests(preset("frontier"), wl, ("cold", "fp8_floor", "realized:none")) == 6


def test_the_plot_draws_every_strategy_arm(tmp_path) -> None:
    """Every arm of ``STRATEGIES`` has a marker (a run with new arms once measured 30 minutes
    and lost them to a KeyError in the plot; the raw JSON is now written before plotting)."""
    pytest.importorskip("matplotlib")
    from semkv.bench.config import FLOOR, STRATEGIES
    from semkv.bench.frontier_report import plot

    arms = {a: {"computed_fraction_mean": 0.05 * i, "kl_mean": 0.01 + 0.001 * i,
                "rouge_l_median": 0.5, "served": 2} for i, a in enumerate(STRATEGIES)}
    arms[FLOOR] = {"kl_mean": 0.002, "rouge_l_median": 0.9, "served": 2}
    (path,) = plot({"summary": {"multi_passage_rag": arms}}, tmp_path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
