"""semkv provider ``semblend``: SemBlend's semantic donor discovery as a semkv provider.

Importing this package is cheap: ``semblend`` (numpy, rapidfuzz, torch) and
sentence-transformers are imported when a provider is built, not before.
"""

from semkv_semblend.provider import SemBlendConfig, SemBlendProvider

__all__ = ["SemBlendConfig", "SemBlendProvider"]
