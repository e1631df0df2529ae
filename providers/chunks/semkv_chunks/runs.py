"""From chunk postings to ranked candidates: the same logic over either store.

``best_runs`` takes, per query chunk ``i``: the donors whose chained (prefix) hash ``i`` matches,
and the ``{donor: first chunk index}`` postings of the chunk's position-free hash. The longest
prefix hit wins for its donor; span runs extend along each (donor, shift) diagonal, and a
longer run replaces a donor's held one. ``candidates`` ranks them: most shared chunks first,
then earliest target position, then donor id.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from semkv.types import Candidate


@dataclass
class Run:
    donor_start: int
    target_start: int
    chunks: int


def best_runs(prefix_hits: Iterable[Iterable[str]], span_postings: Iterable[Mapping[str, int]],
              chunk: int) -> dict[str, Run]:
    best: dict[str, Run] = {}
    for i, donors in enumerate(prefix_hits):
        hit = False
        for donor_id in donors:
            best[donor_id] = Run(0, 0, i + 1)
            hit = True
        if not hit:
            break
    open_runs: dict[tuple[str, int], Run] = {}
    for i, postings in enumerate(span_postings):
        next_runs: dict[tuple[str, int], Run] = {}
        for donor_id, j in postings.items():
            key = (donor_id, j - i)
            run = open_runs.get(key) or Run(j * chunk, i * chunk, 0)
            run.chunks += 1
            next_runs[key] = run
            held = best.get(donor_id)
            if held is None or run.chunks > held.chunks:
                best[donor_id] = run
        open_runs = next_runs
    return best


def candidates(best: Mapping[str, Run], lengths: Mapping[str, int], namespace: str,
               chunk: int, total: int, k: int) -> list[Candidate]:
    """Ranked candidates of the donors in ``lengths`` (others: gone, dropped), runs that start
    inside their donor only (a shared store's postings are not trusted)."""
    ranked = sorted(((d, r) for d, r in best.items()
                     if d in lengths and r.donor_start < lengths[d]),
                    key=lambda kv: (-kv[1].chunks, kv[1].target_start, kv[0]))
    return [
        Candidate(
            donor_id=donor_id,
            namespace=namespace,
            similarity=min(1.0, run.chunks * chunk / total),
            donor_start=run.donor_start,
            target_start=run.target_start,
            num_tokens=min(run.chunks * chunk, lengths[donor_id] - run.donor_start),
            signals={"shared_chunks": float(run.chunks)},
        )
        for donor_id, run in ranked[:k]
    ]
