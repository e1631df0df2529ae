import json
import pickle

import pytest
from pydantic import ValidationError

from semkv.types import (
    CachePolicy,
    Candidate,
    FallbackReason,
    Materialization,
    Mode,
    Provenance,
    QualityTier,
    SemanticKVMatch,
    SemanticLoadPlan,
)


def _hit(**over):
    fields = dict(
        request_id="r1",
        donor_id="d1",
        donor_lease_id="L1",
        similarity=1.0,
        local_prefix_tokens=32,
        external_prefix_tokens=96,
        donor_prefix_tokens=128,
        materialization=Materialization.SYNC,
        quality_tier=QualityTier.EXACT,
        metadata={"provider": "chunks"},
    )
    fields.update(over)
    return SemanticKVMatch(**fields)


VALUES = [
    _hit(),
    SemanticKVMatch.fallback("r2", FallbackReason.LOW_SIMILARITY, local_prefix_tokens=64),
    SemanticLoadPlan(
        request_id="r1", donor_id="d1", lease_id="L1", local_tokens=32, external_tokens=96,
        block_ids=((4, 5, 6),),
    ),
    Candidate(donor_id="d", namespace="ns", similarity=0.5, num_tokens=32),
]


def test_vocabulary_sizes_match_design():
    # DESIGN.md's sixteen, the two span gates (#24), the engine's KV-cache groups (#48)
    assert len(FallbackReason) == 19
    assert {m.value for m in Mode} == {
        "disabled", "discovery_only", "materialize_exact", "materialize_semantic"
    }
    assert {t.value for t in QualityTier} == {"exact", "verified", "semantic"}
    assert {p.value for p in CachePolicy} == {"exact_commit", "request_only"}
    assert len(Provenance) == 5


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_round_trip_pickle_and_json(value):
    assert pickle.loads(pickle.dumps(value)) == value
    again = type(value).model_validate_json(value.model_dump_json())
    assert again == value
    assert json.loads(value.model_dump_json())  # plain JSON, no custom encoder needed


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_frozen(value):
    field = next(iter(type(value).model_fields))
    with pytest.raises(ValidationError):
        setattr(value, field, "changed")


def test_match_invariants():
    with pytest.raises(ValidationError, match="request-only"):
        _hit(quality_tier=QualityTier.SEMANTIC)  # semantic reuse must be request-only
    assert _hit(quality_tier=QualityTier.SEMANTIC, cache_policy=CachePolicy.REQUEST_ONLY).is_hit
    with pytest.raises(ValidationError, match="external tokens"):
        _hit(external_prefix_tokens=0)
    with pytest.raises(ValidationError, match="fallback"):
        SemanticKVMatch(request_id="r", fallback_reason=FallbackReason.PROVIDER_MISS,
                        external_prefix_tokens=32)
    assert not SemanticKVMatch.fallback("r", FallbackReason.PROVIDER_MISS).is_hit


def test_candidate_rejects_bad_provider_output():
    for bad in (float("nan"), float("inf"), -0.1, 1.5):
        with pytest.raises(ValidationError):
            Candidate(donor_id="d", namespace="ns", similarity=bad)
    with pytest.raises(ValidationError):
        Candidate(donor_id="d", namespace="ns", similarity=0.5, num_tokens=-1)
    with pytest.raises(ValidationError):
        Candidate(donor_id="", namespace="ns", similarity=0.5)


def test_load_plan_needs_blocks():
    with pytest.raises(ValidationError):
        SemanticLoadPlan(request_id="r", donor_id="d", lease_id="L", local_tokens=0,
                         external_tokens=32, block_ids=((),))
