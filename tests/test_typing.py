"""Every distribution's package passes ``mypy --strict`` (configured in the root pyproject.toml).

The list below is the public surface: all of ``semkv`` (core, conformance kit, workloads,
research), every provider, the vLLM adapter and the example provider. vLLM, torch and the
provider libraries are not analysed (``follow_imports = "skip"``): they would make a cold run
take minutes, so their names are ``Any`` here. About 20 s of CPU on a cold cache.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [
    "semkv",            # .
    "semkv_chunks",     # providers/chunks
    "semkv_minhash",    # providers/minhash
    "semkv_embedding",  # providers/embedding
    "semkv_semblend",   # providers/semblend
    "semkv_vllm",       # adapters/vllm
    "semkv_trigram",    # examples/provider-trigram
]


def test_mypy_strict(tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="needs the dev requirements (make env installs them)")
    args = [arg for package in PACKAGES for arg in ("-p", package)]
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
    assert "Success: no issues found" in out.stdout
