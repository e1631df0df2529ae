"""Token maps for non-identical reuse (``semkv.span_map``): tiers, jumps, gates, invariants."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from semkv.span_map import map_span
from semkv.types import QualityTier

B = 16


def seq(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 50000) for _ in range(n)]


def test_identical_prefix_maps_to_itself_as_exact():
    t = seq(1, 200)
    m = map_span(t, t, 0, B, max_tokens=199)
    assert m is not None and m.tier is QualityTier.EXACT
    assert m.segments == ((0, 0, 192),) and m.token_differences == 0


def test_shifted_body_is_verified_with_one_jump():
    body = seq(2, 160)
    donor, target = seq(3, 48) + body, body + seq(4, 10)
    m = map_span(target, donor, 0, B, max_tokens=len(target) - 1)
    assert m is not None and m.tier is QualityTier.VERIFIED
    assert m.segments == ((0, 48, 160),) and m.num_tokens == 160


def test_other_instruction_same_length_is_semantic_with_counted_differences():
    body = seq(5, 320)
    donor, target = seq(6, 16) + body, seq(7, 16) + body + seq(8, 5)
    m = map_span(target, donor, 0, B, max_tokens=len(target) - 1, min_agreement=0.9)
    assert m is not None and m.tier is QualityTier.SEMANTIC
    assert m.num_tokens == 336 and m.token_differences == 16
    assert abs(m.agreement - 320 / 336) < 1e-9


def test_longer_target_instruction_jumps_to_the_shared_body():
    body = seq(9, 320)
    donor, target = seq(10, 8) + body, seq(11, 24) + body
    m = map_span(target, donor, 0, B, max_tokens=len(target) - 1, min_agreement=0.9)
    assert m is not None
    # after the differing instruction every body token is served by the same body token
    positions = range(m.target_start, m.target_start + m.num_tokens)
    served = dict(zip(positions, m.donor_positions(), strict=True))
    assert all(donor[served[p]] == target[p] for p in range(24, m.num_tokens))


def test_reordered_chunks_are_found_in_either_order():
    a, b = seq(12, 96), seq(13, 96)
    m = map_span(b + a, a + b, 0, B, max_tokens=191)
    assert m is not None and m.tier is QualityTier.VERIFIED
    assert m.segments[0] == (0, 96, 96) and m.segments[1][:2] == (96, 0)


def test_differing_tail_is_left_to_compute():
    body = seq(14, 256)
    m = map_span(body + seq(15, 64), body + seq(16, 64), 0, B, max_tokens=319,
                 min_agreement=0.9)
    assert m is not None and m.num_tokens == 256  # not into the differing question


def test_unrelated_sequences_never_pass_a_high_agreement_gate():
    assert map_span(seq(17, 300), seq(18, 300), 0, B, max_tokens=299, min_agreement=0.5) is None


def test_span_starts_after_the_local_prefix():
    body = seq(19, 200)
    m = map_span(body, seq(20, 32) + body, 64, B, max_tokens=100)
    assert m is not None and m.target_start == 64 and m.num_tokens == 96
    assert m.segments == ((64, 96, 96),)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=200),
       st.lists(st.integers(0, 30), min_size=1, max_size=200),
       st.integers(0, 4), st.floats(0.0, 1.0))
def test_invariants(target, donor, start_blocks, min_agreement):
    start = start_blocks * B
    m = map_span(target, donor, start, B, max_tokens=len(target), min_agreement=min_agreement)
    if m is None:
        return
    positions = m.donor_positions()
    assert m.num_tokens % B == 0 and m.num_tokens == len(positions)
    assert m.target_start == start and start + m.num_tokens <= len(target)
    assert all(0 <= q < len(donor) for q in positions)
    assert m.token_differences == sum(
        target[start + i] != donor[q] for i, q in enumerate(positions))
    assert m.agreement >= min_agreement
    covered = [t + i for t, _, n in m.segments for i in range(n)]
    assert covered == list(range(start, start + m.num_tokens))
