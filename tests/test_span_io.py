"""A realization's page reads and writes (``semkv_vllm.span_io``): the one-pass gathers and
scatters over a contiguous block-major tensor equal the page path (whole pages through the
``PageLayout``), for a page interior that is not token-major; a window group's dropped blocks
(``NO_BLOCK``) read as zeros and are never written; each group reads its own blocks."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from semkv_vllm.metadata import NO_BLOCK  # noqa: E402
from semkv_vllm.page_layout import PageLayout  # noqa: E402
from semkv_vllm.span_io import SpanReads, write_span  # noqa: E402

from semkv.realize import KVCache  # noqa: E402

HEADS, BLOCK, DIM = 3, 8, 4


def scrambled_layout(seed: int) -> PageLayout:
    """A bijective page interior unlike the logical view (as vLLM's CPU pages are)."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(HEADS * BLOCK * 2 * DIM, generator=gen)
    half = HEADS * BLOCK * DIM
    return PageLayout(order[:half].view(BLOCK, HEADS, DIM), order[half:].view(BLOCK, HEADS, DIM))


def pages(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, HEADS, BLOCK, 2 * DIM, generator=torch.Generator().manual_seed(seed))


def test_reads_gather_exactly_what_the_page_path_reads() -> None:
    layout = scrambled_layout(1)
    kv, store = pages(12, 2), pages(9, 3)
    local = torch.tensor([4, 7])
    slots = torch.tensor([5, 1, 8])
    picked = torch.tensor([3, 4, 5, 9, 10, 17, 23])  # rows of the slots' pages, any subset
    reads = SpanReads(layout, kv, store, local, slots, picked, 2 * BLOCK, torch.device("cpu"),
                      HEADS, DIM, torch.float32)
    assert reads.local_index is not None and reads.copy_index is not None  # the one-pass path
    k, v = reads.layer(kv, store)
    lk, lv = layout.read(kv.index_select(0, local))
    ck, cv = layout.read(store.index_select(0, slots))
    assert torch.equal(k, torch.cat([lk, ck[picked]]).transpose(0, 1))
    assert torch.equal(v, torch.cat([lv, cv[picked]]).transpose(0, 1))
    # a view that is not one contiguous array takes the page path, with the same result
    permuted = kv.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    paged = SpanReads(layout, permuted, store, local, slots, picked, 2 * BLOCK,
                      torch.device("cpu"), HEADS, DIM, torch.float32)
    assert paged.local_index is None
    pk, pv = paged.layer(permuted, store)
    assert torch.equal(pk, k) and torch.equal(pv, v)


def test_nothing_to_read_gives_empty_layers() -> None:
    layout = scrambled_layout(4)
    none = torch.zeros(0, dtype=torch.long)
    reads = SpanReads(layout, pages(2, 5), None, none, none, none, 0, torch.device("cpu"),
                      HEADS, DIM, torch.float32)
    k, v = reads.layer(pages(2, 5), None)
    assert k.shape == v.shape == (HEADS, 0, DIM)


def reference_write(layout: PageLayout, kv: torch.Tensor, blocks: list[int], keys: torch.Tensor,
                    values: torch.Tensor) -> None:
    """The page write as it was: pages read out, K and V scattered in, pages copied back."""
    n = len(blocks)
    idx = torch.tensor(blocks)
    pages = kv.index_select(0, idx).reshape(n, -1)
    pages[:, layout.k_offsets.flatten()] = keys.reshape(n, -1)
    pages[:, layout.v_offsets.flatten()] = values.reshape(n, -1)
    kv.index_copy_(0, idx, pages.view(n, *kv.shape[1:]))


def test_the_span_write_is_the_page_write_and_touches_nothing_else() -> None:
    layout = scrambled_layout(6)
    layers = 2
    blocks = [9, 2, 5]
    lo, hi = BLOCK, BLOCK + len(blocks) * BLOCK  # the span after one block of local prefix
    gen = torch.Generator().manual_seed(7)
    cache = KVCache([torch.randn(1, HEADS, hi + 3, DIM, generator=gen) for _ in range(layers)],
                    [torch.randn(1, HEADS, hi + 3, DIM, generator=gen) for _ in range(layers)])
    fast = [pages(12, 10 + i) for i in range(layers)]
    slow = [t.clone() for t in fast]
    write_span(layout, fast, [blocks] * layers, cache, lo, hi)
    for layer, kv in enumerate(slow):
        reference_write(layout, kv, blocks, cache.keys[layer][0, :, lo:hi].transpose(0, 1),
                        cache.values[layer][0, :, lo:hi].transpose(0, 1))
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)
    untouched = [i for i in range(12) if i not in blocks]
    assert torch.equal(fast[0][untouched], pages(12, 10)[untouched])
    assert not torch.equal(fast[0][blocks], pages(12, 10)[blocks])


def test_a_dropped_local_block_reads_as_zeros_and_each_group_reads_its_own() -> None:
    layout = scrambled_layout(8)
    kv, other, store = pages(12, 9), pages(12, 10), pages(4, 11)
    slots, picked = torch.tensor([2]), torch.tensor([0, 5])
    window = torch.tensor([NO_BLOCK, 6, 3])  # its first block fell out of the window
    full = torch.tensor([1, 7, 4])
    for kv_of_first in (kv, kv.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)):
        reads = SpanReads(layout, kv_of_first, store, window, slots, picked, 3 * BLOCK,
                          torch.device("cpu"), HEADS, DIM, torch.float32)
        reads.add_group(1, other, full)
        k, v = reads.layer(kv_of_first, store, 0)
        assert k.shape == (HEADS, 3 * BLOCK + 2, DIM)
        assert not k[:, :BLOCK].any() and not v[:, :BLOCK].any()  # zeros, not block 0's KV
        lk, lv = layout.read(kv.index_select(0, window[1:]))
        assert torch.equal(k[:, BLOCK : 3 * BLOCK], lk.transpose(0, 1))
        assert torch.equal(v[:, BLOCK : 3 * BLOCK], lv.transpose(0, 1))
        k1, _ = reads.layer(other, store, 1)
        fk, _ = layout.read(other.index_select(0, full))
        assert torch.equal(k1[:, : 3 * BLOCK], fk.transpose(0, 1))
        assert torch.equal(k1[:, 3 * BLOCK :], k[:, 3 * BLOCK :])  # the same copies


def test_the_span_write_skips_a_dropped_block_and_writes_each_layers_own() -> None:
    layout = scrambled_layout(12)
    lo, hi = 0, 3 * BLOCK
    gen = torch.Generator().manual_seed(13)
    cache = KVCache([torch.randn(1, HEADS, hi, DIM, generator=gen) for _ in range(2)],
                    [torch.randn(1, HEADS, hi, DIM, generator=gen) for _ in range(2)])
    kvs = [pages(12, 14), pages(12, 15)]
    before = [t.clone() for t in kvs]
    write_span(layout, kvs, [[NO_BLOCK, 5, 8], [2, 3, 4]], cache, lo, hi)
    k0, _ = layout.read(kvs[0].index_select(0, torch.tensor([5, 8])))
    assert torch.equal(k0, cache.keys[0][0, :, BLOCK:hi].transpose(0, 1))
    assert torch.equal(kvs[0][[0, 2, 3, 4, 11]], before[0][[0, 2, 3, 4, 11]])  # last: -1
    k1, _ = layout.read(kvs[1].index_select(0, torch.tensor([2, 3, 4])))
    assert torch.equal(k1, cache.keys[1][0, :, lo:hi].transpose(0, 1))
