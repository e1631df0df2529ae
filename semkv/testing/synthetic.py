"""Deterministic synthetic documents for the contract suite (no corpus text needed).

Token ids map to pronounceable pseudo-words so text-based providers (MinHash, embeddings) see
text whose overlap follows the token overlap.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import lru_cache

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "st"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]
VOCAB_SIZE = 4096


@lru_cache(maxsize=VOCAB_SIZE)
def _word(token_id: int) -> str:
    rng = random.Random(token_id * 7919 + 17)
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3)))


def synthetic_detokenize(token_ids: Sequence[int]) -> str:
    return " ".join(_word(int(t) % VOCAB_SIZE) for t in token_ids)


class SyntheticCorpus:
    """Random token documents, reproducible from a seed."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def document(self, num_tokens: int) -> tuple[int, ...]:
        return tuple(self._rng.randrange(VOCAB_SIZE) for _ in range(num_tokens))

    def documents(self, count: int, num_tokens: int) -> list[tuple[int, ...]]:
        return [self.document(num_tokens) for _ in range(count)]
