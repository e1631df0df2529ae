"""Configuration of the ``embedding`` provider (the operator's ``provider_config``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class EmbeddingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: Path | None = Field(
        default=None, description="Local sentence-transformers folder; default: bundled MiniLM."
    )
    # 600: one window's forward ~50 ms on one CPU core, a third less than 1,000 characters,
    # with the same donors found first at 1K/4K/8K tokens (benchmarks/embedding_lookup.py).
    max_text_chars: int = Field(
        default=600, ge=1, description="Characters of a text that are embedded (its start)."
    )
    chunk_chars: int = Field(
        default=600, ge=64, description="Characters per embedded window; windows are averaged."
    )
    index: Literal["flat", "hnsw", "auto"] = Field(
        default="auto", description="faiss index per namespace; auto: flat, then HNSW past "
        "hnsw_min_donors donors."
    )
    hnsw_min_donors: int = Field(default=50_000, ge=1)
    hnsw_ef_search: int = Field(default=64, ge=1, description="HNSW search breadth.")
    min_similarity: float = Field(
        default=0.0, ge=0.0, le=1.0, description="Cosine below which no candidate is returned."
    )
    batch_size: int = Field(default=16, ge=1, description="Donors embedded per model call.")
    max_pending: int = Field(
        default=10_000, ge=1, description="Queued donors kept; the oldest are dropped past it."
    )
    lookup_budget_ms: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Longest a lookup waits for the model or the index; None: the host's own lookup "
            "budget (the connector's lookup_timeout_ms), 250 ms where the host names none. "
            "Past the host's budget the host has already answered without this lookup."
        ),
    )
    vector_cache_entries: int = Field(
        default=1024,
        ge=0,
        description=(
            "Window vectors kept (LRU, 1.5 KiB each with MiniLM) so that a text whose windows "
            "were embedded before in the same namespace, a donor's or an earlier lookup's, is "
            "not embedded again (keyed by namespace: no tenant's timing tells another's texts)."
        ),
    )
    faiss_threads: int | None = Field(
        default=1,
        ge=1,
        description=(
            "OpenMP threads for faiss (a process-wide faiss setting; None keeps faiss's own). "
            "One query at a time gains nothing from more, and on a busy CPU extra threads "
            "wait on each other: a 3K-donor search took 16 ms with 2 threads, 0.3 ms with 1."
        ),
    )
    use_gpu: bool = Field(default=True, description="Use a faiss GPU index when faiss has one.")
