"""The ``embedding`` provider with the real bundled MiniLM and real faiss-cpu."""

from __future__ import annotations

import logging
import sys
import time

import pytest

pytest.importorskip("faiss")
pytest.importorskip("sentence_transformers")

from semkv_embedding import EmbeddingProvider  # noqa: E402
from semkv_embedding.encoder import split_windows  # noqa: E402
from semkv_embedding.index import NamespaceIndex  # noqa: E402

from semkv.provider import DonorRecord, LookupQuery, ProviderContext  # noqa: E402
from semkv.testing import synthetic_detokenize  # noqa: E402

NS = "ns-a"
EIFFEL = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built it for "
    "the 1889 World's Fair."
)
EIFFEL_PARAPHRASE = (
    "Gustave Eiffel's company designed and constructed the iron lattice tower that stands on "
    "the Champ de Mars in Paris; it was built for the World's Fair of 1889 and carries his name."
)
BREAD = (
    "To bake a simple loaf of bread, mix flour, water, yeast and salt, knead the dough for ten "
    "minutes, let it rise for an hour, shape it and bake it at 220 degrees until golden."
)
PYTHON = (
    "Python's list comprehensions build a new list by applying an expression to every item of "
    "an iterable, optionally filtered by a condition, in a single readable line of code."
)


def _provider(detokenize=synthetic_detokenize, **config: object) -> EmbeddingProvider:
    built = EmbeddingProvider.from_config(
        config, ProviderContext(block_size=16, detokenize=detokenize)
    )
    assert isinstance(built, EmbeddingProvider)
    return built


@pytest.fixture
def provider():
    built = _provider()
    yield built
    built.close()


def _register(p: EmbeddingProvider, donor_id: str, text: str | None, ns: str = NS,
              tokens: tuple[int, ...] = (1, 2, 3)) -> None:
    p.register_donor(DonorRecord(donor_id=donor_id, namespace=ns, token_ids=tokens, text=text))


def _lookup(p: EmbeddingProvider, text: str | None, ns: str = NS,
            tokens: tuple[int, ...] = (1, 2, 3)) -> dict:
    found = p.lookup(LookupQuery(request_id="r", namespace=ns, token_ids=tokens, text=text))
    return {c.donor_id: c for c in found}


def test_paraphrase_ranks_above_unrelated(provider: EmbeddingProvider) -> None:
    for donor_id, text in (("eiffel", EIFFEL), ("bread", BREAD), ("python", PYTHON)):
        _register(provider, donor_id, text)
    provider.flush()
    found = _lookup(provider, EIFFEL_PARAPHRASE)
    assert list(found)[0] == "eiffel"
    assert found["eiffel"].similarity > 0.7
    assert max(found["bread"].similarity, found["python"].similarity) < 0.3
    assert found["eiffel"].num_tokens == 0  # spans are left to the verifier
    wrapped = "You are a helpful assistant. Summarize the passage below.\n\n" + EIFFEL
    assert list(_lookup(provider, wrapped))[0] == "eiffel"


def test_min_similarity_filters(provider: EmbeddingProvider) -> None:
    strict = _provider(min_similarity=0.6)
    try:
        for p in (provider, strict):
            _register(p, "eiffel", EIFFEL)
            _register(p, "bread", BREAD)
            p.flush()
        assert set(_lookup(provider, EIFFEL_PARAPHRASE)) == {"eiffel", "bread"}
        assert set(_lookup(strict, EIFFEL_PARAPHRASE)) == {"eiffel"}
    finally:
        strict.close()


def test_text_is_detokenized_when_not_carried() -> None:
    tokens = tuple(range(100, 180))
    p = _provider()
    try:
        _register(p, "by-text", synthetic_detokenize(tokens), tokens=tokens)
        _register(p, "by-tokens", None, tokens=tokens)  # detokenized in the background thread
        p.flush()
        found = _lookup(p, None, tokens=tokens)
        assert set(found) == {"by-tokens", "by-text"}
        assert all(c.similarity > 0.999 for c in found.values())
    finally:
        p.close()


def test_no_text_no_detokenizer_is_a_counted_miss_and_no_text_is_logged(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    def leaky(token_ids: object) -> str:
        raise RuntimeError("SECRET-PROMPT-TEXT could not be decoded")

    p = _provider(detokenize=leaky)
    try:
        with caplog.at_level(logging.DEBUG):
            _register(p, "d", None)
            p.flush()
        assert p.stats()["index_errors"] == 1.0 and p.stats()["donors"] == 0.0
        captured = capsys.readouterr()
        assert "SECRET" not in caplog.text + captured.out + captured.err
    finally:
        p.close()
    bare = _provider(detokenize=None)
    try:
        _register(bare, "d", EIFFEL)
        bare.flush()
        assert _lookup(bare, None) == {}
        assert bare.stats()["missing_text"] == 1.0
    finally:
        bare.close()


def test_eviction_pending_and_indexed(provider: EmbeddingProvider) -> None:
    _register(provider, "eiffel", EIFFEL)
    _register(provider, "bread", BREAD)
    provider.evict("bread")  # most likely still queued or being embedded
    provider.flush()
    assert "bread" not in _lookup(provider, BREAD)
    provider.evict("eiffel")
    assert _lookup(provider, EIFFEL) == {}
    assert provider.stats()["namespaces"] == 0.0  # the emptied namespace's index is gone
    _register(provider, "x", EIFFEL)
    _register(provider, "x", BREAD)  # replaces, even while the first is in flight
    provider.flush()
    assert _lookup(provider, BREAD)["x"].similarity > 0.99
    assert provider.stats()["donors"] == 1.0


def test_namespace_isolation(provider: EmbeddingProvider) -> None:
    _register(provider, "a", EIFFEL, ns="ns-a")
    _register(provider, "b", EIFFEL, ns="ns-b")
    provider.flush()
    assert set(_lookup(provider, EIFFEL, ns="ns-a")) == {"a"}
    assert set(_lookup(provider, EIFFEL, ns="ns-b")) == {"b"}
    assert _lookup(provider, EIFFEL, ns="ns-c") == {}


def test_only_the_bounded_window_is_embedded() -> None:
    p = _provider(max_text_chars=len(EIFFEL))
    try:
        _register(p, "long", EIFFEL + " " + BREAD)
        p.flush()
        assert _lookup(p, EIFFEL)["long"].similarity > 0.999  # the tail was never read
    finally:
        p.close()
    windows = split_windows(("word " * 500).strip(), max_text_chars=1500, chunk_chars=500)
    assert len(windows) == 3 and all(len(w) <= 500 for w in windows)
    assert all(not w.startswith("ord") for w in windows)  # cut at whitespace, not in words


def test_vectors_do_not_depend_on_batching() -> None:
    provider = _provider(vector_cache_entries=0)  # every call runs the model
    try:
        texts = [EIFFEL, BREAD, PYTHON, "short one", EIFFEL_PARAPHRASE]
        together = provider._encoder.encode(texts, [NS] * len(texts))
        alone = [provider._encoder.encode([t], [NS])[0] for t in texts]
        assert together is not None
        assert all((together[i] == alone[i]).all() for i in range(len(texts)))
    finally:
        provider.close()


def test_busy_model_is_a_miss_within_budget_unless_the_text_was_embedded_before() -> None:
    p = _provider(lookup_budget_ms=50)
    try:
        _register(p, "eiffel", EIFFEL)
        p.flush()
        with p._encoder.lock:  # the model is busy (e.g. a long background batch)
            start = time.monotonic()
            assert _lookup(p, EIFFEL_PARAPHRASE) == {}
            assert time.monotonic() - start < 1.0
            # the donor's own window was kept when it was indexed: no model call needed
            assert _lookup(p, EIFFEL)["eiffel"].similarity > 0.999
        assert p.stats()["lookups_over_budget"] == 1.0
        assert "eiffel" in _lookup(p, EIFFEL_PARAPHRASE)
    finally:
        p.close()


def _counting_model_calls(p: EmbeddingProvider, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    model = p._encoder.model
    real = model.encode

    def counted(windows: list[str], **kw: object) -> object:
        calls.append(len(windows))
        return real(windows, **kw)

    monkeypatch.setattr(model, "encode", counted)
    return calls


def test_a_window_embedded_before_is_not_embedded_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chat's next turn re-sends the same head: its lookup runs no model call, and the
    cached vector is the bits a fresh forward gives."""
    p = _provider()
    fresh = _provider(vector_cache_entries=0)
    try:
        _register(p, "bread", BREAD)
        p.flush()
        calls = _counting_model_calls(p, monkeypatch)
        first = p._encoder.encode([EIFFEL_PARAPHRASE], [NS])
        assert calls == [1]
        again = p._encoder.encode([EIFFEL_PARAPHRASE], [NS])
        assert calls == [1] and p.stats()["cached_vectors"] == 2.0  # BREAD's and this one
        assert first is not None and again is not None and (first == again).all()
        recomputed = fresh._encoder.encode([EIFFEL_PARAPHRASE], [NS])
        assert calls == [1, 1]  # fresh shares the model and keeps nothing
        assert recomputed is not None and (recomputed == first).all()
        assert "bread" in _lookup(p, BREAD) and calls == [1, 1]  # the donor's own window
    finally:
        p.close()
        fresh.close()


def test_a_window_cached_in_one_namespace_costs_a_full_embedding_in_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two tenants (two ``cache_salt``s: two namespaces) on one engine: a text one tenant's
    donor or lookup embedded is embedded again for the other, so the other's lookup takes the
    model's time whether or not the text was sent before (no timing channel across salts)."""
    p = _provider()
    try:
        for ns in (NS, "ns-b"):
            _register(p, "bread-" + ns, BREAD, ns=ns)  # each namespace has an index to search
        p.flush()
        calls = _counting_model_calls(p, monkeypatch)
        _register(p, "eiffel", EIFFEL)  # tenant A's donor: its windows cached under A
        p.flush()
        assert calls == [1]
        assert "eiffel" in _lookup(p, EIFFEL) and calls == [1]  # A: from the cache
        assert _lookup(p, EIFFEL, ns="ns-b").keys() == {"bread-ns-b"}
        assert calls == [1, 1]  # B: the model ran again
        _lookup(p, EIFFEL, ns="ns-b")
        assert calls == [1, 1]  # B's own window is B's to reuse
    finally:
        p.close()


def test_the_vector_cache_is_a_bounded_lru() -> None:
    import numpy as np
    from semkv_embedding.encoder import VectorCache

    cache = VectorCache(2)
    rows = {name: np.full(3, i, dtype=np.float32) for i, name in enumerate("abc")}
    cache.put(cache.key(NS, "a"), rows["a"])
    cache.put(cache.key(NS, "b"), rows["b"])
    assert cache.get(cache.key(NS, "a")) is rows["a"]  # a is now the most recent
    cache.put(cache.key(NS, "c"), rows["c"])
    assert len(cache) == 2 and cache.get(cache.key(NS, "b")) is None  # b was the oldest
    assert cache.get(cache.key(NS, "a")) is rows["a"]
    assert cache.get(cache.key(NS, "c")) is rows["c"]
    assert cache.get(cache.key("ns-b", "a")) is None  # another namespace's: not shared
    assert cache.key("a", "bc") != cache.key("ab", "c")
    off = VectorCache(0)
    off.put(off.key(NS, "a"), rows["a"])
    assert len(off) == 0
    assert len(cache.key(NS, "x" * 10_000)) == 16  # a digest is kept, never the window's text


def test_the_lookup_budget_is_the_host_s_unless_set_and_a_slow_window_is_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    host = ProviderContext(block_size=16, detokenize=synthetic_detokenize,
                           lookup_timeout_ms=0.5)
    with caplog.at_level(logging.WARNING):
        p = EmbeddingProvider.from_config(None, host)
    own = EmbeddingProvider.from_config({"lookup_budget_ms": 80}, host)
    bare = _provider()
    try:
        assert p._budget_s == pytest.approx(0.0005)  # the host's: it stops waiting then
        assert own._budget_s == pytest.approx(0.080) and bare._budget_s == pytest.approx(0.25)
        assert p.window_ms > 0.5 and p.stats()["window_ms"] == p.window_ms
        assert "embedding_lookup_over_budget" in caplog.text
        assert "raise lookup_timeout_ms, or lower max_text_chars" in caplog.text
        assert EmbeddingProvider.capabilities.lookup_ms == 100.0
    finally:
        for built in (p, own, bare):
            built.close()


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_index_tombstones_and_compaction(kind: str) -> None:
    import faiss
    import numpy as np

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((1000, 32)).astype(np.float32)
    faiss.normalize_L2(vectors)
    index = NamespaceIndex(faiss, 32, kind, ef_search=64, use_gpu=False)
    index.add(np.arange(1000, dtype=np.int64), vectors)
    for i in range(300):
        index.remove(i)
    assert [i for i, _ in index.search(vectors[5], 3)][0] != 5
    assert index.search(vectors[700], 1)[0][0] == 700
    assert index.needs_compaction()
    index.compact()
    assert index.index.ntotal == 700 and not index.tombstones
    assert index.search(vectors[700], 1)[0][0] == 700
    assert all(i >= 300 for i, _ in index.search(vectors[5], 10))
    index.rebuild_as("hnsw" if kind == "flat" else "flat")
    assert index.search(vectors[900], 1)[0][0] == 900 and len(index) == 700


def test_hnsw_provider_end_to_end() -> None:
    p = _provider(index="hnsw")
    try:
        for donor_id, text in (("eiffel", EIFFEL), ("bread", BREAD), ("python", PYTHON)):
            _register(p, donor_id, text)
        p.flush()
        assert list(_lookup(p, EIFFEL_PARAPHRASE))[0] == "eiffel"
        p.evict("eiffel")
        assert "eiffel" not in _lookup(p, EIFFEL)
    finally:
        p.close()


def test_close_stops_the_thread_and_missing_faiss_names_the_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    p = _provider()
    p.close()
    p.close()
    assert not p._thread.is_alive()
    p.register_donor(DonorRecord(donor_id="late", namespace=NS, token_ids=(1,), text=EIFFEL))
    assert _lookup(p, EIFFEL) == {}
    monkeypatch.setitem(sys.modules, "faiss", None)
    with pytest.raises(ImportError, match="semkv-embedding"):
        _provider()


def test_auto_index_grows_into_hnsw_and_still_finds_donors() -> None:
    """The default index is exact (flat) while small and HNSW past hnsw_min_donors."""
    from semkv.provider import DonorRecord, LookupQuery
    from semkv.testing import SyntheticCorpus

    assert EmbeddingProvider.Config().index == "auto"
    p = _provider(hnsw_min_donors=6)
    try:
        docs = SyntheticCorpus(seed=5).documents(8, 64)
        for i, d in enumerate(docs[:5]):
            p.register_donor(DonorRecord(donor_id=f"d{i}", namespace="ns", token_ids=d))
        p.flush()
        assert p._spaces["ns"].kind == "flat"
        for i, d in enumerate(docs[5:], start=5):
            p.register_donor(DonorRecord(donor_id=f"d{i}", namespace="ns", token_ids=d))
        p.flush()
        assert p._spaces["ns"].kind == "hnsw"
        found = p.lookup(LookupQuery(request_id="q", namespace="ns", token_ids=docs[2]))
        assert found and found[0].donor_id == "d2"
    finally:
        p.close()
