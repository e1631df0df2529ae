"""A model's identity for gate policies: what determines its KV, not where it lives.

A gate policy (``semkv.gate_policy``) certifies plan classes for one model. It must not apply to
another model, nor stop applying when the same model moves to another folder or machine, so its
key is a digest of what determines the KV the model writes:

- the architecture config (``config.json``, less the keys that name a path or a library
  version: ``_name_or_path``, ``transformers_version``; the dtype is its own field);
- the weights: per weight file (``*.safetensors``, else ``*.bin``/``*.pt``) its name, size, its
  safetensors header (every tensor's name, dtype, shape and offsets) and ``SAMPLES`` evenly
  spaced windows of its bytes, so that a 70B checkpoint is read in milliseconds;
- the compute dtype and the KV-cache dtype the engine runs with.

The weights' identity (``weights_identity``), a field of the cache namespace, is stricter: the
architecture config and every byte of every weight file (SHA-256, files hashed in parallel:
~0.5 s for the bundled 540 MB model, about a minute per 100 GB at disk speed), so that no two
checkpoints whose KV could differ share a namespace, a fine-tune of a few tensors with the same
shapes included: new weights rolled out under the same path never meet the old ones' KV.
Both are cached, in memory and in semkv's cache folder, keyed by every file's size, mtime,
ctime and inode, so an engine's start-up reads the folder once per change of its files.

NOTE: the gate policy's identity (``model_identity``) samples: an edit confined to bytes
between its windows with the same header keeps it (a fine-tune of a few tensors can), so a
policy certified for one checkpoint applies to such a fine-tune; its KV never serves the other
(their namespaces differ). Run ``semkv calibrate`` on a fine-tune to certify its own policy.
NOTE: the digests read the folder only; they never load weights.
NOTE: an unreadable folder raises ``ModelIdentityError`` naming what is missing.
"""

from __future__ import annotations

import hashlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from semkv.atomic_file import write_text_atomic

SAMPLES = 16
WINDOW = 64 * 1024
CHUNK = 8 << 20  # bytes read at a time when a file is hashed whole
HASH_THREADS = 8  # weight files hashed at once
_CONFIG_NOISE = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype"})
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


class ModelIdentityError(ValueError):
    """The model folder cannot give an identity (the message names the folder and the file)."""


@dataclass(frozen=True)
class ModelIdentity:
    digest: str  # 32 hex characters
    architecture: str  # config.json's model_type and architectures, for people reading a policy
    dtype: str
    kv_cache_dtype: str

    def describe(self) -> str:
        return (f"{self.architecture} dtype={self.dtype} kv_cache_dtype={self.kv_cache_dtype} "
                f"digest={self.digest}")


def _weight_files(folder: Path) -> list[Path]:
    for suffix in _WEIGHT_SUFFIXES:
        found = sorted(p for p in folder.glob(f"*{suffix}") if p.is_file())
        if found:
            return found
    raise ModelIdentityError(f"model folder {str(folder)!r}: no weight files "
                             f"({', '.join('*' + s for s in _WEIGHT_SUFFIXES)})")


def _whole_file(path: Path) -> bytes:
    """SHA-256 of every byte of ``path`` (hashlib releases the GIL: files hash in parallel)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.digest()


def _file_fingerprint(path: Path, h: hashlib._Hash, whole: bytes | None = None) -> None:
    """Name, size and content of one weight file: ``whole`` (its ``_whole_file`` digest)
    where given, else its safetensors header and ``SAMPLES`` windows."""
    size = path.stat().st_size
    h.update(f"{path.name}|{size}|".encode())
    if whole is not None:
        h.update(whole)
        return
    with path.open("rb") as f:
        if path.suffix == ".safetensors" and size >= 8:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(header_len, size - 8)))
        for i in range(SAMPLES):
            f.seek(max(0, (size - WINDOW) * i // max(1, SAMPLES - 1)))
            h.update(f.read(WINDOW))


def _checkpoint(folder: Path) -> list[Path]:
    """The weight files: ``folder`` itself when it is a single-file checkpoint (GGUF: its
    header holds its config), else the folder's."""
    return [folder] if folder.is_file() else _weight_files(folder)


def _files(folder: Path) -> list[Path]:
    """Every file the digest reads (what its cache key stats)."""
    config = [] if folder.is_file() else [folder / "config.json"]
    return [*config, *_checkpoint(folder)]


def _stat_key(folder: Path, purpose: str) -> str:
    """Changes whenever a file is rewritten, replaced or touched (ctime cannot be set back)."""
    stats = []
    for path in _files(folder):
        st = path.stat()
        stats.append([path.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
    raw = json.dumps([str(folder.resolve()), purpose, stats], separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()


def _read_config(folder: Path) -> dict[str, object]:
    config_path = folder / "config.json"
    try:
        config: dict[str, object] = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelIdentityError(f"model folder {str(folder)!r}: cannot read config.json "
                                 f"({type(exc).__name__})") from None
    return config


def _digest(folder: Path, config: dict[str, object], suffix: str, whole: bool) -> str:
    kept = {k: v for k, v in config.items() if k not in _CONFIG_NOISE}
    h = hashlib.sha256()
    h.update(json.dumps(kept, sort_keys=True, separators=(",", ":")).encode())
    files = _checkpoint(folder)
    bodies: list[bytes | None] = [None] * len(files)
    if whole:
        with ThreadPoolExecutor(min(HASH_THREADS, len(files))) as pool:
            bodies = list(pool.map(_whole_file, files))
    for path, body in zip(files, bodies, strict=True):
        _file_fingerprint(path, h, body)
    h.update(suffix.encode())
    return h.hexdigest()[:32]


class _DigestCache:
    """Digests by ``_stat_key``: in memory, and in ``<semkv cache>/model-identity.json`` (the
    last ``KEEP`` entries; written whole to a temporary file, then renamed)."""

    KEEP = 64

    def __init__(self) -> None:
        self._memory: dict[str, str] = {}
        self._lock = threading.Lock()

    def _path(self) -> Path:
        from semkv.assets import cache_dir

        return cache_dir() / "model-identity.json"

    def get(self, key: str) -> str | None:
        with self._lock:
            if key in self._memory:
                return self._memory[key]
        try:
            found = json.loads(self._path().read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            return None
        if isinstance(found, str):
            with self._lock:
                self._memory[key] = found
            return found
        return None

    def put(self, key: str, digest: str) -> None:
        with self._lock:
            self._memory[key] = digest
        try:
            path = self._path()
            try:
                entries = json.loads(path.read_text())
                entries = entries if isinstance(entries, dict) else {}
            except (OSError, ValueError):
                entries = {}
            entries.pop(key, None)
            entries[key] = digest
            kept = dict(list(entries.items())[-self.KEEP:])
            write_text_atomic(path, json.dumps(kept))
        except OSError:
            pass  # a read-only cache folder: the digest is computed again next start


_CACHE = _DigestCache()


def _cached_digest(folder: Path, config: dict[str, object], suffix: str,
                   whole: bool = False) -> str:
    key = _stat_key(folder, suffix)
    found = _CACHE.get(key)
    if found is None:
        found = _digest(folder, config, suffix, whole)
        _CACHE.put(key, found)
    return found


def model_identity(folder: str | Path, *, dtype: str, kv_cache_dtype: str) -> ModelIdentity:
    """The identity of the model in ``folder`` served with these dtypes."""
    folder = Path(folder)
    config = _read_config(folder)
    digest = _cached_digest(folder, config, f"|dtype={dtype}|kv={kv_cache_dtype}")
    architectures = config.get("architectures")
    names = [str(a) for a in architectures] if isinstance(architectures, list) else []
    arch = "/".join([str(config.get("model_type", "?")), *names])
    return ModelIdentity(digest, arch, dtype, kv_cache_dtype)


def weights_identity(folder: str | Path) -> str:
    """The digest of ``folder``'s architecture config and every byte of its weights (32 hex
    characters), whatever dtype they are served with (``folder`` may be a single-file
    checkpoint, e.g. a GGUF); raises ``ModelIdentityError`` naming what cannot be read."""
    folder = Path(folder)
    config = {} if folder.is_file() else _read_config(folder)
    return _cached_digest(folder, config, "|weights-whole", whole=True)


def model_folder(model: str, revision: str | None) -> Path | None:
    """The local folder of ``model``: itself (or a single checkpoint file), or its Hugging Face
    snapshot if cached."""
    path = Path(model)
    if path.is_dir() or path.is_file():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - no local snapshot: the model has no identity here
        return None
