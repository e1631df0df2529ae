"""The cost gate's engine side (issue #24, item 2): predicted TTFT gain of a realized plan.

Work in progress: ``predicted_gain`` answers None (cannot predict) until the rates the engine
measures are reported; the scheduler wires it into ``SpanAdmission.cost`` already.
"""

from __future__ import annotations

from typing import Any

from semkv.realize.recompute import RecomputeStrategy
from semkv.span_plan import SpanPlan


class EngineCost:
    def __init__(self, max_batched_tokens: int) -> None:
        self.max_batched_tokens = max_batched_tokens

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> EngineCost:
        return cls(int(vllm_config.scheduler_config.max_num_batched_tokens))

    def predicted_gain(self, plan: SpanPlan, recompute: RecomputeStrategy,
                       prompt_tokens: int) -> float | None:
        return None
