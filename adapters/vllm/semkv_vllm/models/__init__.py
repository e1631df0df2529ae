"""Layer runners over the vLLM engine's own loaded model, and how the connector finds that model.

Protocol:

- ``runner_for(model, context) -> EngineLayerRunner``: the ``semkv.realize.LayerRunner`` for the
  engine's model, chosen by its architecture (the model's class name) in ``RUNNERS``: one small
  module per family (``llama.py``: Llama, Mistral, Qwen2; ``qwen3.py``: Qwen3, Qwen3-MoE;
  ``gemma.py``: Gemma 2, Gemma 3), each a ``DecoderLayerRunner`` (``base.py``: the attention,
  windows, soft caps, the per-layer rotator, the passes) saying only what its family changes.
  Anything else raises ``UnsupportedModelError`` naming the architecture and the supported
  ones; so does a supported architecture with a variant its runner cannot run exactly (the
  reason named), or a rotary embedding a shift cannot move.
- ``find_engine_model()``: called from inside the connector's ``register_kv_caches``, returns the
  engine's loaded model (unwrapped), or None when not called from there.

Why a stack walk is the most robust out-of-tree route to the model in vLLM 0.32:
``register_kv_caches`` is the first connector hook that runs on the worker after the weights are
loaded, and it is called from ``GPUModelRunner.initialize_kv_cache``
(``v1/worker/gpu_model_runner.py``; ``CPUModelRunner.initialize_kv_cache`` reaches it through
``super()``), so one frame up the stack ``self`` is the model runner and ``self.model`` the model.
vLLM hands the connector no reference to either. The alternatives are worse: LMCache's
``VLLMModelTracker`` is only a registry (``register_model`` / ``get_model``) that vLLM 0.32 never
fills (SemBlend fills it with exactly this stack walk); ``worker_extension_cls`` is appended as
the last base of the worker and serves ``collective_rpc`` from the engine side, not the
connector; patching ``load_model`` or the runner class breaks with every vLLM refactor. The walk
here is stricter than SemBlend's (which takes the first ``self`` with a ``model`` attribute): it
wants a ``self`` with ``initialize_kv_cache`` whose ``model`` is an ``nn.Module`` or a wrapper,
and unwraps through the runner's own ``get_model()`` (the GPU runner wraps the model in
``CUDAGraphWrapper`` / ``UBatchWrapper`` before the KV cache exists; the CPU runner holds it
bare), then through any ``unwrap()`` left.

NOTE: no vLLM import happens here; the runners only call the modules of the model they get.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from semkv.realize import LayerRunner
from semkv.realize.memory import Geometry
from semkv_vllm.models.base import DecoderLayerRunner, UnsupportedModelError
from semkv_vllm.models.gemma import Gemma2LayerRunner, Gemma3LayerRunner
from semkv_vllm.models.llama import LlamaLayerRunner
from semkv_vllm.models.qwen3 import Qwen3LayerRunner


class EngineLayerRunner(LayerRunner, Protocol):
    """A ``LayerRunner`` over the engine's loaded model (``model``: that model; ``geometry``:
    its per-rank shape for the realization's memory estimate)."""

    model: Any

    @property
    def geometry(self) -> Geometry: ...


RUNNERS: dict[str, Callable[..., EngineLayerRunner]] = {
    "LlamaForCausalLM": LlamaLayerRunner,
    "MistralForCausalLM": LlamaLayerRunner,
    "Qwen2ForCausalLM": LlamaLayerRunner,
    "Qwen3ForCausalLM": Qwen3LayerRunner,
    "Qwen3MoeForCausalLM": Qwen3LayerRunner,  # its sparse MoE block called as the layer's MLP
    "Gemma2ForCausalLM": Gemma2LayerRunner,
    "Gemma3ForCausalLM": Gemma3LayerRunner,
}
MAX_STACK_DEPTH = 64


def architecture(model: object) -> str:
    return type(model).__name__


def runner_for(model: object,
               context: Callable[[], AbstractContextManager[Any]] | None = None,
               ) -> EngineLayerRunner:
    """The layer runner for the engine's loaded ``model`` (raises ``UnsupportedModelError``);
    ``context``: the engine's forward context, entered around its layer passes."""
    name = architecture(model)
    make = RUNNERS.get(name)
    if make is None:
        raise UnsupportedModelError(
            f"no layer runner for architecture {name!r}; supported: {', '.join(sorted(RUNNERS))}")
    return make(model, context)


def _unwrap(model: Any) -> Any:
    for _ in range(8):  # CUDA-graph / micro-batch wrappers nest at most a few deep
        if isinstance(model, torch.nn.Module) or not callable(getattr(model, "unwrap", None)):
            break
        model = model.unwrap()
    return model


def _runner_model(owner: object) -> torch.nn.Module | None:
    """The model of ``owner`` if it is a vLLM model runner, else None."""
    if owner is None or not callable(getattr(type(owner), "initialize_kv_cache", None)):
        return None
    held = owner.__dict__.get("model") if hasattr(owner, "__dict__") else None
    if held is None:
        return None
    get_model = getattr(owner, "get_model", None)
    model = _unwrap(get_model() if callable(get_model) else held)
    return model if isinstance(model, torch.nn.Module) else None


def find_engine_model(max_depth: int = MAX_STACK_DEPTH) -> torch.nn.Module | None:
    """The engine's loaded model, from the model runner up the call stack (None if absent)."""
    frame = inspect.currentframe()
    try:
        frame = frame.f_back if frame is not None else None
        for _ in range(max_depth):
            if frame is None:
                return None
            model = _runner_model(frame.f_locals.get("self"))
            if model is not None:
                return model
            frame = frame.f_back
        return None
    finally:
        del frame  # frames hold their locals: break the reference cycle at once


__all__ = [
    "RUNNERS",
    "DecoderLayerRunner",
    "EngineLayerRunner",
    "Gemma2LayerRunner",
    "Gemma3LayerRunner",
    "LlamaLayerRunner",
    "Qwen3LayerRunner",
    "UnsupportedModelError",
    "architecture",
    "find_engine_model",
    "runner_for",
]
