import json
import os
import subprocess
import sys

SEMKV = [sys.executable, "-m", "semkv.cli"]


def _env():
    return {k: v for k, v in os.environ.items() if not k.startswith("SEMKV_")}


def test_config_prints_effective_config():
    extra = '{"semantic_mode": "materialize_exact"}'
    out = subprocess.run(SEMKV + ["config", "--extra-config", extra],
                         capture_output=True, text=True, env=_env())
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["semantic_mode"] == "materialize_exact"


def test_config_rejects_bad_key_and_bad_provider_config():
    out = subprocess.run(SEMKV + ["config", "--extra-config", '{"min_reuse": 3}'],
                         capture_output=True, text=True, env=_env())
    assert out.returncode == 2 and "'min_reuse'" in out.stderr and "min_reuse_tokens" in out.stderr
    out = subprocess.run(
        SEMKV + ["config", "--extra-config", '{"provider_config": {"chunk_tokns": 3}}'],
        capture_output=True, text=True, env=_env())
    assert out.returncode == 2 and "chunk_tokns" in out.stderr
    out = subprocess.run(SEMKV + ["config", "--extra-config", '{"provider": "missing"}'],
                         capture_output=True, text=True, env=_env())
    assert out.returncode == 2 and "installed providers: " in out.stderr


def test_model_path_points_to_a_converted_model():
    out = subprocess.run(SEMKV + ["model-path"], capture_output=True, text=True, env=_env())
    assert out.returncode == 0, out.stderr
    folder = out.stdout.strip().splitlines()[-1]
    assert os.path.isfile(os.path.join(folder, "config.json"))
    assert os.path.isfile(os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json")) as fh:
        assert json.load(fh)["num_hidden_layers"] == 30


def test_bench_says_when_the_corpora_cannot_supply_the_workload():
    """Before any engine starts: a clear message and exit 2, no traceback."""
    out = subprocess.run(SEMKV + ["bench", "--preset", "frontier-long", "--clusters", "400",
                                  "--kinds", "cross_instruction", "--no-progress",
                                  "--out", "/tmp/semkv-bench-too-large"],
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "semkv bench: not enough" in out.stderr and "Traceback" not in out.stderr
