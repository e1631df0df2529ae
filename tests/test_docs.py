"""The documentation site builds with ``mkdocs build --strict`` and its code examples run.

Code examples: every fenced ``python`` block of docs/*.md, README.md and the examples' READMEs
runs as a test (pytest-markdown-docs), each page's blocks in order. Conventions:
- a block that needs an engine or a model, or is a fragment, is fenced ```{.python notest}``
  (the brace syntax that both mkdocs-material and pytest-markdown-docs read);
- ```{.python continuation}`` continues the page's previous block;
- bash, toml, yaml and json blocks are not run (the files they include are tested elsewhere).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from semkv.config import valid_keys

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = ["docs", "README.md", "examples/provider-trigram/README.md",
            "examples/operator/README.md"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEMKV_")}
    env["NO_MKDOCS_2_WARNING"] = "1"  # mkdocs-material's banner about its successor
    return env


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="needs the dev requirements (make env installs them)")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                          "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "core" / "index.html").read_text()
    assert 'id="semkv.config.SemkvConfig"' in api  # the reference is rendered from the code
    providers = re.sub(r"<[^>]+>", "", (tmp_path / "site" / "providers" / "index.html").read_text())
    assert "class TrigramProvider(DonorProvider):" in providers  # the example's code, included


def test_code_examples_run() -> None:
    pytest.importorskip("pytest_markdown_docs", reason="needs the dev requirements")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--markdown-docs",
         "--markdown-docs-syntax=superfences", *MARKDOWN],
        cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=600)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
    passed = re.search(r"(\d+) passed", out.stdout)
    assert passed and int(passed.group(1)) >= 4, out.stdout[-2000:]  # README 1, guides 3


def test_operator_guide_lists_every_config_key() -> None:
    """(Its metrics table is checked against semkv.metrics by test_metrics_reference.py.)"""
    guide = (ROOT / "docs" / "operator.md").read_text()
    missing = [key for key in valid_keys() if f"| `{key}` |" not in guide]
    assert not missing, f"docs/operator.md has no row for config keys {missing}"
