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


def test_kv_cache_bytes_takes_a_bundled_model_by_name():
    by_name = subprocess.run(SEMKV + ["kv-cache-bytes", "--model", "smollm2-135m"],
                             capture_output=True, text=True, env=_env())
    default = subprocess.run(SEMKV + ["kv-cache-bytes"], capture_output=True, text=True,
                             env=_env())
    assert by_name.returncode == default.returncode == 0, by_name.stderr + default.stderr
    # 30 layers x 3 KV heads x 64 x 2 x 4 bytes x 4 requests x 4,096 tokens
    assert int(by_name.stdout) == int(default.stdout) == 30 * 3 * 64 * 2 * 4 * 4 * 4096


def test_bench_says_when_the_corpora_cannot_supply_the_workload():
    """Before any engine starts: a clear message and exit 2, no traceback."""
    out = subprocess.run(SEMKV + ["bench", "--preset", "frontier-long", "--clusters", "400",
                                  "--kinds", "cross_instruction", "--no-progress",
                                  "--out", "/tmp/semkv-bench-too-large"],
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "semkv bench: not enough" in out.stderr and "Traceback" not in out.stderr


# The core without the vLLM adapter: SEMKV_LOAD_PLUGINS names only the chunks provider, so the
# adapter's entry point (semkv_vllm.cli_plugin) is never loaded, as if semkv-vllm were absent.
WITHOUT_ADAPTER = "semkv-chunks"
HEAVY = ["torch", "vllm", "semkv_vllm", "transformers"]
_PROBE = ("import json, sys; from semkv.cli import main; rc = main(json.loads(sys.argv[1])); "
          f"print('imported: ' + json.dumps([m for m in {HEAVY!r} if m in sys.modules]), "
          "file=sys.stderr); sys.exit(rc)")


def _without_adapter(*args: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    env = dict(_env(), SEMKV_LOAD_PLUGINS=WITHOUT_ADAPTER)
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(list(args))],
                         capture_output=True, text=True, env=env, timeout=120)
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("imported: "), out.stderr[-2000:]
    return out, json.loads(last.removeprefix("imported: "))


def test_core_commands_run_without_the_adapter_and_import_no_engine():
    out, heavy = _without_adapter("plugins")
    assert out.returncode == 0, out.stderr
    assert [r["provider"] for r in json.loads(out.stdout)] == ["chunks"]
    assert heavy == []
    out, heavy = _without_adapter("plugins", "--commands")
    assert out.returncode == 0 and json.loads(out.stdout) == [] and heavy == []
    out, heavy = _without_adapter("config", "--extra-config",
                                  '{"semantic_mode": "materialize_exact"}')
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["semantic_mode"] == "materialize_exact" and heavy == []
    out, heavy = _without_adapter("kv-cache-bytes", "--max-model-len", "4096")
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 0 and heavy == []


def test_bench_without_the_adapter_names_the_distribution_to_install():
    for args in (["bench", "--preset", "quick"], ["bench", "--help"], ["calibrate"]):
        out, heavy = _without_adapter(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert "pip install semkv-vllm" in out.stderr and "Traceback" not in out.stderr
        # installed here, so the message also says why it is not loaded
        assert "SEMKV_LOAD_PLUGINS='semkv-chunks' leaves its plugin out" in out.stderr
        assert out.stdout == "" and heavy == []
    help_text = subprocess.run(SEMKV + ["--help"], capture_output=True, text=True,
                               env=dict(_env(), SEMKV_LOAD_PLUGINS=WITHOUT_ADAPTER)).stdout
    assert "(needs semkv-vllm: pip install semkv-vllm)" in help_text


def test_the_adapter_adds_bench_through_its_plugin():
    out = subprocess.run(SEMKV + ["bench", "--help"], capture_output=True, text=True, env=_env())
    assert out.returncode == 0, out.stderr
    assert "--preset" in out.stdout and "--arms" in out.stdout
    out = subprocess.run(SEMKV + ["plugins", "--commands"], capture_output=True, text=True,
                         env=_env())
    rows = {r["command"]: r for r in json.loads(out.stdout)}
    assert rows["bench"]["distribution"] == "semkv-vllm" and rows["bench"]["plugin"] == "vllm"
    out = subprocess.run(SEMKV + ["config", "--no-such-flag"], capture_output=True, text=True,
                         env=_env())
    assert out.returncode == 2 and "unrecognized arguments: --no-such-flag" in out.stderr
