"""The bundled model as research's ``LayerwiseModel``, for the tests that run it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def bundled_layerwise_model() -> Iterator[Any]:
    """The bundled SmolLM2 model, fp32, on one torch thread while it is in use.

    Sequences in the tests are short: one thread is as fast, and a second one only waits for a
    core when other jobs share the machine (10x slower on the 2-core dev box).
    """
    import torch

    from semkv.bundled_model import ensure_model
    from semkv.research import LayerwiseModel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LayerwiseModel.from_pretrained(ensure_model())
    finally:
        torch.set_num_threads(threads)
