"""Whole-block copies between engine pages and the donor store, and the store's slot index."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from semkv_vllm.block_copy import allocate_store, copy_blocks  # noqa: E402
from semkv_vllm.store_index import StoreIndex, block_keys  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_copy_blocks_is_an_exact_page_gather_scatter(data):
    num_blocks = data.draw(st.integers(2, 24))
    kv = torch.randn(num_blocks, 3, 32, 128)  # CPU page: [blocks, heads, block, K|V]
    store = allocate_store(kv, num_blocks)
    src = data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=1, max_size=num_blocks,
                             unique=True))
    slots = data.draw(st.permutations(list(range(num_blocks))))[: len(src)]
    copy_blocks(kv, src, store, slots)
    dst = data.draw(st.permutations(list(range(num_blocks))))[: len(src)]
    target = torch.zeros_like(kv)
    copy_blocks(store, slots, target, dst)
    for s, d in zip(src, dst, strict=False):
        assert torch.equal(target[d], kv[s])  # bit-identical whole pages
    untouched = sorted(set(range(num_blocks)) - set(dst))
    assert torch.count_nonzero(target[untouched]) == 0


def test_copy_rejects_page_mismatch():
    with pytest.raises(ValueError, match="page mismatch"):
        copy_blocks(torch.zeros(2, 3, 32, 128), [0], torch.zeros(2, 3, 16, 128), [0])
    with pytest.raises(ValueError, match="length"):
        copy_blocks(torch.zeros(2, 3, 32, 128), [0, 1], torch.zeros(2, 3, 32, 128), [0])


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device on this machine: the CUDA copy path is checked on a GPU")
def test_cuda_copy_path_gpu_only():
    kv = torch.randn(16, 8, 16, 256, device="cuda")
    store = allocate_store(kv, 16)
    assert store.is_pinned()
    copy_blocks(kv, [3, 5], store, [0, 1])
    out = torch.zeros_like(kv)
    copy_blocks(store, [0, 1], out, [7, 9])
    torch.cuda.synchronize()
    assert torch.equal(out[7], kv[3]) and torch.equal(out[9], kv[5])


def test_block_keys_are_chained_and_namespaced():
    a = block_keys("ns", list(range(100)), 32)
    assert len(a) == 3
    b = block_keys("ns", [999] + list(range(1, 100)), 32)
    # a change in block 0 changes every later key
    assert all(x != y for x, y in zip(a, b, strict=True))
    assert block_keys("other", list(range(100)), 32)[0] != a[0]
    assert block_keys("ns", list(range(64)), 32) == a[:2]


def test_index_lru_pins_and_generations():
    index = StoreIndex(2)
    s1, g1 = index.reserve(b"a")
    s2, _ = index.reserve(b"b")
    assert index.reserve(b"a") is None  # already stored
    index.pin([s1])
    s3, g3 = index.reserve(b"c")  # evicts b (a is pinned)
    assert s3 == s2 and index.get(b"b") is None and index.get(b"a") == (s1, g1)
    index.pin([s3])
    assert index.reserve(b"d") is None  # everything pinned: no room
    index.unpin([s1, s3])
    s4, g4 = index.reserve(b"d")
    assert s4 == s1 and g4 == g1 + 1  # slot reuse bumps the generation: old leases are stale
    assert index.stored_prefix([b"c", b"d", b"zz"]) == 2
    with pytest.raises(RuntimeError):
        index.unpin([s4])
