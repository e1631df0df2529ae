"""``benchmarks/window_deviation.py`` (issue #50's window measurement) on a tiny random-weight
Gemma 3 whose every layer has a 64-token window (tests/tiny_engine_model.py; no engine): one
donor's tokens copied behind 40 other tokens, nothing recomputed.

What the measurement must show, and does: layer 0's copied K equals cold (the re-rotation is
exact); in layer l a copied token more than l windows from its seam attends only to copied
tokens whose own inputs were exact, so its deviation is zero to fp32 rounding, while the tokens
just after the seam are far off (so the check can fail); the per-layer fp8 floor is a few
percent; the binning and the seam distances are what the plan says.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.tiny_engine_model import WINDOW, tiny_model_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def bench() -> Any:
    spec = importlib.util.spec_from_file_location(
        "window_deviation", ROOT / "benchmarks" / "window_deviation.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_copied_tokens_further_than_the_windows_from_their_seam_are_exact() -> None:
    from semkv.research import DonorStore, LayerwiseModel, plan_reuse

    wd = bench()
    lm = LayerwiseModel.from_pretrained(tiny_model_dir("gemma3-windowed"))
    assert set(lm.windows) == {WINDOW}
    rng = random.Random(3)
    donor = [rng.randrange(100, 40_000) for _ in range(420)]
    # the last prompt token is always computed: one more after the 400 copied
    target = [rng.randrange(100, 40_000) for _ in range(40)] + donor[:400] + [7]
    store = DonorStore(lm, chunk_tokens=32)
    store.add("d", donor)
    plan = plan_reuse(target, store.token_map(), chunk_tokens=32)
    assert [(s.target_start, s.length) for s in plan.segments] == [(40, 400)]
    assert wd.seam_distances(plan)[40] == 0 and wd.seam_distances(plan)[439] == 399
    assert [wd.bin_of(d) for d in (0, 31, 32, 64, 127, 128, 5000)] == [0, 0, 1, 2, 2, 3, 8]

    row = wd.measure_target(lm, target, plan, store)
    layers = row["layers"]
    assert row["copied"] == 400 and row["donors"] == 1 and row["segments"] == 1
    exact = 1e-4  # fp32 rounding, relative
    assert all(v is None or v < exact for v in layers[0]["k"])
    for layer in (1, 2):
        clean = wd.bin_of(layer * WINDOW)  # every bin from l windows on
        assert all(v < exact for v in layers[layer]["k"][clean:] if v is not None), layers[layer]
        assert all(v < exact for v in layers[layer]["v"][clean:] if v is not None)
        assert layers[layer]["k"][0] > 100 * exact  # just after the seam: far off
    assert 1e-3 < layers[1]["k_floor"] < 0.1
    assert sum(layers[0]["count"]) == 400
