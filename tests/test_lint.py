"""The code base passes ruff (the linter `make lint` runs), so style never drifts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.fail("ruff is not installed: it is part of scripts/requirements-dev.txt")
    out = subprocess.run([ruff, "check", "--output-format", "concise", str(ROOT)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:]
