"""The host memory of semkv's discovery state, bounded in bytes by one setting.

``index_memory_bytes`` bounds everything semkv keeps in the engine's process to find and check
donors, beside the donor store's KV (``donor_store_bytes``):

- per donor: its token ids (8 bytes each, a compact array) and its block keys (a 16-byte key
  object each, held by the donor and by the exact prefix index), plus a fixed record;
- per donor, the provider's index for it (``DonorProvider.donor_memory_bytes``; where a
  provider does not say, ``UNKNOWN_BYTES_PER_TOKEN`` per token);
- whatever the donors: the anchor cache of span planning (``ANCHOR_SHARE`` of the setting) and
  the provider's own caches (``DonorProvider.cache_memory_bytes``).

The donor registry adds each donor's cost when it registers and drops the least recently used
donors (never a leased one) while the sum is over what the setting leaves for donors.

NOTE: the per-donor figures are upper estimates of what CPython allocates for these structures,
checked against ``tracemalloc`` (tests/test_index_memory.py); they do not count allocator
slack or memory a C library keeps outside Python's allocator beyond what a provider reports.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from semkv.config import ConfigError
from semkv.prefix_index import KEY_BYTES

UNKNOWN_BYTES_PER_TOKEN = 64  # a provider that does not say (built-ins: 3 to ~290)
ANCHOR_SHARE = 0.25  # of index_memory_bytes, for the anchor cache (semkv.anchor_cache)
# a block key: its bytes object, a slot in the donor's list, an entry in the prefix index
_KEY_COST = sys.getsizeof(bytes(KEY_BYTES)) + 8 + 64
_DONOR_FIXED = 640  # the record and its id, the by-tail, lease and LRU entries
_ARRAY_HEADER = 64


def registry_bytes(num_tokens: int, num_keys: int) -> int:
    """What the host's own structures hold for one donor."""
    return _DONOR_FIXED + _ARRAY_HEADER + 8 * num_tokens + 56 + _KEY_COST * num_keys


@dataclass(frozen=True)
class IndexBudget:
    """How ``index_memory_bytes`` is split: the anchor cache, the provider's caches, and what
    is left for donors."""

    total: int
    anchor_cache: int
    provider_caches: int

    @property
    def donors(self) -> int:
        return self.total - self.anchor_cache - self.provider_caches

    @classmethod
    def split(cls, total: int, provider_caches: int) -> IndexBudget:
        """Raises ``ConfigError`` when nothing is left for donors."""
        budget = cls(total, int(total * ANCHOR_SHARE), max(0, int(provider_caches)))
        if budget.donors < total // 8:
            raise ConfigError(
                f"index_memory_bytes={total}: the anchor cache ({budget.anchor_cache} bytes) and "
                f"the provider's caches ({budget.provider_caches} bytes) leave "
                f"{max(budget.donors, 0)} bytes for donors (at least an eighth is needed): raise "
                "index_memory_bytes or shrink the provider's caches")
        return budget
