import json
import subprocess
import sys

HEAVY = ["torch", "vllm", "faiss", "sentence_transformers", "datasketch", "transformers"]


def test_importing_semkv_imports_no_heavy_library():
    code = (
        "import sys, json, semkv, semkv.config, semkv.plugins, semkv.gates, semkv.leases, "
        "semkv.namespace, semkv.testing;"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_loading_plugins_imports_no_heavy_library():
    code = (
        "import sys, json; from semkv.plugins import providers; providers();"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_cli_and_bench_core_import_no_heavy_library():
    """Building the CLI loads every plugin (the vLLM adapter's adds ``semkv bench``): that, the
    bench's presets, records and report, and the adapter's plugin import no engine. (The bench's
    scores come from ``semkv.research.quality``, whose package needs the research extra.)"""
    code = (
        "import sys, json; from semkv.cli import build_parser; build_parser();"
        "import semkv.bench, semkv.bench.results, semkv.bench.report, semkv.bench.workload,"
        " semkv_vllm.cli_plugin;"
        f"print(json.dumps([m for m in {HEAVY!r} + ['matplotlib'] if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
