"""examples/: the operator config loads through semkv's own loader; the research script runs.

(The example provider has its own module: tests/test_example_provider.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from semkv.config import SemkvConfig
from semkv.types import Mode

ROOT = Path(__file__).resolve().parents[1]
OPERATOR = ROOT / "examples" / "operator"


@pytest.fixture
def clean_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("SEMKV_")]:
        monkeypatch.delenv(name)


def test_discovery_only_yaml_loads(clean_env):
    config = SemkvConfig.load({"config_file": str(OPERATOR / "discovery-only.yaml")})
    assert config.semantic_mode is Mode.DISCOVERY_ONLY
    assert config.provider == "chunks"
    assert int(config.donor_store_bytes) == 16 * 2**20


def test_kv_transfer_config_selects_the_connector_and_the_yaml(clean_env, monkeypatch):
    transfer = json.loads((OPERATOR / "kv-transfer-config.json").read_text())
    assert transfer["kv_connector"] == "SemanticKVConnector"
    assert transfer["kv_connector_module_path"] == "semkv_vllm.connector"
    assert transfer["kv_load_failure_policy"] == "recompute"
    monkeypatch.chdir(ROOT)  # the config_file path is relative to the server's directory
    config = SemkvConfig.load(transfer["kv_connector_extra_config"])
    assert config.semantic_mode is Mode.DISCOVERY_ONLY


def test_cli_checks_the_operator_file(clean_env):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEMKV_")}
    out = subprocess.run([sys.executable, "-m", "semkv.cli", "config", "--file",
                          str(OPERATOR / "discovery-only.yaml")],
                         capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["semantic_mode"] == "discovery_only"


def test_research_study_script_runs(tmp_path):
    """The smallest study the script can run: one exact-control cluster, chunks discovery."""
    pytest.importorskip("torch", reason="needs semkv[research] (make test installs it)")
    cmd = [sys.executable, str(ROOT / "examples" / "research_study.py"),
           "--clusters-per-type", "1", "--target-tokens", "128", "--new-tokens", "4",
           "--kinds", "exact_control", "--providers", "chunks", "--strategies", "none",
           "--no-controls", "--threads", "1", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "research-study.json").read_text())["summary"]
    found = summary["exact_control"]["discovered:chunks"]["none"]
    assert found["discovered_correct"] == 1.0
    # An identical donor serves all but the last prompt token, and quality is the full prefill's.
    assert found["reused_fraction"] > 0.9 and found["exact_match"] == 1.0
    assert (tmp_path / "frontier-exact_control.png").stat().st_size > 0
    assert "exact_control" in out.stdout  # the printed table
