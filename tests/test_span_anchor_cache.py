"""The anchor cache: never serves a stale index, stays within its byte bound."""

from __future__ import annotations

from array import array

from hypothesis import given
from hypothesis import strategies as st

from semkv.anchor_cache import AnchorCache, AnchorIndex
from semkv.span_map import build_anchor_index, gram_keys

tokens = st.lists(st.integers(0, 5), min_size=0, max_size=60)


@given(tokens, tokens, st.integers(1, 4))
def test_cached_index_equals_a_fresh_build(a: list[int], b: list[int], k: int) -> None:
    cache = AnchorCache()
    for donor in (a, b, a, array("q", b)):
        assert cache.get(donor, k, build_anchor_index) == build_anchor_index(donor, k)


def holds(index: AnchorIndex, gram: list[int]) -> bool:
    """Does ``index`` know the k-gram ``gram`` (k = its length)?"""
    return bool(index.lookup(gram_keys(gram, 0, len(gram), len(gram)))[0] >= 0)


def test_changed_tokens_miss_the_cache() -> None:
    cache = AnchorCache()
    donor = [1, 2, 3, 4, 5, 6]
    first = cache.get(donor, 2, build_anchor_index)
    donor[0] = 9  # the same object, other tokens: the old index must not come back
    second = cache.get(donor, 2, build_anchor_index)
    assert holds(second, [9, 2]) and not holds(second, [1, 2])
    assert holds(first, [1, 2])
    assert cache.misses == 2 and cache.hits == 0
    cache.get([1, 2, 3, 4, 5, 6], 2, build_anchor_index)
    assert cache.hits == 1


def test_a_remembered_array_changed_in_place_misses_the_cache() -> None:
    """An array('q') donor is remembered by identity (its key bytes reused); changing its
    tokens in place must still miss, and a dead object's id reused by another must too."""
    cache = AnchorCache()
    donor = array("q", [1, 2, 3, 4, 5, 6])
    first = cache.get(donor, 2, build_anchor_index)
    assert cache.get(donor, 2, build_anchor_index) is first and cache.hits == 1
    donor[0] = 9
    second = cache.get(donor, 2, build_anchor_index)
    assert second is not first and holds(second, [9, 2]) and not holds(second, [1, 2])
    assert cache.get(array("q", [1, 2, 3, 4, 5, 6]), 2, build_anchor_index) is first
    del donor
    for _ in range(50):  # new objects, some at a freed id: each answers for its own tokens
        other = array("q", [7, 7, 8, 8, 7])
        assert holds(cache.get(other, 2, build_anchor_index), [8, 7])


def test_an_index_built_for_one_namespace_never_serves_another() -> None:
    """A hit is faster than a build: a donor index one tenant's planning built must not speed
    up another tenant's planning against a donor of the same tokens (a timing signal)."""
    cache = AnchorCache()
    donor = list(range(100, 160))
    mine = cache.get(donor, 4, build_anchor_index, "tenant-a")
    assert cache.get(list(donor), 4, build_anchor_index, "tenant-a") is mine
    theirs = cache.get(list(donor), 4, build_anchor_index, "tenant-b")
    assert theirs is not mine and theirs == mine
    assert (cache.hits, cache.misses) == (1, 2)


def test_span_planning_keys_the_shared_cache_by_the_donors_namespace() -> None:
    from semkv.span_map import ANCHOR_CACHE
    from semkv.span_plan import plan_span

    donor = list(range(1000, 1400))
    target = list(range(7, 39)) + donor
    before = ANCHOR_CACHE.misses
    for ns in ("tenant-a", "tenant-a", "tenant-b"):
        plan = plan_span(target, {"d": donor}, local_tokens=0, block_size=16, namespace=ns)
        assert plan is not None and plan.copied_tokens > 0
    assert ANCHOR_CACHE.misses - before == 2  # tenant-a built it once; tenant-b again


def test_lru_eviction_keeps_the_byte_bound() -> None:
    cache = AnchorCache(max_bytes=40_000)  # ~8.4 KB an entry (the sketch): eviction must happen
    donors = [list(range(i, i + 10)) for i in range(20)]
    for d in donors:
        assert cache.get(d, 2, build_anchor_index) == build_anchor_index(d, 2)
        assert cache.nbytes <= cache.max_bytes
    assert 0 < len(cache) < len(donors)
    cache.get(donors[0], 2, build_anchor_index)  # evicted long ago: rebuilt
    assert cache.misses == len(donors) + 1


@given(st.lists(st.integers(0, 50_000), min_size=8, max_size=400), st.integers(1, 8))
def test_the_sketch_never_hides_a_key_and_the_sketched_lookup_is_the_plain_one(
        donor: list[int], k: int) -> None:
    import numpy as np

    from semkv.anchor_cache import SketchSlots

    index = build_anchor_index(donor, k)
    keys = gram_keys(donor, 0, len(donor), k)
    assert index.may_hold(keys).all()
    assert index.may_hold(keys, SketchSlots.of(keys)).all()
    target = gram_keys(donor[::-1] + donor + list(range(60_000, 60_050)),
                       0, 10**6, k)
    plain = index.lookup(target)
    assert (plain == -1).any() and (plain >= 0).any()  # both outcomes are exercised
    assert np.array_equal(index.find(target), plain)
    assert np.array_equal(index.find(target, SketchSlots.of(target)), plain)
