"""The exact prefix index: which donor holds a prompt's first n whole blocks, by block key.

Every request is looked up here, whatever the provider says: the exact tier never depends on a
provider's recall. A long new document behind a stored system prompt is far from it by any
similarity measure, yet its first blocks are the system prompt's.

Keys are chained, as vLLM's and LMCache's prefix keys: block i's key hashes block i - 1's key
and block i's token ids, and the first block's parent is the hash of the namespace digest
(model, tokenizer, KV layout, LoRA, ``cache_salt``). A key therefore names one namespace's
whole prefix up to the end of its block: two donors that share a key share every token before
it. The host's donor store (``semkv_vllm.store_index``) addresses its slots by the same keys.

Protocol (the engine adapter's donor registry drives it):
- ``add`` when a donor is registered (the keys of its whole blocks), ``remove`` when it is
  dropped, ``clear`` when the engine's caches are reset;
- ``longest`` walks a target's keys from the first block, hashing lazily, and stops at the
  first key no donor holds (or, with ``stored``, whose KV is gone from the store): a miss costs
  one hash, a hit of n blocks n hashes and n dict look-ups;
- the donor it names is a candidate like a provider's: admission verifies its tokens again.

NOTE: one holder of key i is enough to serve the first i blocks (the content is addressed by
the key), so a key keeps its holders in registration order and ``longest`` names the newest.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterator, Sequence

KEY_BYTES = 16


def root_key(namespace: str) -> bytes:
    """The parent of a namespace's first block key."""
    return hashlib.blake2b(namespace.encode(), digest_size=KEY_BYTES).digest()


def iter_block_keys(namespace: str, tokens: Sequence[int], block_size: int, start_block: int = 0,
                    parent: bytes | None = None) -> Iterator[bytes]:
    """Chained keys of every whole block of ``tokens`` from ``start_block`` on, one at a time
    (``parent``: the key of block ``start_block - 1``; by default the namespace's root)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    prev = parent if parent is not None else root_key(namespace)
    # NOTE: each block is converted when its key is asked for: a walk that stops at the first
    # block (a miss) reads one block of the prompt, not all of it.
    for start in range(start_block * block_size, len(tokens) - block_size + 1, block_size):
        chunk = array("q", tokens[start : start + block_size]).tobytes()
        prev = hashlib.blake2b(prev + chunk, digest_size=KEY_BYTES).digest()
        yield prev


def block_keys(namespace: str, tokens: Sequence[int], block_size: int, start_block: int = 0,
               parent: bytes | None = None) -> list[bytes]:
    """Chained keys of every whole block of ``tokens`` from ``start_block`` on."""
    return list(iter_block_keys(namespace, tokens, block_size, start_block, parent))


class PrefixIndex:
    """Block key -> the donors whose whole blocks include it."""

    def __init__(self) -> None:
        # NOTE: one holder is a str (most keys: one donor's own document); several, a dict
        # used as an ordered set, so a system prompt shared by 10,000 donors costs no list scan.
        self._holders: dict[bytes, str | dict[str, None]] = {}

    def __len__(self) -> int:
        """Distinct keys held."""
        return len(self._holders)

    def add(self, donor_id: str, keys: Sequence[bytes]) -> None:
        for key in keys:
            held = self._holders.get(key)
            if held is None:
                self._holders[key] = donor_id
            elif isinstance(held, str):
                if held != donor_id:
                    self._holders[key] = {held: None, donor_id: None}
            else:
                held.pop(donor_id, None)  # added again: it becomes the newest holder
                held[donor_id] = None

    def remove(self, donor_id: str, keys: Sequence[bytes]) -> None:
        for key in keys:
            held = self._holders.get(key)
            if held is None:
                continue
            if isinstance(held, str):
                if held == donor_id:
                    del self._holders[key]
                continue
            held.pop(donor_id, None)
            if len(held) == 1:
                self._holders[key] = next(iter(held))

    def holders(self, key: bytes) -> tuple[str, ...]:
        """Every donor holding ``key``."""
        held = self._holders.get(key)
        if held is None:
            return ()
        return (held,) if isinstance(held, str) else tuple(held)

    def holder(self, key: bytes) -> str | None:
        """The newest donor holding ``key``."""
        held = self._holders.get(key)
        if held is None or isinstance(held, str):
            return held
        return next(reversed(held))

    def longest(self, namespace: str, tokens: Sequence[int], block_size: int, *,
                stored: Callable[[bytes], bool] | None = None) -> tuple[int, str | None]:
        """(how many whole blocks of ``tokens``, from the first, some donor holds; that donor).

        ``stored``: a key counts only while its KV can be loaded (the donor store's view).
        """
        found, donor = 0, None
        if not self._holders:
            return found, donor
        for key in iter_block_keys(namespace, tokens, block_size):
            held = self.holder(key)
            if held is None or (stored is not None and not stored(key)):
                break
            found, donor = found + 1, held
        return found, donor

    def clear(self) -> None:
        self._holders.clear()
