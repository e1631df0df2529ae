"""Example third-party semkv provider ``trigram``: donors sharing token trigrams."""

from semkv_trigram.provider import TrigramConfig, TrigramProvider

__all__ = ["TrigramConfig", "TrigramProvider"]
