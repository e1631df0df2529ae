"""Every engine gets an explicit KV cache size, computed by one helper (``semkv.kv_sizing``).

vLLM-CPU without ``kv_cache_memory_bytes`` takes a fraction of the NUMA node minus its own
resident memory: negative (start-up refused) on hosts with smaller nodes. The scan below fails
when an engine is built anywhere in the repository (Python code, shell, README and docs command
blocks) without an explicit size, or with a host fraction, so the next engine added cannot
bring that back.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from semkv.kv_sizing import kv_bytes_per_token, kv_cache_bytes, kv_dtype_of

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".venv", ".git", "site", "build", "dist", "bench-results", "__pycache__"}
ENGINE_CALLS = {"LLM", "EngineArgs", "AsyncEngineArgs", "CacheConfig"}
SERVER_MARKERS = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli")
SERVE_IN_TEXT = re.compile(r"(vllm\.entrypoints\.openai\.api_server|(^|[\s;&|(])vllm serve\b)")


def _files(*suffixes: str) -> list[Path]:
    out = []
    for path in ROOT.rglob("*"):
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in path.parts):
            continue
        if path.is_file() and (path.suffix in suffixes or path.name in suffixes):
            out.append(path)
    return sorted(out)


def _call_name(node: ast.Call) -> str | None:
    func = node.func
    return func.id if isinstance(func, ast.Name) else (
        func.attr if isinstance(func, ast.Attribute) else None)


def unsized_engines_in_python(source: str, where: str = "<string>") -> list[str]:
    """Engine constructions and server command lines in ``source`` lacking an explicit size."""
    tree = ast.parse(source)
    problems: list[str] = []
    scopes = [n for n in ast.walk(tree)
              if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]

    def scope_text(node: ast.AST) -> str:
        inner = [s for s in scopes
                 if s.lineno <= node.lineno <= (s.end_lineno or s.lineno)]
        best = min(inner, key=lambda s: (s.end_lineno or s.lineno) - s.lineno, default=None)
        return ast.get_source_segment(source, best) or "" if best else source

    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "gpu_memory_utilization":
            problems.append(f"{where}:{node.value.lineno}: gpu_memory_utilization (host fraction)")
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value == "--gpu-memory-utilization":
                problems.append(f"{where}:{node.lineno}: --gpu-memory-utilization")
            if any(m in node.value for m in SERVER_MARKERS) and (
                    "--kv-cache-memory-bytes" not in scope_text(node)):
                problems.append(f"{where}:{node.lineno}: vLLM server without "
                                "--kv-cache-memory-bytes")
        if isinstance(node, ast.Call) and _call_name(node) in ENGINE_CALLS:
            named = any(k.arg == "kv_cache_memory_bytes" for k in node.keywords)
            splat = any(k.arg is None for k in node.keywords)
            if not named and not (splat and "kv_cache_memory_bytes" in scope_text(node)):
                problems.append(f"{where}:{node.lineno}: {_call_name(node)}(...) without "
                                "kv_cache_memory_bytes")
    return problems


def unsized_servers_in_text(text: str, where: str = "<text>") -> list[str]:
    """Command blocks (fenced, or whole shell files) that start vLLM without an explicit size."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S) if where.endswith(".md") else [text]
    problems = []
    for block in blocks:
        if SERVE_IN_TEXT.search(block) and "--kv-cache-memory-bytes" not in block:
            problems.append(f"{where}: a vLLM server command without --kv-cache-memory-bytes")
        if "--gpu-memory-utilization" in block:
            problems.append(f"{where}: --gpu-memory-utilization (host fraction)")
    return problems


def test_scanner_catches_an_unsized_engine():
    assert unsized_engines_in_python("from vllm import LLM\nllm = LLM(model='m')\n")
    assert unsized_engines_in_python("def f():\n    return LLM(**dict(model='m'))\n")
    assert unsized_engines_in_python("LLM(model='m', gpu_memory_utilization=0.1, "
                                     "kv_cache_memory_bytes=1)\n")
    assert unsized_engines_in_python(
        "def f():\n    return ['python', '-m', 'vllm.entrypoints.openai.api_server']\n")
    assert not unsized_engines_in_python("LLM(model='m', kv_cache_memory_bytes=1 << 28)\n")
    assert not unsized_engines_in_python(
        "def f(x):\n    args = dict(kv_cache_memory_bytes=x)\n    return LLM(**args)\n")
    assert unsized_servers_in_text("```bash\nvllm serve MODEL --dtype float32\n```\n", "a.md")
    assert not unsized_servers_in_text(
        "```bash\nvllm serve M --kv-cache-memory-bytes 1\n```\n", "a.md")


def test_every_engine_in_the_repository_has_an_explicit_kv_size():
    problems: list[str] = []
    py_files = _files(".py")
    assert len(py_files) > 100  # the scan really walked the repository
    for path in py_files:
        if path == Path(__file__).resolve():
            continue  # the scanner's own self-test snippets
        rel = str(path.relative_to(ROOT))
        problems += unsized_engines_in_python(path.read_text(), rel)
    for path in _files(".md", ".sh", ".yml", ".yaml", "Makefile"):
        rel = str(path.relative_to(ROOT))
        if rel == "docs/notes.md":
            continue  # session notes quote past commands as history, not as instructions
        problems += unsized_servers_in_text(path.read_text(), rel)
    assert not problems, "\n".join(problems)


def test_bundled_model_bytes_per_token_and_whole_blocks(tmp_path):
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
              "hidden_size": 576}
    (tmp_path / "config.json").write_text(json.dumps(config))
    per_token = 30 * 3 * 64 * 2 * 4
    assert kv_bytes_per_token(tmp_path) == per_token
    assert kv_bytes_per_token(tmp_path, "bfloat16") == per_token // 2
    # 100 tokens in blocks of 32 take 4 blocks; two requests take 8
    assert kv_cache_bytes(tmp_path, max_model_len=100, max_num_seqs=2,
                          block_size=32) == 8 * 32 * per_token
    with pytest.raises(ValueError, match="KV dtype"):
        kv_bytes_per_token(tmp_path, "int3")
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="attention geometry"):
        kv_bytes_per_token(tmp_path)
    with pytest.raises(ValueError, match="cannot read"):
        kv_bytes_per_token(tmp_path / "missing")


def test_the_kv_dtype_sized_for_is_the_engines(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert kv_dtype_of("float32", "fp8", tmp_path) == "fp8"  # --kv-cache-dtype first
    assert kv_dtype_of("float32", "auto", tmp_path) == "float32"  # then --dtype
    assert kv_dtype_of("auto", "auto", tmp_path) == "bfloat16"  # then the model's own
    assert kv_dtype_of("auto", "auto", tmp_path / "missing") == "float32"  # unsure: the most
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "int4"}))
    assert kv_dtype_of("auto", "auto", tmp_path) == "float32"


def test_cli_prints_the_same_figure_for_the_bundled_model():
    from semkv.bundled_model import ensure_model

    out = subprocess.run(
        [sys.executable, "-m", "semkv.cli", "kv-cache-bytes", "--max-model-len", "4096",
         "--max-num-seqs", "4"], capture_output=True, text=True, check=True).stdout
    assert int(out) == kv_cache_bytes(ensure_model(), max_model_len=4096, max_num_seqs=4,
                                      block_size=128) == 46_080 * 4096 * 4
    bad = subprocess.run([sys.executable, "-m", "semkv.cli", "kv-cache-bytes", "--kv-dtype",
                          "int3"], capture_output=True, text=True)
    assert bad.returncode == 2 and "int3" in bad.stderr
