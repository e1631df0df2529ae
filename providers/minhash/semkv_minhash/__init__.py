"""semkv provider ``minhash``: lexical near-duplicate donors by MinHash LSH over token shingles.

Importing this package is cheap: datasketch and numpy load when a provider is built.
"""

from semkv_minhash.provider import MinHashConfig, MinHashProvider

__all__ = ["MinHashConfig", "MinHashProvider"]
