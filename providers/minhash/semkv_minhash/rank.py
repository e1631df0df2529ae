"""Ranking LSH candidates by estimated Jaccard similarity (both stores use it).

``jaccard`` is the share of equal MinHash values between the query's and each donor's
signature; ``target_coverage`` estimates the share of the query's shingles the donor holds:
``|T & D| = J / (1 + J) * (|T| + |D|)``. Best first: highest Jaccard, then donor id.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from semkv.types import Candidate

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray


def rank(np: Any, keys: Sequence[str], donor_sigs: NDArray[np.uint32],
         donor_sizes: NDArray[np.float64], signature: NDArray[np.uint32], query_shingles: int,
         namespace: str, k: int) -> list[Candidate]:
    num_perm = len(signature)
    jaccard = np.count_nonzero(donor_sigs == signature[None, :], axis=1) / num_perm
    coverage = jaccard / (1.0 + jaccard) * (query_shingles + donor_sizes) / query_shingles
    order = sorted(range(len(keys)), key=lambda i: (-float(jaccard[i]), keys[i]))
    return [
        Candidate(
            donor_id=keys[i],
            namespace=namespace,
            similarity=min(1.0, max(0.0, float(jaccard[i]))),
            signals={
                "jaccard": float(jaccard[i]),
                "target_coverage": min(1.0, max(0.0, float(coverage[i]))),
            },
        )
        for i in order[:k]
    ]
