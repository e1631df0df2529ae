"""A model's identity for gate policies: what determines its KV, not where it lives.

A gate policy (``semkv.gate_policy``) certifies plan classes for one model. It must not apply to
another model, nor stop applying when the same model moves to another folder or machine, so its
key is a digest of what determines the KV the model writes:

- the architecture config (``config.json``, less the keys that name a path or a library
  version: ``_name_or_path``, ``transformers_version``; the dtype is its own field);
- the weights: per weight file (``*.safetensors``, else ``*.bin``/``*.pt``) its name, size, its
  safetensors header (every tensor's name, dtype, shape and offsets) and ``SAMPLES`` evenly
  spaced windows of its bytes, so that a fine-tune with the same shapes differs too, while a
  70B checkpoint is read in milliseconds, not hashed whole;
- the compute dtype and the KV-cache dtype the engine runs with.

NOTE: the digest reads the folder only; it never loads weights. An edit confined to bytes
between the sampled windows (with the same header) is not seen: the identity tells models
apart, it is not an integrity check.
NOTE: an unreadable folder raises ``ModelIdentityError`` naming what is missing.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

SAMPLES = 16
WINDOW = 64 * 1024
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


def _file_fingerprint(path: Path, h: hashlib._Hash) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}|{size}|".encode())
    with path.open("rb") as f:
        if path.suffix == ".safetensors" and size >= 8:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(header_len, size - 8)))
        for i in range(SAMPLES):
            f.seek(max(0, (size - WINDOW) * i // max(1, SAMPLES - 1)))
            h.update(f.read(WINDOW))


def model_identity(folder: str | Path, *, dtype: str, kv_cache_dtype: str) -> ModelIdentity:
    """The identity of the model in ``folder`` served with these dtypes."""
    folder = Path(folder)
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelIdentityError(f"model folder {str(folder)!r}: cannot read config.json "
                                 f"({type(exc).__name__})") from None
    kept = {k: v for k, v in config.items() if k not in _CONFIG_NOISE}
    h = hashlib.sha256()
    h.update(json.dumps(kept, sort_keys=True, separators=(",", ":")).encode())
    for path in _weight_files(folder):
        _file_fingerprint(path, h)
    h.update(f"|dtype={dtype}|kv={kv_cache_dtype}".encode())
    arch = "/".join([str(config.get("model_type", "?")),
                     *[str(a) for a in config.get("architectures") or []]])
    return ModelIdentity(h.hexdigest()[:32], arch, dtype, kv_cache_dtype)
