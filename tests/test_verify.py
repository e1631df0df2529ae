"""The token-level verifier: exact prefix, identical aligned runs, similarity and tier."""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from semkv.types import Candidate, QualityTier
from semkv.verify import MAX_POSTINGS, Verification, verify

BS = 16


def _random(n: int, seed: int, vocab: int = 50_000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _zipf(n: int, seed: int) -> list[int]:
    """Ids with text-like statistics (a few frequent ids, a long tail)."""
    rng = random.Random(seed)
    return [int(rng.paretovariate(1.1) * 7) % 49_152 for _ in range(n)]


def _cand(ts: int = 0, ds: int = 0, n: int = 0, donor_id: str = "d") -> Candidate:
    return Candidate(
        donor_id=donor_id, namespace="ns", similarity=0.5, target_start=ts, donor_start=ds,
        num_tokens=n,
    )


def test_identical_is_exact() -> None:
    t = _random(1000, 1)
    v = verify(t, list(t), BS)
    assert v.common_prefix_tokens == 1000
    assert v.exact_prefix_tokens == 992  # rounded down to whole blocks
    assert (v.target_start, v.donor_start, v.num_tokens) == (0, 0, 992)
    assert v.tier is QualityTier.EXACT and v.identical and v.similarity == 1.0
    assert v.block_aligned and v.span_source == "verifier"


def test_prefix_then_divergence() -> None:
    shared = _random(100, 2)
    v = verify(shared + _random(50, 3), shared + _random(60, 4), BS)
    assert v.common_prefix_tokens == 100
    assert v.exact_prefix_tokens == 96
    assert v.tier is QualityTier.EXACT and v.num_tokens == 96


def test_document_behind_other_instruction_is_verified() -> None:
    doc = _random(640, 5)
    donor = _random(32, 6) + doc  # system prompt A: two blocks
    target = _random(64, 7) + doc  # system prompt B: four blocks
    v = verify(target, donor, BS)
    assert v.exact_prefix_tokens == 0
    assert (v.run_target_start, v.run_donor_start, v.run_tokens) == (64, 32, 640)
    assert v.tier is QualityTier.VERIFIED and v.token_differences == 0


def test_unaligned_shift_is_semantic_but_similar() -> None:
    doc = _random(2048, 8)
    v = verify(_random(5, 9) + doc, doc, BS)
    assert v.run_tokens == 0 and v.tier is QualityTier.SEMANTIC
    assert v.similarity > 0.9  # the paired span agrees up to a small shift


def test_candidate_span_is_judged_and_clipped() -> None:
    doc = _random(256, 10)
    target, donor = _random(48, 11) + doc, doc + _random(16, 12)
    v = verify(target, donor, BS, _cand(48, 0, 256))
    assert v.span_source == "candidate" and v.tier is QualityTier.VERIFIED
    assert v.donor_id == "d" and v.token_differences == 0
    wrong = verify(target, donor, BS, _cand(0, 0, 256))
    assert wrong.tier is QualityTier.SEMANTIC and wrong.token_differences > 200
    clipped = verify(target, donor, BS, _cand(48, 0, 10_000))
    assert clipped.clipped and clipped.num_tokens == 256 and clipped.block_aligned


def test_unrelated_donor_gets_low_similarity() -> None:
    target = _random(4096, 13)
    for donor in (_random(4096, 14), _zipf(4096, 15)):
        v = verify(target, donor, BS, _cand(0, 0, 4096))
        assert v.similarity < 0.1 and v.jaccard < 0.2 and v.tier is QualityTier.SEMANTIC


def test_empty_inputs() -> None:
    assert verify([], [], BS).num_tokens == 0
    v = verify([1, 2, 3], [], BS, _cand(0, 0, 3))
    assert v.num_tokens == 0 and v.similarity == 0.0 and v.tier is QualityTier.SEMANTIC
    with pytest.raises(ValueError):
        verify([1], [1], 0)


def test_verification_is_frozen_serializable_and_payload_free() -> None:
    v = verify(_random(300, 16), _random(300, 17), BS, _cand(0, 0, 128))
    assert Verification.model_validate_json(v.model_dump_json()) == v
    with pytest.raises(ValidationError):
        v.similarity = 1.0  # type: ignore[misc]
    for value in json.loads(v.model_dump_json()).values():
        assert not isinstance(value, list), "a Verification must not carry token ids"
    assert set(v.signals()) and all(isinstance(x, float) for x in v.signals().values())


def test_importing_verify_does_not_import_rapidfuzz() -> None:
    code = "import sys, semkv, semkv.verify; print('rapidfuzz' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("case", ["identical", "shifted", "unrelated", "unrelated_uniform"])
def test_8k_against_8k_is_fast(case: str) -> None:
    doc = _zipf(8192, 18)
    pairs = {
        "identical": (doc, list(doc)),
        "shifted": (_zipf(48, 19) + doc[:-48], doc),
        "unrelated": (doc, _zipf(8192, 20)),
        "unrelated_uniform": (_random(8192, 21), _random(8192, 22)),  # the worst case for sets
    }
    target, donor = pairs[case]
    cand = _cand(0, 0, 8192)
    verify(target, donor, BS, cand)  # warm the lazy import
    times = []
    for _ in range(25):
        start = time.perf_counter()
        verify(target, donor, BS, cand)
        times.append(time.perf_counter() - start)
    # The best run is the cost without preemption (shared CI cores); the median is reported.
    best, median = min(times), statistics.median(times)
    assert best < 0.005, f"best {best * 1e3:.2f} ms, median {median * 1e3:.2f} ms"


# ---- properties -------------------------------------------------------------------------

_tokens = st.lists(st.integers(0, 6), max_size=80)  # a tiny vocabulary forces collisions


@st.composite
def _pairs(draw: st.DrawFn) -> tuple[list[int], list[int], int]:
    shared = draw(_tokens)
    if draw(st.booleans()):
        target = draw(_tokens) + shared + draw(_tokens)
    else:
        target = shared + draw(_tokens)
    donor = shared + draw(_tokens) if draw(st.booleans()) else draw(_tokens) + shared
    return target, donor, draw(st.integers(1, 8))


def _brute_run(t: list[int], d: list[int], bs: int) -> int:
    best = 0
    for i in range(0, len(t) - bs + 1, bs):
        for j in range(0, len(d) - bs + 1, bs):
            n = 0
            while i + n + bs <= len(t) and j + n + bs <= len(d) and (
                t[i + n : i + n + bs] == d[j + n : j + n + bs]
            ):
                n += bs
            best = max(best, n)
    return best


@settings(max_examples=300, deadline=None)
@given(_pairs())
def test_exact_prefix_is_identical_and_maximal(pair: tuple[list[int], list[int], int]) -> None:
    t, d, bs = pair
    v = verify(t, d, bs)
    c, p = v.common_prefix_tokens, v.exact_prefix_tokens
    assert t[:c] == d[:c] and (c == min(len(t), len(d)) or t[c] != d[c])
    assert p % bs == 0 and p <= c < p + bs and t[:p] == d[:p]


@settings(max_examples=300, deadline=None)
@given(_pairs())
def test_spans_are_aligned_identical_and_within_bounds(
    pair: tuple[list[int], list[int], int],
) -> None:
    t, d, bs = pair
    v = verify(t, d, bs)
    ts, ds, n = v.run_target_start, v.run_donor_start, v.run_tokens
    assert ts % bs == 0 and ds % bs == 0 and n % bs == 0
    assert ts + n <= len(t) and ds + n <= len(d) and t[ts : ts + n] == d[ds : ds + n]
    assert n >= v.exact_prefix_tokens
    blocks = Counter(tuple(d[j : j + bs]) for j in range(0, len(d) - bs + 1, bs))
    if not blocks or max(blocks.values()) <= MAX_POSTINGS:
        assert n == _brute_run(t, d, bs)  # maximal whenever no donor block is capped
    assert v.block_aligned and v.target_start + v.num_tokens <= len(t)


@settings(max_examples=300, deadline=None)
@given(_pairs(), st.integers(0, 90), st.integers(0, 90), st.integers(0, 90))
def test_candidate_spans_tiers_and_scores(
    pair: tuple[list[int], list[int], int], ts: int, ds: int, n: int
) -> None:
    t, d, bs = pair
    v = verify(t, d, bs, _cand(ts, ds, n))
    a = t[v.target_start : v.target_start + v.num_tokens]
    b = d[v.donor_start : v.donor_start + v.num_tokens]
    assert v.target_start + v.num_tokens <= len(t) and v.donor_start + v.num_tokens <= len(d)
    assert v.token_differences == sum(x != y for x, y in zip(a, b, strict=True))
    assert 0.0 <= v.similarity <= 1.0 and 0.0 <= v.jaccard <= v.token_f1 <= 1.0
    if v.tier is QualityTier.EXACT:
        assert v.target_start == v.donor_start == 0 and a == b and v.num_tokens > 0
    elif v.tier is QualityTier.VERIFIED:
        assert a == b and v.num_tokens > 0 and (v.target_start, v.donor_start) != (0, 0)
    else:
        assert v.num_tokens == 0 or v.token_differences > 0


@settings(max_examples=100, deadline=None)
@given(st.integers(64, 2048), st.integers(0, 2**32), st.integers(1, 32))
def test_unrelated_tokens_get_low_similarity(n: int, seed: int, bs: int) -> None:
    target = _random(n, seed)
    donor = [x + 50_000 for x in _random(n, seed + 1)]  # no id in common at all
    for cand in (None, _cand(0, 0, n)):
        v = verify(target, donor, bs, cand)
        assert v.similarity == 0.0 and v.jaccard == 0.0 and v.tier is QualityTier.SEMANTIC
    related = verify(target, _random(n, seed + 2), bs, _cand(0, 0, n))
    assert related.similarity < 0.25
