import pytest
from hypothesis import given
from hypothesis import strategies as st

from semkv.namespace import ABSENT, Namespace, namespace_gate
from semkv.types import FallbackReason

FIELDS = list(Namespace.model_fields)
INT_FIELDS = {"block_size", "tensor_parallel_size", "pipeline_parallel_size"}


def _base(**over):
    values = {f: (1 if f in INT_FIELDS else f"{f}-value") for f in FIELDS}
    values.update(over)
    return Namespace(**values)


def _other_value(field, value):
    return st.integers(0, 1 << 20).filter(lambda v: v != value) if field in INT_FIELDS else (
        st.text(min_size=0, max_size=40).filter(lambda v: v != value))


@st.composite
def _pair(draw):
    field = draw(st.sampled_from(FIELDS))
    base = _base()
    changed = draw(_other_value(field, getattr(base, field)))
    return field, base, base.model_copy(update={field: changed})


@given(_pair())
def test_any_one_field_difference_separates_namespaces(pair):
    field, a, b = pair
    assert a.digest != b.digest, field
    assert namespace_gate(a, b.digest) is FallbackReason.NAMESPACE_MISMATCH


def test_digest_is_stable_and_order_free():
    a = _base()
    b = Namespace(**dict(reversed(list(a.model_dump().items()))))
    assert a.digest == b.digest
    assert namespace_gate(a, a.digest) is None
    # Stable across processes and releases: a fixed input has a fixed digest.
    assert len(a.digest) == 32 and a.digest == _base().digest


@pytest.mark.parametrize("field", FIELDS)
def test_unknown_field_is_a_miss_even_against_itself(field):
    ns = _base(**{field: None})
    assert not ns.is_complete and ns.unknown_fields == (field,)
    assert namespace_gate(ns, ns.digest) is FallbackReason.NAMESPACE_MISMATCH


def test_requests_of_other_tenants_or_adapters_never_share():
    engine = _base(lora_identity=ABSENT, cache_salt=ABSENT)
    plain = engine.for_request(lora_identity=None, cache_salt=None)
    salted = engine.for_request(lora_identity=None, cache_salt="tenant-a")
    other = engine.for_request(lora_identity=None, cache_salt="tenant-b")
    lora = engine.for_request(lora_identity='{"name":"x"}', cache_salt=None)
    digests = {plain.digest, salted.digest, other.digest, lora.digest}
    assert len(digests) == 4
    assert plain.digest == engine.digest
