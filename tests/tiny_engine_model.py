"""A tiny random-weight Llama on disk, for engine tests of mechanisms (copies, refusals,
lifecycles, exactness), not of quality: the bundled model's tokenizer, vocabulary and rotary
base, 4 layers of 6 query heads over 3 KV heads (tensor parallelism up to 3 ranks, as the
bundled model), head size 32.

``tiny_model_dir()`` builds it once per machine with transformers' ``from_config`` (seeded)
into semkv's cache, outside the repository, and returns the folder vLLM loads.

NOTE: the initializer scale is 0.1, not transformers' 0.02: at 0.02 the random model repeats
one token whatever the prompt, so "output equals cold" would hold even for wrong KV. At 0.1
greedy outputs vary and the next token depends on the prompt's first half. The build measures
both (``checks.json`` in the folder): the float noise of the logits (one forward against the
same tokens in two cached chunks), the greedy margins (top-1 minus top-2 logit) at every
position of four essay prompts, and whether the argmax moves when a prompt's first half is
replaced. ``tiny_model_dir`` refuses a model whose 1st-percentile margin is not 100x its noise
or whose output ignores the far context.

``tiny_model_dir("mistral")`` and ``tiny_model_dir("qwen2")`` are the same geometry in vLLM's
other Llama-family architectures; ``tiny_model_dir("mistral-windowed")`` is Mistral with a
64-token sliding window in every layer (its far context is out of reach by design).
``tiny_model_dir("gemma3")`` is a tiny Gemma 3 text model
(``Gemma3TextConfig``): 12 layers in Gemma 3's own pattern, five of a 64-token sliding window
to one of full attention (at 6 layers, one full layer let the far context move the argmax on 1
prompt of 4: the check refused it); vLLM's hybrid KV cache keeps six KV-cache groups for it, as
for Gemma 3 270M.
``tiny_model_dir("gemma3-windowed")`` windows every layer: one group, whose blocks out of the
window are vLLM's null block; its far context is out of reach by design, so only the margin
check applies to it. Both use the bundled tokenizer and the same initializer scale.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

GEOMETRY = {"num_hidden_layers": 4, "hidden_size": 192, "intermediate_size": 384,
            "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 32,
            "initializer_range": 0.1}
WINDOW = 64  # the Gemma 3 models' sliding window: a test prompt crosses it many times
_GEMMA3 = {"num_hidden_layers": 12, "hidden_size": 192, "intermediate_size": 384,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
           "sliding_window": WINDOW, "initializer_range": 0.1, "max_position_embeddings": 8192}
_LLAMA_LIKE = {**GEOMETRY, "max_position_embeddings": 8192}
# family -> (the transformers config class, or None: the bundled model's own; its settings)
FAMILIES: dict[str, tuple[str | None, dict[str, Any]]] = {
    "llama": (None, GEOMETRY),
    # the rest of vLLM's Llama family (semkv_vllm.models.RUNNERS): Mistral without a window,
    # Qwen2 (biases on q/k/v)
    "mistral": ("MistralConfig", {**_LLAMA_LIKE, "sliding_window": None}),
    # every layer windowed (vLLM: one sliding-window KV-cache group)
    "mistral-windowed": ("MistralConfig", {**_LLAMA_LIKE, "sliding_window": WINDOW}),
    "qwen2": ("Qwen2Config", {**_LLAMA_LIKE, "use_sliding_window": False}),
    # q/k RMS norms per head before RoPE, their weights moved off transformers' ones (a runner
    # that swapped or skipped them must not pass)
    "qwen3": ("Qwen3Config", {**_LLAMA_LIKE, "use_sliding_window": False, "norm_noise": 0.2}),
    # Qwen3 with a sparse MoE block in every layer: 4 experts, 2 per token
    "qwen3-moe": ("Qwen3MoeConfig", {**_LLAMA_LIKE, "use_sliding_window": False,
                                     "norm_noise": 0.2, "num_experts": 4,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 192,
                                     "decoder_sparse_step": 1}),
    "gemma3": ("Gemma3TextConfig", _GEMMA3),
    "gemma3-windowed": ("Gemma3TextConfig",
                        {**_GEMMA3, "layer_types": ["sliding_attention"] * 12}),
    # for the layer runners: Gemma's (1 + w) norms moved off zero
    "gemma3-norms": ("Gemma3TextConfig", {**_GEMMA3, "norm_noise": 0.2}),
    # Gemma 2: window and full layers alternating, an attention soft cap that binds (random
    # scores reach ~10), no q/k norms
    "gemma2": ("Gemma2Config", {**_GEMMA3, "num_hidden_layers": 6, "norm_noise": 0.2,
                                "attn_logit_softcapping": 3.0,
                                "final_logit_softcapping": None}),
}
SEED = 0
# Settings of the build, not of the config: every norm weight w becomes w + N(0, noise^2).
BUILD_ONLY = ("norm_noise",)
NOISE_TO_MARGIN = 100  # the 1st-percentile margin must be this many times the float noise
_DONE = "checks.json"


def tiny_model_dir(family: str = "llama") -> Path:
    """The tiny model's folder (built and checked on first use; later calls only read)."""
    import torch
    import transformers

    from semkv.assets import cache_dir
    from semkv.bundled_model import ensure_model

    key = hashlib.sha256(json.dumps(
        [FAMILIES[family][1], SEED, torch.__version__, transformers.__version__,
         str(ensure_model().name)], sort_keys=True).encode()).hexdigest()[:12]
    target = cache_dir() / "models" / f"tiny-{family}-{key}"
    if not (target / _DONE).exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / f".{target.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per machine; others wait, then reuse
            if not (target / _DONE).exists():
                _build(ensure_model(), target, family)
    _check(json.loads((target / _DONE).read_text()), family)
    return target


def _check(checks: dict[str, Any], family: str) -> None:
    if checks["margin_p1"] < NOISE_TO_MARGIN * checks["noise"]:
        raise RuntimeError(f"tiny model: greedy margins too close to float noise: {checks}")
    settings = FAMILIES[family][1]
    layer_types = settings.get("layer_types")
    far_reach = ("full_attention" in layer_types if layer_types is not None
                 else not settings.get("sliding_window"))
    if far_reach and checks["far_context_moves_argmax"] < checks["prompts"] // 2:
        raise RuntimeError(f"tiny model: the next token ignores the prompt's first half: {checks}")


def _config(bundled: Path, family: str) -> Any:
    import transformers

    own = transformers.AutoConfig.from_pretrained(str(bundled))  # vocabulary, special ids
    kind, settings = FAMILIES[family]
    settings = {k: v for k, v in settings.items() if k not in BUILD_ONLY}
    if kind is None:  # the bundled Llama's config (its rotary base too), resized
        for name, value in settings.items():
            setattr(own, name, value)
        return own
    return getattr(transformers, kind)(
        vocab_size=own.vocab_size, bos_token_id=own.bos_token_id,
        eos_token_id=own.eos_token_id, pad_token_id=own.pad_token_id, **settings)


def _build(bundled: Path, target: Path, family: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = _config(bundled, family)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        _perturb_norms(model, FAMILIES[family][1].get("norm_noise"))
        tokenizer = AutoTokenizer.from_pretrained(str(bundled))
        checks = _measure(model, tokenizer)
        _check(checks, family)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        (tmp / _DONE).write_text(json.dumps(checks, indent=1) + "\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        torch.set_num_threads(threads)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _perturb_norms(model: Any, noise: float | None) -> None:
    """Norm weights off their initial constant (seeded with the model): per-channel scales a
    runner must really apply."""
    import torch

    if not noise:
        return
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * noise)


def _measure(model: Any, tokenizer: Any) -> dict[str, Any]:
    import torch
    from transformers import DynamicCache

    from tests.engine_utils import essay_prompts

    docs = essay_prompts(4, chars=3000, seed=3)
    noise, margins, moved = 0.0, [], 0
    with torch.no_grad():
        for i, doc in enumerate(docs):
            ids = tokenizer(doc, return_tensors="pt").input_ids
            full = model(ids).logits[0]
            half = ids.shape[1] // 2
            cache = DynamicCache(config=model.config)
            model(ids[:, :half], past_key_values=cache)
            chunked = model(ids[:, half:], past_key_values=cache).logits[0]
            noise = max(noise, float((full[half:] - chunked).abs().max()))
            top = full.topk(2, dim=-1).values
            margins += (top[:, 0] - top[:, 1]).tolist()
            other = tokenizer(docs[(i + 1) % len(docs)], return_tensors="pt").input_ids
            swapped = ids.clone()
            swapped[0, :half] = other[0, :half]
            moved += int(model(swapped).logits[0, -1].argmax() != full[-1].argmax())
    margins.sort()
    return {"noise": noise, "margin_p1": margins[len(margins) // 100],
            "margin_median": margins[len(margins) // 2], "positions": len(margins),
            "prompts": len(docs), "far_context_moves_argmax": moved}


@contextmanager
def tiny_layerwise_model() -> Iterator[Any]:
    """The same tiny model as research's ``LayerwiseModel``, on one torch thread while in use."""
    from tests.bundled_lm import layerwise_model

    with layerwise_model(tiny_model_dir()) as lm:
        yield lm
