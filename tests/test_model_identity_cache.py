"""The weights' identity (a namespace field) and its cache: computed once per change of the
model folder's files, in memory and in semkv's cache folder, recomputed when a file changes.

A small model folder is written by each test (a config and a safetensors file of random
tensors): what is read is files, whatever model they hold.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from semkv import model_identity as mi


def _model(folder: Path, seed: int = 0) -> Path:
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256}))
    gen = torch.Generator().manual_seed(seed)
    save_file({f"layer.{i}.weight": torch.randn(256, 256, generator=gen) for i in range(8)},
              str(folder / "model.safetensors"))
    return folder


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SEMKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(mi, "_CACHE", mi._DigestCache())  # this test's own memory
    return _model(tmp_path / "model")


def _reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The weight files fingerprinted (read) from now on."""
    seen: list[str] = []
    real = mi._file_fingerprint

    def counting(path: Path, h: object, whole: bytes | None = None) -> None:
        seen.append(path.name)
        real(path, h, whole)  # type: ignore[arg-type]

    monkeypatch.setattr(mi, "_file_fingerprint", counting)
    return seen


def test_the_weights_identity_is_the_content_whatever_the_dtype(folder: Path,
                                                                tmp_path: Path) -> None:
    digest = mi.weights_identity(folder)
    moved = tmp_path / "moved"
    shutil.copytree(folder, moved)
    assert len(digest) == 32 and digest == mi.weights_identity(moved)
    assert mi.weights_identity(_model(tmp_path / "other", seed=1)) != digest
    served = mi.model_identity(folder, dtype="float32", kv_cache_dtype="auto").digest
    assert served != digest  # the gate policy's identity adds the dtypes; the namespace has them


def test_computed_once_then_read_from_memory_or_the_cache_file(folder: Path,
                                                               monkeypatch) -> None:
    reads = _reads(monkeypatch)
    first = mi.weights_identity(folder)
    assert reads == ["model.safetensors"]
    assert mi.weights_identity(folder) == first and len(reads) == 1  # memory
    monkeypatch.setattr(mi, "_CACHE", mi._DigestCache())  # another process: the file
    assert mi.weights_identity(folder) == first and len(reads) == 1
    stored = json.loads((Path(os.environ["SEMKV_CACHE_DIR"]) / "model-identity.json").read_text())
    assert first in stored.values()
    assert str(folder) not in json.dumps(stored)  # keys are digests, never paths


def test_a_changed_file_is_read_again(folder: Path, monkeypatch) -> None:
    first = mi.weights_identity(folder)
    reads = _reads(monkeypatch)
    weights = folder / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # touched
    assert mi.weights_identity(folder) == first and reads == ["model.safetensors"]
    replaced = folder / "replacement"  # new weights renamed over the old: another inode
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    replaced.write_bytes(bytes(data))
    os.utime(replaced, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the old mtime
    os.replace(replaced, weights)
    assert weights.stat().st_size == stat.st_size
    assert mi.weights_identity(folder) != first and len(reads) == 2


def test_an_unwritable_cache_folder_still_answers(folder: Path, tmp_path: Path,
                                                  monkeypatch) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("SEMKV_CACHE_DIR", str(blocked / "cache"))
    with pytest.raises(OSError):
        mi._CACHE._path()
    assert len(mi.weights_identity(folder)) == 32


def test_a_single_file_checkpoint_is_its_own_identity(folder: Path) -> None:
    from semkv.assets import smollm2_gguf

    gguf = smollm2_gguf()  # the bundled model's source: one GGUF file, its config inside
    assert mi.model_folder(str(gguf), None) == gguf
    digest = mi.weights_identity(gguf)
    assert len(digest) == 32 and digest != mi.weights_identity(folder)


def test_every_byte_of_the_weights_is_in_the_namespace_s_identity(folder: Path) -> None:
    """A fine-tune of a few tensors with the same shapes: an edit between the gate policy's
    sampled windows. Its KV differs, so the namespace's identity (every byte) must move; the
    gate policy's (sampled) keeps its value, as the module says."""
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    between = mi.WINDOW + 100  # after the first window, before the second
    assert between + 1 < (size - mi.WINDOW) // (mi.SAMPLES - 1)
    before = mi.weights_identity(folder)
    policy_key = mi.model_identity(folder, dtype="float32", kv_cache_dtype="auto").digest
    with weights.open("r+b") as f:
        f.seek(between)
        byte = f.read(1)
        f.seek(between)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert mi.weights_identity(folder) != before
    assert mi.model_identity(folder, dtype="float32", kv_cache_dtype="auto").digest == policy_key
