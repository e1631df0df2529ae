"""``semkv bench`` reads the cost gate against what happened (``semkv.bench.gain``): each served
plan's predicted TTFT gain beside the measured one, median and p90 of the relative error, per
strategy and plan class in the frontier report. The gate itself: tests/test_cost_gate.py."""

from __future__ import annotations

from typing import Any

import pytest


def test_the_bench_reads_predicted_against_measured_gain() -> None:
    from semkv.bench.gain import gain_errors

    g = gain_errors([(2.0, 2.0), (1.5, 1.0), (None, 3.0), (3.0, None), (1.2, 0.8)])
    assert g["priced"] == 3 and g["slower"] == 1  # 0.8x: served slower than cold
    assert g["error_median"] == pytest.approx(0.5) and g["abs_error_p90"] == pytest.approx(0.5)
    assert g["predicted_median"] == 1.5 and g["measured_median"] == 1.0
    assert gain_errors([])["priced"] == 0 and gain_errors([])["abs_error_p90"] is None


def test_the_frontier_report_tabulates_the_cost_gate_per_strategy_and_class() -> None:
    pytest.importorskip("torch")  # semkv.bench.frontier scores with semkv.research.quality
    from semkv.bench.frontier_report import _gate_table, cost_gate

    def row(arm: str, cls: str | None, predicted: float | None, measured: float,
            served: bool = True) -> dict[str, Any]:
        return {"arm": arm, "plan_class": cls, "predicted_gain": predicted, "speedup": measured,
                "served": served}

    rows = [row("cold", None, None, 1.0), row("realized:first_k16", "one_donor_in_order", 5.0, 4.0),
            row("realized:first_k16", "one_donor_in_order", 4.0, 4.0),
            row("realized:first_k16", "multi_donor", 2.0, 2.5),
            row("realized:first_k16", "gap_dominated", 1.1, 0.9, served=False)]
    gate = cost_gate(rows)
    assert list(gate) == ["realized:first_k16"]
    assert gate["realized:first_k16"]["all"]["priced"] == 3
    assert gate["realized:first_k16"]["one_donor_in_order"]["error_median"] == pytest.approx(0.125)
    assert "gap_dominated" not in gate["realized:first_k16"]  # refused: nothing served
    table = _gate_table(gate)
    assert table[2].startswith("| realized:first_k16 | all | 3 | 4.00x | 4.00x |")
