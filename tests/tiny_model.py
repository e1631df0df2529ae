"""A tiny random Llama behind ``semkv.research.LayerwiseModel``, for tests of the realization
semantics that need a real layer stack but not a trained model (seeded: the same each run)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def tiny_llama(num_layers: int) -> Iterator[Any]:
    """4 heads over 2 KV heads, head size 16, fp32, one thread (deterministic sums)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from semkv.research import LayerwiseModel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=num_layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=1024,
                         attn_implementation="eager")
    try:
        yield LayerwiseModel(LlamaForCausalLM(config).to(torch.float32))
    finally:
        torch.set_num_threads(threads)
