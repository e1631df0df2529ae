"""What one ``semkv bench`` request and one arm leave behind: counts, times, outputs in memory.

These records are filled by the engine driver (``semkv_vllm.bench``, the vLLM adapter's
distribution) and read by the engine-free summaries, span tables and reports of this package;
nothing here imports an engine.

NOTE: outputs (token ids) stay in memory for scoring; no result row ever carries them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from semkv.bench.config import Arm

# Histogram sums: semkv's own time (scheduler lookups + admission; worker saves and loads;
# span realizations' compute, which the request waits for before its first token).
SEMKV_SECONDS = ("vllm:semkv_lookup_seconds", "vllm:semkv_save_seconds",
                 "vllm:semkv_load_seconds", "vllm:semkv_realize_seconds")


@dataclass
class Snapshot:
    """``vllm:semkv_*`` counters (by name and label) and histogram sums/counts at one moment."""

    values: dict[str, float] = field(default_factory=dict)

    def __sub__(self, other: Snapshot) -> Snapshot:
        keys = set(self.values) | set(other.values)
        return Snapshot({k: self.values.get(k, 0.0) - other.values.get(k, 0.0) for k in keys})

    def get(self, name: str) -> float:
        return self.values.get(name, 0.0)

    def semkv_seconds(self) -> float:
        return sum(self.get(f"{n}:sum") for n in SEMKV_SECONDS)


@dataclass
class Run:
    """One request: times, output length, the connector's summary and metric deltas."""

    ttft_s: float
    e2e_s: float
    output: list[int]  # kept in memory for scoring only, never written out
    summary: dict[str, Any]
    delta: Snapshot
    prompt_tokens: int


@dataclass
class ArmResult:
    """Raw runs of one arm, keyed by prompt id (outputs stay in memory only)."""

    arm: Arm
    miss: dict[str, Run] = field(default_factory=dict)
    donors: dict[str, Run] = field(default_factory=dict)
    reuse: dict[str, Run] = field(default_factory=dict)
    vllm_hit: dict[str, Run] = field(default_factory=dict)  # disabled only
    logprob: dict[str, dict[int, float]] = field(default_factory=dict)  # answer position -> lp
    logprob_summary: dict[str, dict[str, Any]] = field(default_factory=dict)
    donor_store_bytes: float = 0.0
    batch_wall_s: float = 0.0
    batch: dict[str, Run] = field(default_factory=dict)
    engine_start_s: float = 0.0
