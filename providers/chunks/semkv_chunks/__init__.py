"""semkv provider ``chunks``: donors sharing exact, block-aligned token spans."""

from semkv_chunks.provider import ChunksConfig, ChunksProvider

__all__ = ["ChunksConfig", "ChunksProvider"]
