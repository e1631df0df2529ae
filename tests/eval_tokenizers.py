"""Tokenizers the ``semkv.eval`` tests build workloads with (no model needed for ``words``)."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import pytest


def words(text: str) -> list[int]:
    """A stand-in tokenizer: one stable id per whitespace-separated word."""
    return [zlib.crc32(w.encode()) % 50_000 for w in text.split()]


def bpe() -> Callable[[str], list[int]]:
    """The bundled model's real BPE tokenizer, when converted on this machine (else a skip)."""
    tokenizers = pytest.importorskip("tokenizers")
    from semkv.bundled_model import model_dir

    path = model_dir() / "tokenizer.json"
    if not path.exists():
        pytest.skip("bundled model not converted here (semkv.bundled_model.ensure_model)")
    tok = tokenizers.Tokenizer.from_file(str(path))
    return lambda text: tok.encode(text, add_special_tokens=False).ids
