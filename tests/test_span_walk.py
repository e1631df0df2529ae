"""The map walk (``semkv.span_map.map_tokens``, ``semkv.span_plan._map_donor``) is the same as
the per-position loops it replaced (issue #25: span planning time), on shapes that exercise
every branch: runs, jumps at differing tokens, the donor's end, resuming after it, repeated
k-grams (first occurrence wins), anchors that run past the target, short and empty donors.

``reference_*`` below are the loops as they were, kept verbatim as the specification.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from semkv.span_map import _walk, gram_keys, map_span, map_tokens
from semkv.span_plan import NO_SOURCE, _map_donor, decide_reuse, plan_span


def reference_map_tokens(target: Sequence[int], donor: Sequence[int], start: int, end: int,
                         *, anchor_tokens: int = 8) -> tuple[list[int], list[bool]]:
    if not donor or end <= start:
        return [], []
    k = max(1, anchor_tokens)
    anchors: dict[tuple[int, ...], int] = {}
    for i in range(len(donor) - k + 1):
        anchors.setdefault(tuple(donor[i: i + k]), i)
    last = len(donor) - 1
    sources: list[int] = []
    same: list[bool] = []
    q = -1
    for p in range(start, end):
        nxt = q + 1 if q >= 0 else min(p, last)
        if nxt > last or donor[nxt] != target[p]:
            jump = anchors.get(tuple(target[p: p + k])) if p + k <= len(target) else None
            if jump is not None:
                nxt = jump
            elif nxt > last:
                break
        q = nxt
        sources.append(q)
        same.append(donor[q] == target[p])
    return sources, same


def reference_map_donor(target: Sequence[int], donor: Sequence[int],
                        k: int) -> tuple[list[int], list[bool]]:
    n = len(target)
    sources, same = reference_map_tokens(target, donor, 0, n, anchor_tokens=k)
    if len(sources) == n or not donor:
        return sources + [NO_SOURCE] * (n - len(sources)), same + [False] * (n - len(same))
    k = max(1, k)
    anchors: dict[tuple[int, ...], int] = {}
    for i in range(len(donor) - k + 1):
        anchors.setdefault(tuple(donor[i: i + k]), i)
    last, q = len(donor) - 1, -1
    for p in range(len(sources), n):
        nxt = q + 1 if q >= 0 else -1
        if not 0 <= nxt <= last or donor[nxt] != target[p]:
            jump = anchors.get(tuple(target[p: p + k])) if p + k <= n else None
            if jump is not None:
                nxt = jump
            elif not 0 <= nxt <= last:
                q = -1
                sources.append(NO_SOURCE)
                same.append(False)
                continue
        q = nxt
        sources.append(q)
        same.append(donor[q] == target[p])
    return sources, same


def as_lists(walked: tuple[Sequence[int], Sequence[bool]]) -> tuple[list[int], list[bool]]:
    """A walk's (sources, same) arrays as the reference's lists."""
    return [int(x) for x in walked[0]], [bool(x) for x in walked[1]]


@st.composite
def target_and_donor(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """A donor, and a target made of its pieces (any order, repeated), other tokens and noise;
    a small vocabulary so that tokens and k-grams repeat by chance too."""
    vocab = draw(st.sampled_from([3, 8, 50_000]))
    tokens = st.integers(min_value=0, max_value=vocab)
    donor = draw(st.lists(tokens, max_size=300))
    target: list[int] = []
    for _ in range(draw(st.integers(min_value=0, max_value=8))):
        if donor and draw(st.booleans()):
            a = draw(st.integers(min_value=0, max_value=len(donor) - 1))
            b = draw(st.integers(min_value=a, max_value=len(donor)))
            piece = donor[a:b]
            if piece and draw(st.booleans()):  # one token changed inside the piece
                piece[draw(st.integers(min_value=0, max_value=len(piece) - 1))] = vocab + 1
            target += piece
        else:
            target += draw(st.lists(tokens, max_size=80))
    return target, donor


@settings(max_examples=400, deadline=None)
@given(target_and_donor(), st.sampled_from([1, 2, 3, 8]), st.data())
def test_map_tokens_is_the_per_position_walk(pair: tuple[list[int], list[int]], k: int,
                                             data: st.DataObject) -> None:
    target, donor = pair
    start = data.draw(st.integers(min_value=0, max_value=len(target)))
    end = data.draw(st.integers(min_value=start, max_value=len(target)))
    want = reference_map_tokens(target, donor, start, end, anchor_tokens=k)
    assert map_tokens(target, donor, start, end, anchor_tokens=k) == want
    # the token containers the engine passes: vLLM's ConstantList (a Sequence), array('q')
    assert map_tokens(tuple(target), array("q", donor), start, end, anchor_tokens=k) == want


@settings(max_examples=400, deadline=None)
@given(target_and_donor(), st.sampled_from([1, 2, 3, 8]))
def test_the_continued_map_is_the_per_position_walk(pair: tuple[list[int], list[int]],
                                                    k: int) -> None:
    target, donor = pair
    want = reference_map_donor(target, donor, k)
    assert as_lists(_map_donor(target, donor, k, gram_keys(target, 0, len(target), k))) == want
    assert as_lists(_map_donor(target, array("q", donor), k,
                               gram_keys(target, 0, len(target), k))) == want


def test_long_runs_cross_every_window_and_jumps_land_inside_them() -> None:
    rng = random.Random(7)
    doc = [rng.randrange(50_000) for _ in range(5000)]
    # chunks out of order, a changed token every 700, a passage past the donor's end
    target = doc[3000:4200] + doc[:1500] + [1] + doc[1501:2900] + doc[4990:] + doc[100:900]
    for i in range(0, len(target), 700):
        target[i] = 2
    for donor in (doc, doc[:2000], doc[2500:]):
        assert map_tokens(target, donor, 0, len(target)) == \
            reference_map_tokens(target, donor, 0, len(target))
        assert as_lists(_map_donor(target, donor, 8, gram_keys(target, 0, len(target), 8))) \
            == reference_map_donor(target, donor, 8)


class Constant(Sequence[int]):
    """A read-only Sequence like vLLM's ConstantList (``Request.all_token_ids``)."""

    def __init__(self, x: list[int]) -> None:
        self._x = x

    def __getitem__(self, i):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN204
        return self._x[i]

    def __len__(self) -> int:
        return len(self._x)


def test_a_read_only_sequence_target_plans_as_a_list() -> None:
    rng = random.Random(3)
    doc = [rng.randrange(50_000) for _ in range(900)]
    target = [5, 6, 7] + doc[400:] + doc[:400] + [9]
    donors = {"a": array("q", doc[:512]), "b": doc[448:]}
    assert decide_reuse(Constant(target), donors) == decide_reuse(target, donors)
    assert plan_span(Constant(target), donors, local_tokens=0, block_size=32) == \
        plan_span(target, donors, local_tokens=0, block_size=32)
    assert map_span(Constant(target), doc, 0, 32, max_tokens=800) == \
        map_span(target, doc, 0, 32, max_tokens=800)


def test_a_key_collision_is_never_taken_as_an_anchor() -> None:
    """Anchors are keyed by the k-gram's hash; a key that names another donor k-gram (a
    collision) is checked where the walk would jump and dropped: the walk is the one without
    it, on a diagonal and after the donor's end alike."""
    rng = random.Random(11)
    doc = [rng.randrange(50_000) for _ in range(600)]
    target = doc[300:] + [3, 4, 5] + doc[:300]
    donors = (doc, doc[:200])
    for donor in donors:
        k = 8
        keys = gram_keys(target, 0, len(target), k)
        index = {key: p for p, key in reversed(list(enumerate(gram_keys(donor, 0, len(donor),
                                                                        k))))}
        true_hits = [index.get(key) for key in keys] + [None] * (len(target) - len(keys))
        for resume in (None, NO_SOURCE):
            want = as_lists(_walk(target, donor, 0, len(target), list(true_hits), resume, k))
            forged = list(true_hits)
            for p in range(0, len(forged), 7):  # positions whose tokens differ from the donor's
                if forged[p] is None:
                    forged[p] = 17  # a donor position whose k tokens are not the target's
            assert any(h != t for h, t in zip(forged, true_hits, strict=True))
            assert as_lists(_walk(target, donor, 0, len(target), forged, resume, k)) == want


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32), st.integers(23, 120), st.integers(0, 300))
def test_every_shared_run_of_23_tokens_is_found_by_the_sampled_anchors(
        seed: int, length: int, offset: int) -> None:
    from semkv.span_map import TargetGrams, anchor_index

    rng = random.Random(seed)
    doc = [rng.randrange(1000, 50_000) for _ in range(400)]
    start = rng.randrange(0, len(doc) - length)
    target = [rng.randrange(1000, 50_000) for _ in range(offset)] + doc[start:start + length] \
        + [rng.randrange(1000, 50_000) for _ in range(50)]
    grams = TargetGrams.of(target, 8)
    assert grams.sampled_held(anchor_index(doc, 8)).any()
    stranger = [rng.randrange(50_000, 90_000) for _ in range(400)]
    assert not grams.sampled_held(anchor_index(stranger, 8)).any()


def test_skipping_donors_without_a_sampled_anchor_keeps_every_long_run(monkeypatch) -> None:
    """decide_reuse with the prefilter is decide_reuse mapping every donor, whenever the
    skipped donors share no run of 23+ tokens (here: strangers and a 12-token coincidence)."""
    import semkv.span_plan as span_plan

    rng = random.Random(5)
    doc = [rng.randrange(1000, 50_000) for _ in range(900)]
    other = [rng.randrange(1000, 50_000) for _ in range(500)]
    target = doc[600:] + doc[:400] + other[100:112] + [7, 8] + doc[400:600] + [9]
    donors: dict[str, Sequence[int]] = {
        "a": doc[:500], "b": array("q", doc[450:]), "c": other,
        **{f"s{i}": [rng.randrange(50_000, 90_000) for _ in range(700)] for i in range(12)}}
    filtered = decide_reuse(target, donors)
    monkeypatch.setattr(span_plan, "_brings_new_anchor", lambda *a: True)
    assert decide_reuse(target, donors) == filtered
    assert plan_span(target, donors, local_tokens=0, block_size=32) is not None


def test_donors_that_bring_only_the_template_again_are_not_walked(monkeypatch) -> None:
    """16 candidates share a 96-token prompt template with the target; three also share a
    passage each. Only the first template holder and the passage donors are walked, and the
    decision is the one that walks every candidate."""
    import semkv.span_plan as span_plan

    rng = random.Random(9)
    words = lambda n: [rng.randrange(1000, 50_000) for _ in range(n)]  # noqa: E731
    template, passages = words(96), [words(300) for _ in range(3)]
    donors: dict[str, Sequence[int]] = {f"t{i}": template + words(600) for i in range(6)}
    donors |= {f"p{i}": array("q", template + p + words(40)) for i, p in enumerate(passages)}
    donors |= {f"u{i}": template + words(600) for i in range(7)}
    target = template + passages[2] + words(5) + passages[0] + passages[1] + words(30)
    walked: list[int] = []
    real = span_plan._map_donor
    monkeypatch.setattr(span_plan, "_map_donor", lambda *a, **k: walked.append(1) or real(*a, **k))
    decided = decide_reuse(target, donors)
    assert len(walked) == 4  # t0 (the template), p0, p1, p2
    monkeypatch.setattr(span_plan, "_brings_new_anchor", lambda *a: True)
    assert decide_reuse(target, donors) == decided
    assert len(walked) == 4 + len(donors)
    assert {r.donor_id for r in decided.runs} >= {"p0", "p1", "p2"}


def reference_best_donor_per_chunk(n: int, maps: list[tuple[list[int], list[bool]]],
                                   chunk: int) -> tuple[list[int], list[int], list[bool]]:
    donor, positions, identical = [-1] * n, [NO_SOURCE] * n, [False] * n
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        counts = [sum(same[lo:hi]) for _, same in maps]
        if not counts:
            continue
        best = counts.index(max(counts))  # ties: the first donor given
        for p in range(lo, hi):
            q = maps[best][0][p]
            if q != NO_SOURCE:
                donor[p], positions[p], identical[p] = best, q, maps[best][1][p]
    return donor, positions, identical


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 200), st.integers(0, 5), st.sampled_from([1, 3, 16, 64]), st.data())
def test_best_donor_per_chunk_is_the_per_chunk_loop(n: int, donors: int, chunk: int,
                                                    data: st.DataObject) -> None:
    import numpy as np

    from semkv.span_plan import _best_donor_per_chunk

    maps = []
    for _ in range(donors):
        sources = data.draw(st.lists(st.sampled_from([NO_SOURCE, 0, 5, 9]), min_size=n,
                                     max_size=n))
        same = [q != NO_SOURCE and data.draw(st.booleans()) for q in sources]
        maps.append((sources, same))
    got = _best_donor_per_chunk(n, [(np.array(s, np.int64), np.array(f, np.bool_))
                                    for s, f in maps], chunk)
    assert tuple(x.tolist() for x in got) == reference_best_donor_per_chunk(n, maps, chunk)
