"""Worker side of the connector: executes the scheduler's copies, reports what really happened.

Per step (vLLM's order): ``bind_connector_metadata`` -> ``start_load_kv`` (before the forward
when the step has a synchronous load, else after it) -> per layer ``wait_for_layer_load`` /
``save_kv_layer`` -> ``wait_for_save`` -> ``get_transfer_results`` ->
``get_block_ids_with_load_errors`` -> ``build_connector_worker_meta``.

NOTE: a load whose slot does not hold the generation the scheduler expects (never saved, or
overwritten) is not copied; its blocks are reported invalid so vLLM recomputes them.
NOTE: saves run in ``wait_for_save``, after the whole forward, and only cover blocks whose
every token was computed by the end of this step (the scheduler guarantees it), so chunked
prefill never stores a partial block.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from semkv.log import get_logger
from semkv.metrics import CounterBag
from semkv_vllm.block_copy import allocate_store, copy_blocks
from semkv_vllm.metadata import LoadOp, SaveOp, SemkvMetadata, SemkvWorkerMetadata

log = get_logger("semkv.vllm.worker")


class WorkerSide:
    def __init__(self, num_slots: int, *, layerwise: bool = False) -> None:
        self.num_slots = num_slots
        self.layerwise = layerwise
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.store: dict[str, torch.Tensor] = {}
        self.slot_generation = [0] * num_slots
        self.stats = CounterBag()
        self._meta: SemkvMetadata | None = None
        self._pending_layers: dict[str, list[LoadOp]] = {}
        self._finished_recving: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._loaded: dict[str, int] = {}
        self._failed: set[str] = set()

    # -- setup -----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = dict(kv_caches)
        for name, kv in self.kv_caches.items():
            self.store[name] = allocate_store(kv, self.num_slots)
        per_slot = sum(kv[0].numel() * kv.element_size() for kv in self.kv_caches.values())
        log.info("donor_store_ready", layers=len(self.kv_caches), slots=self.num_slots,
                 bytes_per_slot=per_slot)

    def bind(self, meta: Any) -> None:
        self._meta = meta if isinstance(meta, SemkvMetadata) else None

    def clear(self) -> None:
        self._meta = None

    # -- loads -----------------------------------------------------------------------------
    def _valid(self, op: LoadOp) -> bool:
        return all(self.slot_generation[s] == g for s, g in zip(op.slots, op.generations))

    def start_load_kv(self) -> None:
        if self._meta is None or not self._meta.loads:
            return
        started = time.perf_counter()
        for op in self._meta.loads:
            if not self._valid(op):
                self._fail(op, "stale_slot")
                continue
            if self.layerwise and not op.asynchronous:
                for name in self.kv_caches:
                    self._pending_layers.setdefault(name, []).append(op)
                continue
            try:
                for name, kv in self.kv_caches.items():
                    copy_blocks(self.store[name], op.slots, kv, op.block_ids)
            except Exception as exc:  # noqa: BLE001 - a failed copy becomes a recompute
                self._fail(op, type(exc).__name__)
                continue
            self._done(op)
        log.debug("loads_done", ops=len(self._meta.loads),
                  ms=round((time.perf_counter() - started) * 1e3, 3))

    def wait_for_layer_load(self, layer_name: str) -> None:
        ops = self._pending_layers.pop(layer_name, None)
        if not ops:
            return
        for op in ops:
            try:
                copy_blocks(self.store[layer_name], op.slots, self.kv_caches[layer_name],
                            op.block_ids)
            except Exception as exc:  # noqa: BLE001
                self._fail(op, type(exc).__name__)
                continue
            if not self._pending_layers_for(op):
                self._done(op, counted=op.request_id not in self._failed)

    def _pending_layers_for(self, op: LoadOp) -> bool:
        return any(op in ops for ops in self._pending_layers.values())

    def _done(self, op: LoadOp, counted: bool = True) -> None:
        if counted:
            self._loaded[op.request_id] = len(op.block_ids)
            self.stats.inc("loaded_blocks", amount=len(op.block_ids))
        if op.asynchronous:
            self._finished_recving.add(op.request_id)

    def _fail(self, op: LoadOp, why: str) -> None:
        self._invalid_blocks.update(op.block_ids)
        self._failed.add(op.request_id)
        self._loaded.pop(op.request_id, None)
        self.stats.inc("load_errors", amount=len(op.block_ids))
        if op.asynchronous:
            self._finished_recving.add(op.request_id)
        log.warning("load_failed", request_id=op.request_id, blocks=len(op.block_ids), why=why)

    # -- saves -----------------------------------------------------------------------------
    def wait_for_save(self) -> None:
        if self._meta is None or not self._meta.saves:
            return
        for op in self._meta.saves:
            self._save(op)

    def _save(self, op: SaveOp) -> None:
        try:
            for name, kv in self.kv_caches.items():
                copy_blocks(kv, op.block_ids, self.store[name], op.slots)
        except Exception as exc:  # noqa: BLE001 - an unsaved block is a future miss
            for slot in op.slots:
                self.slot_generation[slot] = -1
            log.warning("save_failed", blocks=len(op.block_ids), error_type=type(exc).__name__)
            return
        for slot, generation in zip(op.slots, op.generations):
            self.slot_generation[slot] = generation
        self.stats.inc("saved_blocks", amount=len(op.slots))

    # -- reporting -------------------------------------------------------------------------
    def take_finished_recving(self) -> set[str]:
        done, self._finished_recving = self._finished_recving, set()
        return done

    def take_invalid_blocks(self) -> set[int]:
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def take_worker_meta(self) -> SemkvWorkerMetadata | None:
        if not self._loaded and not self._failed:
            return None
        meta = SemkvWorkerMetadata(dict(self._loaded), set(self._failed))
        self._loaded, self._failed = {}, set()
        return meta
