"""The exact prefix index (``semkv.prefix_index``): the longest run of stored whole blocks from
a prompt's start, whoever stored it, kept in step with donors added and removed."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from semkv.prefix_index import PrefixIndex, block_keys, iter_block_keys

BS = 4


def _longest_by_brute_force(donors: dict[str, list[int]], target: list[int]) -> int:
    """Whole blocks of ``target`` that some donor's own whole blocks start with."""
    best = 0
    for tokens in donors.values():
        n = 0
        while ((n + 1) * BS <= min(len(tokens), len(target))
               and tokens[n * BS : (n + 1) * BS] == target[n * BS : (n + 1) * BS]):
            n += 1
        best = max(best, n)
    return best


def test_keys_are_chained_whole_blocks_of_one_namespace():
    keys = block_keys("ns", list(range(10)), BS)
    assert len(keys) == 2  # the 2 tokens past the last whole block have no key
    assert block_keys("ns", [99, *range(1, 10)], BS)[1] != keys[1]  # block 1 depends on block 0
    assert block_keys("other", list(range(10)), BS)[0] != keys[0]
    assert block_keys("ns", list(range(10)), BS, start_block=1, parent=keys[0]) == keys[1:]
    assert list(iter_block_keys("ns", list(range(10)), BS)) == keys


def test_a_long_new_document_behind_a_stored_system_prompt_finds_it():
    rng = random.Random(0)
    system = [rng.randrange(50_000) for _ in range(40 * BS + 3)]
    index = PrefixIndex()
    index.add("system", block_keys("ns", system, BS))
    target = system[: 40 * BS] + [rng.randrange(50_000) for _ in range(400 * BS)]
    assert index.longest("ns", target, BS) == (40, "system")
    assert index.longest("other-namespace", target, BS) == (0, None)
    assert index.longest("ns", [7] + target[1:], BS) == (0, None)  # first token differs


def test_stored_stops_the_walk_at_the_first_block_whose_kv_is_gone():
    tokens = list(range(10 * BS))
    keys = block_keys("ns", tokens, BS)
    index = PrefixIndex()
    index.add("d", keys)
    gone = {keys[6]}
    assert index.longest("ns", tokens, BS, stored=lambda k: k not in gone) == (6, "d")


def test_removing_a_donor_keeps_the_blocks_another_donor_holds():
    shared = list(range(3 * BS))
    a, b = shared + [1] * (2 * BS), shared + [2] * (5 * BS)
    index = PrefixIndex()
    index.add("a", block_keys("ns", a, BS))
    index.add("b", block_keys("ns", b, BS))
    assert index.longest("ns", a, BS) == (5, "a")
    assert index.longest("ns", shared, BS) == (3, "b")  # the newest holder of a shared block
    index.remove("b", block_keys("ns", b, BS))
    assert index.longest("ns", b, BS) == (3, "a")
    assert len(index) == 5
    index.remove("a", block_keys("ns", a, BS))
    assert len(index) == 0 and index.longest("ns", a, BS) == (0, None)


def test_adding_a_donor_again_makes_it_the_newest_holder():
    tokens = list(range(2 * BS))
    keys = block_keys("ns", tokens, BS)
    index = PrefixIndex()
    for donor in ("a", "b", "a"):
        index.add(donor, keys)
    assert index.holder(keys[0]) == "a"
    index.remove("a", keys)
    assert index.holder(keys[0]) == "b"
    index.clear()
    assert index.holder(keys[0]) is None


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_longest_is_the_longest_whole_block_prefix_any_live_donor_starts_with(data):
    alphabet = st.integers(0, 2)  # few token values: donors share prefixes of every length
    donors = data.draw(st.dictionaries(st.sampled_from("abcdef"),
                                       st.lists(alphabet, max_size=6 * BS), max_size=6))
    removed = data.draw(st.sets(st.sampled_from(sorted(donors) or ["a"])))
    target = data.draw(st.lists(alphabet, max_size=7 * BS))
    index = PrefixIndex()
    for donor_id, tokens in donors.items():
        index.add(donor_id, block_keys("ns", tokens, BS))
    for donor_id in removed & donors.keys():
        index.remove(donor_id, block_keys("ns", donors[donor_id], BS))
    live = {d: t for d, t in donors.items() if d not in removed}
    blocks, donor = index.longest("ns", target, BS)
    assert blocks == _longest_by_brute_force(live, target)
    if blocks:
        assert donor in live
        assert live[donor][: blocks * BS] == target[: blocks * BS]
    else:
        assert donor is None
