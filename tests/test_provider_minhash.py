"""The ``minhash`` provider with real datasketch: what it finds, misses, forgets and isolates."""

from __future__ import annotations

import random
import sys

import pytest

pytest.importorskip("datasketch")

from semkv_minhash import MinHashProvider  # noqa: E402
from semkv_minhash.lsh import CompactLSH, DatasketchLSH  # noqa: E402
from semkv_minhash.sketch import ShingleSketcher  # noqa: E402

from semkv.provider import DonorRecord, LookupQuery, ProviderContext  # noqa: E402
from semkv.testing import SyntheticCorpus  # noqa: E402

NS = "ns-a"


def _provider(**config: object) -> MinHashProvider:
    built = MinHashProvider.from_config(config, ProviderContext(block_size=16))
    assert isinstance(built, MinHashProvider)
    return built


def _register(p: MinHashProvider, donor_id: str, tokens: tuple[int, ...], ns: str = NS) -> None:
    p.register_donor(DonorRecord(donor_id=donor_id, namespace=ns, token_ids=tokens))


def _lookup(p: MinHashProvider, tokens: tuple[int, ...], ns: str = NS, k: int = 5) -> dict:
    found = p.lookup(LookupQuery(request_id="r", namespace=ns, token_ids=tokens, max_candidates=k))
    return {c.donor_id: c for c in found}


@pytest.fixture
def corpus() -> SyntheticCorpus:
    return SyntheticCorpus(seed=7)


def test_signature_is_bit_identical_to_datasketch(corpus: SyntheticCorpus) -> None:
    from datasketch import MinHash

    sketcher = ShingleSketcher(num_perm=64, shingle_tokens=5, seed=3)
    hashes = sketcher.shingles(corpus.document(300))
    assert len(hashes) == 296  # random tokens: every shingle distinct
    reference = MinHash(num_perm=64, seed=3, hashfunc=int)
    reference.update_batch([int(h) for h in hashes])
    assert (sketcher.signature(hashes) == reference.hashvalues).all()


def test_near_duplicate_found_with_high_jaccard_unrelated_not(corpus: SyntheticCorpus) -> None:
    doc, unrelated = corpus.document(512), corpus.document(512)
    near = corpus.document(51) + doc[51:]  # a new 10% lead-in (another instruction)
    p = _provider()
    try:
        _register(p, "doc", doc)
        _register(p, "unrelated", unrelated)
        found = _lookup(p, near)
        assert list(found)[0] == "doc" and "unrelated" not in found
        assert found["doc"].similarity > 0.7
        assert found["doc"].num_tokens == 0  # spans are left to the verifier
    finally:
        p.close()


def test_scattered_edits_rank_by_overlap(corpus: SyntheticCorpus) -> None:
    rng = random.Random(0)
    doc = corpus.document(600)

    def edited(fraction: float) -> tuple[int, ...]:
        tokens = list(doc)
        for i in rng.sample(range(len(tokens)), int(fraction * len(tokens))):
            tokens[i] = rng.randrange(4096)
        return tuple(tokens)

    p = _provider(shingle_tokens=4)
    try:
        _register(p, "light", edited(0.05))
        _register(p, "heavy", edited(0.20))
        _register(p, "other", corpus.document(600))
        found = _lookup(p, doc)
        assert list(found)[:2] == ["light", "heavy"]
        assert found["light"].similarity > found["heavy"].similarity
        assert "other" not in found
    finally:
        p.close()


def test_prefix_of_a_donor_is_found_with_full_coverage(corpus: SyntheticCorpus) -> None:
    doc = corpus.document(400)
    p = _provider()
    try:
        _register(p, "long", doc)
        found = _lookup(p, doc[:200])  # Jaccard about 1/2, the target fully inside the donor
        assert "long" in found
        assert 0.3 < found["long"].similarity < 0.75
        assert found["long"].signals["target_coverage"] > 0.8
    finally:
        p.close()


@pytest.mark.parametrize("lsh", ["compact", "datasketch"])
def test_eviction_reset_and_namespace_tables(corpus: SyntheticCorpus, lsh: str) -> None:
    doc, other = corpus.document(256), corpus.document(256)
    p = _provider(lsh=lsh)
    try:
        _register(p, "a", doc, "ns-a")
        _register(p, "b", doc, "ns-b")
        _register(p, "c", other, "ns-a")
        assert set(_lookup(p, doc, "ns-a")) == {"a"}
        assert set(_lookup(p, doc, "ns-b")) == {"b"}
        assert _lookup(p, doc, "ns-c") == {}
        p.evict("b")
        assert _lookup(p, doc, "ns-b") == {}
        assert p.stats()["namespaces"] == 1.0  # an emptied namespace leaves no table behind
        _register(p, "a", other, "ns-a")  # re-registration replaces the old signature
        assert set(_lookup(p, doc, "ns-a")) == set()
        assert set(_lookup(p, other, "ns-a")) == {"a", "c"}
        p.reset()
        assert _lookup(p, other, "ns-a") == {} and p.stats()["donors"] == 0.0
    finally:
        p.close()


def test_compact_tables_give_datasketch_candidates(corpus: SyntheticCorpus) -> None:
    rng = random.Random(1)
    sketcher = ShingleSketcher(num_perm=128, shingle_tokens=4, seed=1)
    base = corpus.documents(20, 200)
    docs = [tuple(rng.randrange(4096) if rng.random() < 0.1 else t for t in base[i % 20])
            for i in range(200)]  # families of overlapping documents: many shared buckets
    sigs = [sketcher.signature(sketcher.shingles(d)) for d in docs]
    compact, reference = CompactLSH((64, 2)), DatasketchLSH((64, 2), sketcher)
    for index in (compact, reference):
        for i, sig in enumerate(sigs):
            index.insert(f"d{i}", sig)
        for i in range(0, 200, 3):
            index.remove(f"d{i}", sigs[i])
    answers = [(compact.query(s), reference.query(s)) for s in sigs[:40]]
    assert all(a == b for a, b in answers)
    assert sum(len(a) for a, _ in answers) > 100  # the comparison saw real candidate sets


def test_donors_leave_nothing_for_the_gc_to_walk(corpus: SyntheticCorpus) -> None:
    import gc

    p = _provider()
    try:
        gc.collect()
        before = len(gc.get_objects())
        for i in range(2000):
            _register(p, f"d{i}", corpus.document(64))
        gc.collect()
        assert (len(gc.get_objects()) - before) / 2000 < 1.0  # datasketch storage: about 40
    finally:
        p.close()


def test_short_prompts_and_empty_donors(corpus: SyntheticCorpus) -> None:
    p = _provider()
    try:
        _register(p, "tiny", (5, 6, 7))  # shorter than one shingle: one shingle of all of it
        _register(p, "empty", ())
        assert set(_lookup(p, (5, 6, 7))) == {"tiny"}
        assert _lookup(p, (5, 6, 8)) == {}
        assert p.stats()["donors"] == 1.0
    finally:
        p.close()


def test_missing_datasketch_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasketch", None)
    with pytest.raises(ImportError, match="semkv-minhash"):
        _provider()


def test_bad_config_is_rejected() -> None:
    from pydantic import ValidationError

    bads = ({"threshold": 1.5}, {"num_perm": 4}, {"shingle_tokens": 0}, {"seed": -1}, {"lsh": "x"})
    for bad in bads:
        with pytest.raises(ValidationError):
            _provider(**bad)
