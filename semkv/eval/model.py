"""Labelled workload types: cluster kinds, prompts and the workload that holds them.

A workload is engine-neutral: prompts are text (plus token ids when a tokenizer was given).
Protocol for a benchmark: register every ``Workload.donors`` prompt first (run it, let the
engine and the provider store it), then send ``Workload.targets``; each target knows its true
donor (``true_donor_id``) or None for negative controls, and its cluster label (``kind``).

NOTE: prompts carry corpus text. Their ``repr`` shows ids and sizes only, and ``summary()``
is counts only: log those, never the text or token ids.
"""

from __future__ import annotations

from collections import Counter
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ClusterKind(str, Enum):
    """What a cluster tests; the label every prompt of the cluster carries."""

    EXACT_CONTROL = "exact_control"  # the identical prompt, repeated
    PARTIAL_OVERLAP = "partial_overlap"  # same document, another question appended
    CROSS_INSTRUCTION = "cross_instruction"  # same document, other system prompt / chat wrapper
    REORDERED_CHUNKS = "reordered_chunks"  # same retrieved passages, another order
    PARAPHRASED_LEAD_IN = "paraphrased_lead_in"  # edited instruction and first lines, rest same
    NEGATIVE_UNRELATED = "negative_unrelated"  # a document no donor shares; no donor
    NEGATIVE_SAME_TOPIC = "negative_same_topic"  # same topic label as a donor, other text
    # Added later (see LATER_KINDS): targets realized from donor segments and computed gaps.
    MULTI_PASSAGE_RAG = "multi_passage_rag"  # k passages, each from another donor, new order
    CROSS_INSTRUCTION_TASK_FIRST = "cross_instruction_task_first"  # another task, same document
    QUOTED_SECTION = "quoted_section"  # another document quoting a donor's section elsewhere

    def __str__(self) -> str:
        return self.value

    @property
    def is_negative(self) -> bool:
        return self in (ClusterKind.NEGATIVE_UNRELATED, ClusterKind.NEGATIVE_SAME_TOPIC)


KINDS: tuple[ClusterKind, ...] = tuple(ClusterKind)
# Kinds added after results were published. ``build_workload`` builds them after all others,
# from their own random stream, so the clusters of the other kinds stay identical for a seed.
# A kind added later is appended here, never inserted: the kinds before it draw what they drew.
LATER_KINDS: tuple[ClusterKind, ...] = (
    ClusterKind.MULTI_PASSAGE_RAG, ClusterKind.CROSS_INSTRUCTION_TASK_FIRST,
    ClusterKind.QUOTED_SECTION,
)


class Prompt(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_id: str
    cluster_id: str
    kind: ClusterKind
    role: Literal["donor", "target"]
    text: str = Field(repr=False)
    true_donor_id: str | None = None  # targets only; None for negative controls
    token_ids: tuple[int, ...] | None = Field(default=None, repr=False)
    metadata: dict[str, Any] = Field(default_factory=dict)

    def __repr__(self) -> str:  # ids and sizes only: never corpus text or token ids
        return (
            f"Prompt({self.prompt_id!r}, kind={self.kind.value}, role={self.role}, "
            f"chars={len(self.text)}, true_donor_id={self.true_donor_id!r})"
        )

    __str__ = __repr__


class Workload(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    seed: int
    target_tokens: int | None
    kinds: tuple[ClusterKind, ...]
    donors: tuple[Prompt, ...]  # register these first
    targets: tuple[Prompt, ...]  # then ask for reuse with these

    def __repr__(self) -> str:
        return f"Workload(seed={self.seed}, donors={len(self.donors)}, targets={len(self.targets)})"

    __str__ = __repr__

    def prompt(self, prompt_id: str) -> Prompt:
        for prompt in (*self.donors, *self.targets):
            if prompt.prompt_id == prompt_id:
                return prompt
        raise KeyError(prompt_id)

    def clusters(self) -> dict[str, list[Prompt]]:
        """Prompts grouped by cluster id, donors before targets."""
        grouped: dict[str, list[Prompt]] = {}
        for prompt in (*self.donors, *self.targets):
            grouped.setdefault(prompt.cluster_id, []).append(prompt)
        return dict(sorted(grouped.items()))

    def summary(self) -> dict[str, Any]:
        """Counts only (safe to log): prompts per kind and role, and approximate sizes."""
        sizes = [int(p.metadata.get("approx_tokens", 0)) for p in self.targets]
        return {
            "seed": self.seed,
            "target_tokens": self.target_tokens,
            "donors": dict(Counter(p.kind.value for p in self.donors)),
            "targets": dict(Counter(p.kind.value for p in self.targets)),
            "negative_targets": sum(p.true_donor_id is None for p in self.targets),
            "target_tokens_min": min(sizes, default=0),
            "target_tokens_max": max(sizes, default=0),
        }
