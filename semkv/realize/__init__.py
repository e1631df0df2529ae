"""Realizing a prompt's KV layer by layer: the torch-level contract shared by every runner.

One realization semantics, two runners: ``semkv.research.LayerwiseModel`` (transformers) and
``semkv_vllm.models.LlamaLayerRunner`` (the vLLM engine's own loaded modules) both implement
``LayerRunner`` over the same ``KVCache``, so the assembly and recompute strategies of
``semkv.research`` drive either of them unchanged. ``semkv.realize.span`` places copies and
computes positions; ``semkv.realize.recompute`` decides and runs selective recompute (none,
first_k, blend) for research's whole prompts and the engine worker's spans alike.

This package needs torch; importing ``semkv`` never imports it.
"""

from __future__ import annotations

from semkv.realize.cache import KVCache
from semkv.realize.runner import KeyRotator, LayerRunner

__all__ = ["KVCache", "KeyRotator", "LayerRunner"]
