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
