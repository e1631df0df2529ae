"""What the scheduler-side connector tells the workers each step, and what they answer.

NOTE: everything here is plain data (ints and strings) so it pickles cheaply across vLLM's
process boundary; no token ids travel, only block and slot numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class LoadOp:
    """Copy donor-store slots into a request's engine blocks (every layer).

    Exact tier (``segments`` is None): slot i is copied whole into block i. Verified and
    semantic tiers: ``slots`` hold donor blocks ``donor_first_block`` onwards, and ``segments``
    ``(target position, donor position, length)`` say which donor token serves each target
    position from ``target_start`` on; keys are re-rotated where the two positions differ.
    """

    request_id: str
    slots: list[int]
    generations: list[int]
    block_ids: list[int]
    asynchronous: bool = False
    segments: list[tuple[int, int, int]] | None = None
    donor_first_block: int = 0
    target_start: int = 0


@dataclass
class SaveOp:
    """Copy engine blocks into donor-store slots after this step's forward."""

    slots: list[int]
    generations: list[int]
    block_ids: list[int]


@dataclass
class SemkvMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    shared: KVConnectorMetadata | None = None  # donor_store=lmcache: LMCache's own step plan


@dataclass
class SemkvWorkerMetadata(KVConnectorWorkerMetadata):
    """Per step: blocks each request actually got, and the requests whose load failed."""

    loaded_blocks: dict[str, int] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    # Reported once by each worker: can it edit its pages token by token (PageLayout known)?
    layout_known: bool | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, SemkvWorkerMetadata)
        # Tensor-parallel ranks each load their shard: a request is loaded as far as every
        # rank loaded it.
        merged = {
            rid: min(self.loaded_blocks.get(rid, 0), other.loaded_blocks.get(rid, 0))
            for rid in self.loaded_blocks.keys() | other.loaded_blocks.keys()
        }
        known = (None if self.layout_known is None and other.layout_known is None
                 else bool(self.layout_known is not False and other.layout_known is not False))
        return SemkvWorkerMetadata(merged, self.failed | other.failed, known)
