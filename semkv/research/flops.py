"""Estimated prefill FLOPs, to turn "which tokens were computed in which layers" into savings.

Protocol: ``FlopModel.from_config(config).prefill(passes)`` where ``passes`` lists (layer range,
computed positions), as ``PrefillResult.passes`` does; ``saved(passes, n)`` is the fraction of a
full prefill's FLOPs (every position in every layer) that the passes did not spend.

Per token and decoder layer: 2 FLOPs per weight of the attention projections and the MLP, plus
attention over its causal context: 2 * heads * head_dim for scores and again for the weighted
values, per key at or before its position (hence position + 1 keys). The embedding lookup, the
LM head on the last token and the KV re-rotation (a few FLOPs per cached key channel) are the
same for every strategy or negligible, and are left out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FlopModel:
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int

    @classmethod
    def from_config(cls, config: Any) -> FlopModel:
        head_dim = int(getattr(config, "head_dim", None)
                       or config.hidden_size // config.num_attention_heads)
        return cls(int(config.hidden_size), int(config.num_attention_heads),
                   int(config.num_key_value_heads), head_dim, int(config.intermediate_size))

    @property
    def layer_weights(self) -> int:
        attention = self.hidden_size * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attention + 3 * self.hidden_size * self.intermediate_size  # gate, up, down

    def token_layer(self, position: int) -> float:
        """FLOPs of one token at ``position`` through one decoder layer."""
        return 2.0 * self.layer_weights + 4.0 * self.heads * self.head_dim * (position + 1)

    def prefill(self, passes: Iterable[tuple[range, Iterable[int]]]) -> float:
        return sum(len(layers) * sum(self.token_layer(p) for p in positions)
                   for layers, positions in passes)

    def saved(self, passes: Iterable[tuple[range, Iterable[int]]], num_tokens: int,
              num_layers: int) -> float:
        """Fraction of a full prefill's FLOPs that ``passes`` did not spend."""
        full = self.prefill([(range(num_layers), range(num_tokens))])
        return 1.0 - self.prefill(passes) / full if full else 0.0
