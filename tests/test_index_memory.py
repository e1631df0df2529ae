"""Host memory of the discovery state, bounded in bytes (issue #53, ``semkv.index_memory``).

Measured with ``tracemalloc``, never assumed: each built-in provider's index costs no more per
donor than it declares (``donor_memory_bytes``), the donor registry no more than it counts, and
a registry filled far past ``index_memory_bytes`` holds the bound with its oldest donors gone
from the registry, the exact prefix index and the provider. The anchor cache keeps its token
bytes inside its own bound. (Donors whose KV leaves the store: tests/test_evicted_donors.py.)
"""

from __future__ import annotations

import gc
import random
import tracemalloc
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from semkv.anchor_cache import AnchorCache
from semkv.config import ConfigError, SemkvConfig
from semkv.index_memory import IndexBudget, registry_bytes
from semkv.leases import LeaseTable
from semkv.lookup import GuardedProvider
from semkv.metrics import CounterBag
from semkv.plugins import get_provider_class
from semkv.prefix_index import block_keys
from semkv.provider import DonorProvider, DonorRecord, LookupQuery, ProviderContext

pytest.importorskip("vllm", reason="the donor registry is the vLLM adapter's")

from semkv_vllm.donor_registry import DonorRegistry  # noqa: E402
from semkv_vllm.store_index import StoreIndex  # noqa: E402

NS = "n" * 32
BS = 32


def _docs(count: int, tokens: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(100, 49000) for _ in range(tokens)) for _ in range(count)]


def _traced(fill: Callable[[], object]) -> int:
    """Bytes Python's allocator holds after ``fill()`` that it did not before."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = fill()
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del kept
    return used


PROVIDERS: dict[str, dict[str, Any]] = {
    "chunks": {}, "minhash": {}, "minhash-datasketch": {"lsh": "datasketch"},
    "semblend": {}, "embedding": {"vector_cache_entries": 0},
}


@pytest.mark.parametrize("name", sorted(PROVIDERS))
@pytest.mark.parametrize("tokens", [256, 2048])
def test_each_builtin_provider_costs_no_more_than_it_declares(name: str, tokens: int):
    kind = name.split("-")[0]
    if kind in ("semblend", "embedding"):
        pytest.importorskip("sentence_transformers")
    provider = get_provider_class(kind).from_config(
        PROVIDERS[name], ProviderContext(block_size=BS, detokenize=lambda ids: " ".join(
            f"w{t % 5000}" for t in ids)))
    count = 16 if kind in ("semblend", "embedding") else 60  # these embed every donor
    records = [DonorRecord(donor_id=f"d{i}", namespace=NS, token_ids=d)
               for i, d in enumerate(_docs(count + 1, tokens, seed=tokens))]
    try:
        provider.register_donor(records[0])  # first-use structures, not per donor
        provider.flush()

        def fill() -> None:
            for record in records[1:]:
                provider.register_donor(record)
            provider.flush()

        per_donor = _traced(fill) / count
        per_donor += _outside_python(provider) / (count + 1)
        declared = provider.donor_memory_bytes(tokens)
        assert declared is not None
        assert per_donor <= declared, (name, tokens, per_donor, declared)
        assert per_donor >= 0.3 * declared, (name, tokens, per_donor, declared)  # not a guess
    finally:
        provider.close()


def _outside_python(provider: DonorProvider) -> int:
    """What faiss holds for the embedding provider's vectors (its serialized index)."""
    spaces = getattr(provider, "_spaces", None)
    if not spaces:
        return 0
    import faiss

    return sum(len(faiss.serialize_index(space.index)) for space in spaces.values())


class _Quiet(DonorProvider):
    """Costs nothing itself: the registry's own structures are measured alone."""

    name = "quiet"

    def register_donor(self, donor: DonorRecord) -> None: ...
    def lookup(self, query: LookupQuery) -> list[Any]: return []
    def evict(self, donor_id: str) -> None: ...
    def reset(self) -> None: ...
    def donor_memory_bytes(self, num_tokens: int) -> int: return 0


def _registry(config: dict[str, Any], provider: DonorProvider) -> DonorRegistry:
    return DonorRegistry(SemkvConfig.load(config), block_size=BS, index=StoreIndex(1),
                         leases=LeaseTable(), provider=GuardedProvider(provider, timeout_s=5.0),
                         stats=CounterBag(), materialize=False, saves_blocks=False)


def _register(registry: DonorRegistry, tokens: tuple[int, ...]) -> None:
    """What the scheduler hands the registry once a prompt's blocks are all computed."""
    registry.register(SimpleNamespace(
        keys=block_keys(NS, tokens, BS), registered=False,
        request=SimpleNamespace(prompt_token_ids=list(tokens)),
        namespace=SimpleNamespace(digest=NS)))


@pytest.mark.parametrize("tokens", [256, 4096])
def test_the_registry_costs_no_more_than_it_counts(tokens: int):
    registry = _registry({"max_donors": 100_000}, _Quiet(None, ProviderContext(block_size=BS)))
    docs = _docs(200, tokens, seed=7)
    _register(registry, docs[0])
    used = _traced(lambda: [_register(registry, d) for d in docs[1:]])
    counted = registry.nbytes - registry.donors["d1"].nbytes
    assert counted == 199 * registry_bytes(tokens, tokens // BS)
    assert used <= counted, (used, counted)
    assert used >= 0.7 * counted, (used, counted)


def test_index_memory_bytes_holds_and_the_oldest_donors_go():
    """Far more donors than the bound holds, through the real chunks provider: the memory
    stays under the bound (measured), the oldest donors are gone from the registry, the exact
    prefix index and the provider, the newest are found."""
    provider = get_provider_class("chunks").from_config({}, ProviderContext(block_size=BS))
    registry = _registry({"index_memory_bytes": "8MiB", "max_donors": 100_000}, provider)
    docs = _docs(1200, 512, seed=53)
    try:
        def fill() -> None:
            for d in docs:
                _register(registry, d)
            registry.provider.flush()  # type: ignore[union-attr]

        used = _traced(fill)
        budget = registry.budget.donors
        assert registry.nbytes <= budget
        assert used <= budget, (used, budget)
        held = len(registry)
        assert 100 < held < len(docs) // 2, held
        assert registry.stats.counters["donor_evictions:bound"] == len(docs) - held
        oldest, newest = docs[0], docs[-1]
        assert "d1" not in registry.donors
        assert registry.prefixes.longest(NS, oldest, BS) == (0, None)
        found = provider.lookup(LookupQuery(request_id="q", namespace=NS, token_ids=oldest))
        assert not found  # the provider forgot it too
        assert f"d{len(docs)}" in registry.donors
        assert registry.prefixes.longest(NS, newest, BS)[0] == len(newest) // BS
        found = provider.lookup(LookupQuery(request_id="q", namespace=NS, token_ids=newest))
        assert [c.donor_id for c in found][:1] == [f"d{len(docs)}"]
    finally:
        registry.provider.close()  # type: ignore[union-attr]


def test_a_leased_donor_outlives_the_bound_until_released():
    registry = _registry({"index_memory_bytes": "4MiB"},
                         _Quiet(None, ProviderContext(block_size=BS)))
    docs = _docs(400, 1024, seed=3)
    _register(registry, docs[0])
    lease = registry.leases.acquire("d1")
    for d in docs[1:]:
        _register(registry, d)
    assert "d1" in registry.donors  # leased: kept over the bound, oldest still
    assert list(registry.donors)[0] == "d1"
    registry.leases.release(lease.lease_id)
    _register(registry, _docs(1, 1024, seed=4)[0])
    assert "d1" not in registry.donors
    assert registry.nbytes <= registry.budget.donors


def test_a_provider_that_does_not_say_is_counted_at_a_stated_rate(caplog):
    import logging

    class Silent(_Quiet):
        name = "silent"

        def donor_memory_bytes(self, num_tokens: int) -> None:  # type: ignore[override]
            return None

    with caplog.at_level(logging.WARNING, logger="semkv"):
        registry = _registry({}, Silent(None, ProviderContext(block_size=BS)))
    assert "provider_memory_unknown" in caplog.text and '"assumed_bytes_per_token": 64' \
        in caplog.text
    _register(registry, _docs(1, 1024, seed=1)[0])
    assert registry.nbytes == registry_bytes(1024, 32) + 64 * 1024


def test_provider_caches_that_leave_too_little_stop_the_start():
    with pytest.raises(ConfigError, match="index_memory_bytes=4194304.*provider's caches"):
        IndexBudget.split(4 << 20, provider_caches=3 << 20)
    budget = IndexBudget.split(256 << 20, provider_caches=10 << 20)
    assert budget.anchor_cache == 64 << 20 and budget.donors == (256 - 64 - 10) << 20


def test_the_anchor_cache_counts_the_token_bytes_it_keeps():
    """The token bytes it keeps for recently seen donors (up to 1,024 of them) were outside
    its bound; now within, and a smaller bound is enforced at once."""
    import array

    cache = AnchorCache(max_bytes=1 << 20)
    donors = [array.array("q", d) for d in _docs(64, 4096, seed=5)]  # 32 KB of bytes each

    from semkv.span_map import build_anchor_index

    for d in donors:
        cache.get(d, 8, build_anchor_index)
        assert cache.nbytes <= cache.max_bytes
    cache.resize(256 << 10)
    assert cache.nbytes <= 256 << 10
