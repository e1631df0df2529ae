"""Quality of a reused-cache generation against the full-prefill reference, on token lists.

Protocol: generate greedily from the full prefill (the reference) and from the reused cache
(the candidate), teacher-force the reference through both caches, then
``score_generation(candidate, reference, reference_logprob=..., reuse_logprob=...)``:

- ``exact_match``: the greedy continuations are identical;
- ``first_divergence``: index of the first differing generated token (the common length when
  one is a prefix of the other, the length when identical);
- ``rouge_l``: LCS-based F1 over generated tokens (ROUGE-L with beta = 1);
- ``token_f1``: bag-of-tokens F1 (SQuAD-style, multiplicities counted);
- ``reference_logprob`` / ``reuse_logprob``: mean log-probability per token of the reference
  continuation under the full and the reused cache; ``logprob_delta`` = reuse - reference
  (negative: the reused cache finds the right answer less likely).

Distributions known only by their top-k log-probabilities (an engine's ``prompt_logprobs``)
are compared with ``coarse_kl``; ``top_margin`` is a distribution's top-1 minus top-2 log-prob
(how near a tie its greedy choice was).

Pure Python, no torch: these run on token ids and never keep them. NOTE: scores only; a
QualityScores is safe to log.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass


def lcs_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common subsequence (O(len(a) * len(b)), two rows)."""
    if not a or not b:
        return 0
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b, start=1):
            current.append(previous[j - 1] + 1 if x == y else max(previous[j], current[j - 1]))
        previous = current
    return previous[-1]


def _f1(overlap: int, candidate_len: int, reference_len: int) -> float:
    if candidate_len == 0 and reference_len == 0:
        return 1.0  # both empty: nothing to disagree on
    if overlap == 0:
        return 0.0
    precision, recall = overlap / candidate_len, overlap / reference_len
    return 2 * precision * recall / (precision + recall)


def rouge_l(candidate: Sequence[int], reference: Sequence[int]) -> float:
    return _f1(lcs_length(candidate, reference), len(candidate), len(reference))


def token_f1(candidate: Sequence[int], reference: Sequence[int]) -> float:
    overlap = sum((Counter(candidate) & Counter(reference)).values())
    return _f1(overlap, len(candidate), len(reference))


def first_divergence(candidate: Sequence[int], reference: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(candidate, reference, strict=False)):
        if x != y:
            return i
    return min(len(candidate), len(reference))


@dataclass(frozen=True)
class QualityScores:
    exact_match: bool
    first_divergence: int
    rouge_l: float
    token_f1: float
    reference_logprob: float
    reuse_logprob: float

    @property
    def logprob_delta(self) -> float:
        return self.reuse_logprob - self.reference_logprob

    def as_dict(self) -> dict[str, float | int | bool]:
        return {**asdict(self), "logprob_delta": self.logprob_delta}


def score_generation(
    candidate: Sequence[int], reference: Sequence[int], *,
    reference_logprob: float = 0.0, reuse_logprob: float = 0.0,
) -> QualityScores:
    return QualityScores(
        exact_match=list(candidate) == list(reference),
        first_divergence=first_divergence(candidate, reference),
        rouge_l=rouge_l(candidate, reference),
        token_f1=token_f1(candidate, reference),
        reference_logprob=reference_logprob,
        reuse_logprob=reuse_logprob,
    )


def coarse_kl(p: Mapping[int, float], q: Mapping[int, float]) -> float:
    """KL(P || Q) in nats over the tokens both top-k lists name, plus one bucket for the rest.

    ``p`` and ``q`` map token id -> log-probability for SOME tokens of each distribution (a
    top-k list). Merging the other tokens into one bucket coarse-grains both distributions the
    same way, so this is a lower bound on the full-vocabulary KL (data processing inequality),
    exact when the lists cover the mass; 0 for identical distributions.
    """
    shared = p.keys() & q.keys()
    kl, p_rest, q_rest = 0.0, 1.0, 1.0
    for token in shared:
        pi, qi = math.exp(p[token]), math.exp(q[token])
        p_rest -= pi
        q_rest -= qi
        if pi > 0.0:
            kl += pi * (p[token] - q[token])
    p_rest, q_rest = max(p_rest, 0.0), max(q_rest, 1e-12)
    if p_rest > 1e-12:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0)


def top_margin(p: Mapping[int, float]) -> float:
    """Top-1 minus top-2 log-probability (inf when only one token is listed)."""
    best = sorted(p.values(), reverse=True)[:2]
    return best[0] - best[1] if len(best) == 2 else math.inf
