"""What the scheduler-side connector tells the workers each step, and what they answer.

NOTE: everything here is plain data (ints and strings) so it pickles cheaply across vLLM's
process boundary. Block and slot numbers travel; token ids only for the span tokens a
``RealizeOp`` may compute (its gaps, and the copied tokens its recompute strategy may select),
as vLLM's own ``SchedulerOutput`` carries prompt ids to the workers, and for the donor prefixes
a ``FetchOp`` retrieves from a shared KV store (its keys are made from them).
Nothing here is ever logged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from semkv.cost import RealizeWork, StepWork
from semkv.realize.recompute import RecomputeStrategy

W = TypeVar("W", StepWork, RealizeWork)
NO_BLOCK = -1  # a window group holds no block at this position (vLLM's null block)


def block_groups(ids_per_group: tuple[list[int], ...] | list[list[int]], first: int,
                 count: int, null_block: int, *, per_group: bool = False,
                 ) -> tuple[list[int], list[list[int]] | None]:
    """Blocks ``[first, first + count)`` of a request, as an op carries them: the first
    group's, and every group's where there are several or ``per_group`` (a window group: its
    op's failure is reported per request); vLLM's null block as ``NO_BLOCK``."""
    groups = [[NO_BLOCK if b == null_block else b for b in ids[first : first + count]]
              for ids in ids_per_group]
    return groups[0], (groups if len(groups) > 1 or per_group else None)


@dataclass
class LoadOp:
    """Copy donor-store slots into a request's engine blocks (every layer).

    Exact tier (``segments`` is None): slot i is copied whole into block i. Verified and
    semantic tiers: ``slots`` hold donor blocks ``donor_first_block`` onwards, and ``segments``
    ``(target position, donor position, length)`` say which donor token serves each target
    position from ``target_start`` on; keys are re-rotated where the two positions differ.
    Several KV-cache groups, or a sliding-window one (exact tier only): ``groups`` holds each
    group's blocks, aligned with ``slots`` (``block_ids`` is the first group's); a group's
    layers get its own blocks, and a failure is reported per request (``RealizeOp`` says why).
    NOTE: ``NO_BLOCK`` marks a position whose block a window group does not hold (vLLM's null
    block there): that block is neither read nor written.
    """

    request_id: str
    slots: list[int]
    generations: list[int]
    block_ids: list[int]
    asynchronous: bool = False
    segments: list[tuple[int, int, int]] | None = None
    donor_first_block: int = 0
    target_start: int = 0
    kv_floor: str | None = None  # request option: round the loaded KV (semkv_vllm.options)
    groups: list[list[int]] | None = None  # several KV-cache groups: each group's blocks


@dataclass
class CopySource:
    """Target ``[target_start, target_start + length)`` reads donor positions from
    ``donor_start``, held by store ``slots`` (donor blocks ``donor_first_block`` onwards)."""

    target_start: int
    length: int
    donor_start: int
    donor_first_block: int
    slots: list[int]
    generations: list[int]


@dataclass
class FetchOp:
    """Retrieve a donor's tokens ``[0, end)`` from the shared KV store into store ``slots``
    (one slot per block; ``donor_store: lmcache``, ``lmcache_fetch.py``). On success every slot
    takes its ``generations`` entry, so the copies that read them see current slots.

    NOTE: the donor's token ids travel: the shared store keys its chunks by them.
    """

    fetch_id: str
    token_ids: list[int]
    end: int
    slots: list[int]
    generations: list[int]
    cache_salt: str = ""


@dataclass
class RealizeOp:
    """Realize a request's external span ``[local_tokens, span_tokens)`` into its blocks.

    The worker fills the span's KV from the request's own local prefix (``local_block_ids``),
    the ``copies`` (donor KV, keys re-rotated where positions differ), computes every other
    span position (``gap_positions``) and the copied positions ``recompute`` selects
    (``semkv.realize.recompute``; blend's fraction is of ``prompt_tokens``) through the
    engine's model, then writes ``block_ids`` (the span's blocks). ``token_ids`` are the ids
    at ``token_positions``: every position the strategy may compute. Always asynchronous: the
    request waits for its KV while others run. With ``fetches`` the copies' slots are filled
    from the shared KV store first; the realization starts once every fetch has landed.
    With sliding-window or several KV-cache groups, ``groups`` holds each group's blocks over
    ``[0, span_tokens)`` (``local_block_ids`` and ``block_ids`` are the first group's): a
    layer reads its local prefix from and writes the span into its own group's blocks.
    NOTE: ``NO_BLOCK`` there is a block the group does not hold (vLLM's null block, out of
    every later token's window): a local one is read as zeros, a span one is not written.
    With ``groups`` a failure is reported per request (vLLM's invalid-block recovery would
    restart inside a window whose blocks it dropped).
    """

    request_id: str
    local_tokens: int
    span_tokens: int
    local_block_ids: list[int]
    block_ids: list[int]
    copies: list[CopySource]
    gap_positions: list[int]
    token_positions: list[int]
    token_ids: list[int]
    recompute: RecomputeStrategy = field(default_factory=RecomputeStrategy)
    prompt_tokens: int = 0  # the tokens being prefilled
    kv_floor: str | None = None  # request option: round the realized KV (semkv_vllm.options)
    fetches: list[FetchOp] = field(default_factory=list)
    max_chunk_tokens: int | None = None  # positions per layer call (None: a layer at once)
    groups: list[list[int]] | None = None  # each KV-cache group's blocks (see above)

    def local_blocks(self, group: int) -> list[int]:
        """The local prefix's blocks of ``group`` (``NO_BLOCK`` where it holds none)."""
        if self.groups is None:
            return self.local_block_ids
        return self.groups[group][: len(self.local_block_ids)]

    def span_blocks(self, group: int) -> list[int]:
        """The span's blocks of ``group`` (``NO_BLOCK`` where it holds none)."""
        if self.groups is None:
            return self.block_ids
        return self.groups[group][len(self.local_block_ids):]

    def token_map(self) -> dict[int, int]:
        return dict(zip(self.token_positions, self.token_ids, strict=True))


@dataclass
class SaveOp:
    """Copy engine blocks into donor-store slots after this step's forward (with several
    KV-cache groups, each group's own blocks: ``groups``, as in ``LoadOp``)."""

    slots: list[int]
    generations: list[int]
    block_ids: list[int]
    groups: list[list[int]] | None = None


@dataclass
class SemkvMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    realizes: list[RealizeOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    idle: bool = False  # no token scheduled this step: the worker may wait for realizations
    shared: KVConnectorMetadata | None = None  # donor_store=lmcache: LMCache's own step plan
    # The step's forward work when it prefills and the cost gate is on: the workers time the
    # forward and report it back (cost_gate.py).
    step: StepWork | None = None


@dataclass
class SemkvWorkerMetadata(KVConnectorWorkerMetadata):
    """Per step: blocks each request actually got, the requests whose load failed, and the
    cost gate's timings."""

    loaded_blocks: dict[str, int] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    # Reported once by each worker: can it edit its pages token by token (PageLayout known)?
    layout_known: bool | None = None
    # Reported once by each worker: can it realize spans (layout known, model supported)?
    can_realize: bool | None = None
    # Per realized request: copied tokens its recompute strategy computed through every layer.
    recomputed: dict[str, int] = field(default_factory=dict)
    # The cost gate's samples (cost_gate.py): timed forwards, and realizations that ended well
    # (with the start-up calibration's in the first report). Counts and seconds only.
    forwards: list[tuple[StepWork, float]] = field(default_factory=list)
    realizations: list[tuple[RealizeWork, float]] = field(default_factory=list)
    # With ``can_realize`` False: why (the model's family, the page layout); for the operator.
    realize_why: str | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, SemkvWorkerMetadata)
        # Tensor-parallel ranks each load their shard: a request is loaded as far as every
        # rank loaded it.
        merged = {
            rid: min(self.loaded_blocks.get(rid, 0), other.loaded_blocks.get(rid, 0))
            for rid in self.loaded_blocks.keys() | other.loaded_blocks.keys()
        }
        # Every rank recomputes the same positions (the ranking is summed over ranks).
        recomputed = {rid: max(self.recomputed.get(rid, 0), other.recomputed.get(rid, 0))
                      for rid in self.recomputed.keys() | other.recomputed.keys()}
        return SemkvWorkerMetadata(merged, self.failed | other.failed,
                                   _all(self.layout_known, other.layout_known),
                                   _all(self.can_realize, other.can_realize), recomputed,
                                   _slowest(self.forwards, other.forwards),
                                   _slowest(self.realizations, other.realizations),
                                   self.realize_why or other.realize_why)


def _slowest(a: list[tuple[W, float]], b: list[tuple[W, float]]) -> list[tuple[W, float]]:
    """Ranks time the same work: the step took as long as its slowest rank (lists that do not
    pair up, e.g. a rank whose device timings resolved a step later: the longer one)."""
    if len(a) != len(b):
        return list(a if len(a) > len(b) else b)
    return [(wa, max(ta, tb)) for (wa, ta), (_, tb) in zip(a, b, strict=True)]


def _all(a: bool | None, b: bool | None) -> bool | None:
    """Both ranks' answer (None: neither answered yet; False from any rank wins)."""
    return None if a is None and b is None else bool(a is not False and b is not False)
