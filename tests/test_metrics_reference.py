"""The operator guide's metrics reference names every series semkv exports, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

from semkv.metrics import FAMILIES, GAUGES, HISTOGRAMS

DOC = Path(__file__).resolve().parents[1] / "docs" / "operator.md"


def exported() -> set[str]:
    return ({f"vllm:semkv_{f}_total" for f in FAMILIES} | {f"vllm:semkv_{g}" for g in GAUGES}
            | {f"vllm:semkv_{h}" for h in HISTOGRAMS})


def test_every_series_is_documented_and_every_documented_series_exists():
    documented = set(re.findall(r"`(vllm:semkv_[a-z_]+)`", DOC.read_text()))
    assert exported() - documented == set(), "undocumented series"
    assert documented - exported() == set(), "documented series that semkv does not export"


def test_series_names_never_collide_in_prometheus():
    # A counter ``x_total`` and a histogram ``x`` would both register ``x_created``.
    bases = [n.removesuffix("_total") for n in exported()]
    assert len(bases) == len(set(bases))
