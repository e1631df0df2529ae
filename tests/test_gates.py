from hypothesis import given
from hypothesis import strategies as st

from semkv.gates import (
    block_alignment_gate,
    full_prompt_cap,
    prefix_anchor_gate,
    reuse_tokens_gate,
    similarity_gate,
    tier_gate,
)
from semkv.types import FallbackReason, Mode, QualityTier


def test_tier_gate_by_mode():
    assert tier_gate(Mode.DISABLED, QualityTier.EXACT) is FallbackReason.PROVIDER_DISABLED
    for tier in QualityTier:
        assert tier_gate(Mode.DISCOVERY_ONLY, tier) is FallbackReason.RECOMPUTE_POLICY
        assert tier_gate(Mode.MATERIALIZE_SEMANTIC, tier) is None
    assert tier_gate(Mode.MATERIALIZE_EXACT, QualityTier.EXACT) is None
    for tier in (QualityTier.VERIFIED, QualityTier.SEMANTIC):
        assert tier_gate(Mode.MATERIALIZE_EXACT, tier) is FallbackReason.RECOMPUTE_POLICY


def test_similarity_gate():
    assert similarity_gate(0.95, 0.9) is None
    assert similarity_gate(0.9, 0.9) is None
    assert similarity_gate(0.89, 0.9) is FallbackReason.LOW_SIMILARITY
    assert similarity_gate(float("nan"), 0.0) is FallbackReason.LOW_SIMILARITY


def test_reuse_tokens_gate():
    assert reuse_tokens_gate(128, 128) is None
    assert reuse_tokens_gate(96, 128) is FallbackReason.LOW_REUSE_TOKENS
    assert reuse_tokens_gate(0, 0) is FallbackReason.LOW_REUSE_TOKENS


def test_block_alignment_and_anchor():
    assert block_alignment_gate(32, 64, 32) is None
    assert block_alignment_gate(16, 64, 32) is FallbackReason.NOT_BLOCK_ALIGNED
    assert block_alignment_gate(32, 48, 32) is FallbackReason.NOT_BLOCK_ALIGNED
    assert block_alignment_gate(16, 48, 32, required=False) is None
    assert prefix_anchor_gate(64, 64) is None
    assert prefix_anchor_gate(96, 64) is FallbackReason.NOT_PREFIX_ANCHORED


def test_full_prompt_cap_examples():
    # 256-token prompt fully covered by a donor: sync must leave a token, so 7 blocks of 32.
    assert full_prompt_cap(256, 0, 256, 32) == 224
    assert full_prompt_cap(257, 0, 256, 32) == 256
    assert full_prompt_cap(256, 0, 256, 32, synchronous=False) == 256
    assert full_prompt_cap(256, 64, 1000, 32) == 160
    assert full_prompt_cap(40, 32, 32, 32) == 0


@given(
    prompt=st.integers(0, 10_000),
    local_blocks=st.integers(0, 400),
    external=st.integers(0, 10_000),
    block=st.sampled_from([16, 32, 64, 128]),
    sync=st.booleans(),
)
def test_full_prompt_cap_properties(prompt, local_blocks, external, block, sync):
    local = min(local_blocks * block, prompt - prompt % block)
    allowed = full_prompt_cap(prompt, local, external, block, synchronous=sync)
    assert 0 <= allowed <= external
    assert (local + allowed) % block == 0
    if sync:
        assert local + allowed < prompt or allowed == 0
    else:
        assert local + allowed <= prompt


def test_common_prefix_across_sequence_types():
    from array import array

    from semkv.types import Candidate
    from semkv.verify import verify

    a = list(range(1000))
    b = array("q", list(range(700)) + [5] * 300)
    cand = Candidate(donor_id="d", namespace="n", similarity=0.5)
    assert verify(a, b, 32, cand).common_prefix_tokens == 700
    assert verify(tuple(a), a, 32, cand).exact_prefix_tokens == 992
    assert verify(a, b[:512], 32, cand).exact_prefix_tokens == 512
    assert verify([], b, 32, cand).exact_prefix_tokens == 0
