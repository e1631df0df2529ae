"""The provider contract: what every semkv provider must do, as a reusable pytest suite.

Subclasses supply a ``make_provider`` fixture returning a zero-argument callable that builds a
fresh provider. Each test closes what it builds.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator

import pytest
from pydantic import ValidationError

from semkv.provider import DonorProvider, DonorRecord, LookupQuery
from semkv.testing.synthetic import SyntheticCorpus
from semkv.types import Candidate

NS_A = "namespace-a"
NS_B = "namespace-b"
DOC_TOKENS = 256
Docs = list[tuple[int, ...]]  # the corpus fixture: token ids per synthetic document


def _donor(donor_id: str, tokens: tuple[int, ...], namespace: str = NS_A) -> DonorRecord:
    return DonorRecord(donor_id=donor_id, namespace=namespace, token_ids=tokens)


def _query(tokens: tuple[int, ...], namespace: str = NS_A, k: int = 5) -> LookupQuery:
    return LookupQuery(request_id="q", namespace=namespace, token_ids=tokens, max_candidates=k)


def _ids(candidates: list[Candidate]) -> list[str]:
    return [c.donor_id for c in candidates]


class ProviderContract:
    @pytest.fixture
    def make_provider(self) -> Callable[[], DonorProvider]:
        raise NotImplementedError("override make_provider to build your provider")

    @pytest.fixture
    def provider(self, make_provider: Callable[[], DonorProvider]) -> Iterator[DonorProvider]:
        built = make_provider()
        yield built
        built.close()

    @pytest.fixture
    def docs(self, semkv_corpus: SyntheticCorpus) -> Docs:
        return semkv_corpus.documents(12, DOC_TOKENS)

    def _load(self, provider: DonorProvider, docs: Docs) -> None:
        for i, doc in enumerate(docs):
            provider.register_donor(_donor(f"d{i}", doc))
        provider.flush()

    def test_finds_identical_donor(self, provider: DonorProvider, docs: Docs) -> None:
        self._load(provider, docs)
        for i in (0, 5, 11):
            found = provider.lookup(_query(docs[i]))
            assert f"d{i}" in _ids(found), f"identical donor d{i} not found"
            assert found[0].similarity == max(c.similarity for c in found)

    def test_candidates_are_well_formed(self, provider: DonorProvider, docs: Docs) -> None:
        self._load(provider, docs)
        lengths = {f"d{i}": len(d) for i, d in enumerate(docs)}
        # A target that shares its second half with d3 and its first half with nothing.
        target = docs[3][: DOC_TOKENS // 2][::-1] + docs[3][DOC_TOKENS // 2 :]
        for query_tokens in (docs[3], target, docs[7][:100]):
            found = provider.lookup(_query(query_tokens, k=3))
            assert len(found) <= 3
            assert len(set(_ids(found))) == len(found), "duplicate donors in one answer"
            for c in found:
                assert c.donor_id in lengths and c.namespace == NS_A
                assert 0.0 <= c.similarity <= 1.0 and math.isfinite(c.similarity)
                assert c.donor_start + c.num_tokens <= lengths[c.donor_id]
                assert c.target_start + c.num_tokens <= len(query_tokens)

    def test_namespace_isolation(self, provider: DonorProvider, docs: Docs) -> None:
        provider.register_donor(_donor("only-in-a", docs[0], NS_A))
        provider.register_donor(_donor("only-in-b", docs[1], NS_B))
        provider.flush()
        assert "only-in-a" not in _ids(provider.lookup(_query(docs[0], NS_B)))
        assert "only-in-b" not in _ids(provider.lookup(_query(docs[1], NS_A)))
        assert all(c.namespace == NS_B for c in provider.lookup(_query(docs[1], NS_B)))

    def test_eviction(self, provider: DonorProvider, docs: Docs) -> None:
        self._load(provider, docs)
        provider.evict("d2")
        provider.evict("never-registered")  # a no-op, never an error
        provider.flush()
        assert "d2" not in _ids(provider.lookup(_query(docs[2])))
        assert "d4" in _ids(provider.lookup(_query(docs[4])))

    def test_reset(self, provider: DonorProvider, docs: Docs) -> None:
        self._load(provider, docs)
        provider.reset()
        provider.flush()
        assert provider.lookup(_query(docs[0])) == []
        provider.register_donor(_donor("again", docs[0]))
        provider.flush()
        assert "again" in _ids(provider.lookup(_query(docs[0])))

    def test_reregistering_replaces(self, provider: DonorProvider, docs: Docs) -> None:
        provider.register_donor(_donor("x", docs[0]))
        provider.register_donor(_donor("x", docs[1]))
        provider.flush()
        assert "x" in _ids(provider.lookup(_query(docs[1])))

    def test_determinism(self, make_provider: Callable[[], DonorProvider], docs: Docs) -> None:
        answers = []
        for _ in range(2):
            built = make_provider()
            try:
                self._load(built, docs)
                answers.append([built.lookup(_query(d)) for d in docs[:4]])
            finally:
                built.close()
        assert answers[0] == answers[1]

    def test_bad_input(
        self, provider: DonorProvider, make_provider: Callable[[], DonorProvider]
    ) -> None:
        assert provider.lookup(_query(())) == []  # empty prompt: nothing, and no error
        cls = type(provider)
        with pytest.raises(ValidationError):
            cls.from_config({"no_such_option_anywhere": 1}, provider.context)

    def test_thread_safety(self, provider: DonorProvider, semkv_corpus: SyntheticCorpus) -> None:
        docs = semkv_corpus.documents(32, 128)
        errors: list[BaseException] = []

        def writer(offset: int) -> None:
            try:
                for i in range(offset, len(docs), 4):
                    provider.register_donor(_donor(f"t{i}", docs[i]))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        def reader() -> None:
            try:
                for doc in docs:
                    provider.lookup(_query(doc))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
        threads += [threading.Thread(target=reader) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        provider.flush()
        for i in (0, 13, 31):
            assert f"t{i}" in _ids(provider.lookup(_query(docs[i])))

    def test_close_is_idempotent(self, make_provider: Callable[[], DonorProvider]) -> None:
        built = make_provider()
        built.close()
        built.close()
