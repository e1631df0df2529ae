"""Donors on the scheduler side: saving a request's prompt blocks, then registering it.

Protocol (driven by ``SchedulerSide.build_connector_meta``, once per step and request):
- ``capture``: every prompt block that becomes complete in this step gets a store slot
  (content-addressed: a block already stored is not stored again) and a ``SaveOp`` for the
  workers; once all full prompt blocks are stored the request is ``register``-ed with the
  provider as a donor.
- ``view``: what admission may read of a donor (tokens, and how much of it is still stored).
- ``exact_candidate``: the donor holding the longest stored run of a target's whole blocks
  from its first (``semkv.prefix_index``), whatever the provider proposes; every registered
  donor's block keys are indexed, and dropped with it.
- Bounds: donors are retired least recently used first (never a leased one) while more than
  ``max_donors`` are held or their memory is over what ``index_memory_bytes`` leaves for
  donors (``semkv.index_memory``: tokens, keys, the prefix index, the provider's index).
- ``drop_evicted``: a donor whose stored prefix the store's evictions cut below the smallest
  span any tier takes is dropped at once, from the registry, the prefix index and the
  provider: found again it could only be planned and then missed, which costs a target more
  than a plain miss.

NOTE: in ``discovery_only`` (and with a shared store, which saves for itself) nothing is saved:
donors are registered by their tokens only, so the stats can say what would have been reused.
NOTE: slots reserved for one plan stay pinned until the plan is complete, so a later
reservation in the same plan can never evict a block it has just stored.
"""

from __future__ import annotations

import itertools
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from semkv.admission import DonorView, as_tokens
from semkv.config import SemkvConfig
from semkv.index_memory import UNKNOWN_BYTES_PER_TOKEN, IndexBudget, registry_bytes
from semkv.leases import LeaseTable
from semkv.log import get_logger
from semkv.lookup import GuardedProvider
from semkv.metrics import CounterBag
from semkv.prefix_index import PrefixIndex, block_keys
from semkv.provider import DonorRecord
from semkv.types import Candidate, Mode, QualityTier
from semkv_vllm.metadata import SaveOp, SemkvMetadata
from semkv_vllm.request_state import RequestState
from semkv_vllm.store_index import StoreIndex

log = get_logger("semkv.vllm.donors")


@dataclass
class Donor:
    donor_id: str
    namespace: str
    token_ids: array[int]  # compact: donors are many and long
    keys: list[bytes]
    nbytes: int  # its share of index_memory_bytes (semkv.index_memory)


class DonorRegistry:
    def __init__(self, config: SemkvConfig, *, block_size: int, index: StoreIndex,
                 leases: LeaseTable, provider: GuardedProvider | None, stats: CounterBag,
                 materialize: bool, saves_blocks: bool) -> None:
        self.config = config
        self.bs = block_size
        self.index = index
        self.leases = leases
        self.provider = provider
        self.stats = stats
        self.materialize = materialize  # loads read the store: only stored blocks count
        self.saves_blocks = saves_blocks  # False: discovery only, or a shared store saves
        self.donors: OrderedDict[str, Donor] = OrderedDict()
        self.by_tail: dict[bytes, str] = {}  # last block's key -> donor (same prompt: one donor)
        self.prefixes = PrefixIndex()  # every donor's block keys: the exact tier's own lookup
        self._ids = itertools.count(1)
        self.budget = IndexBudget.split(
            int(config.index_memory_bytes),
            provider.provider.cache_memory_bytes() if provider is not None else 0)
        self.nbytes = 0  # the held donors' memory
        self._doomed: set[str] = set()  # evicted while leased: dropped once released
        if provider is not None and provider.provider.donor_memory_bytes(1024) is None:
            log.warning("provider_memory_unknown", provider=provider.provider.name,
                        assumed_bytes_per_token=UNKNOWN_BYTES_PER_TOKEN,
                        fix="the provider can say: DonorProvider.donor_memory_bytes")
        log.info("index_memory", total=self.budget.total, donors=self.budget.donors,
                 anchor_cache=self.budget.anchor_cache,
                 provider_caches=self.budget.provider_caches)

    def __len__(self) -> int:
        return len(self.donors)

    def view(self, donor_id: str) -> DonorView | None:
        donor = self.donors.get(donor_id)
        if donor is None:
            return None
        self.donors.move_to_end(donor_id)
        stored = (self.index.stored_prefix(donor.keys) if self.materialize
                  else len(donor.keys)) * self.bs
        return DonorView(donor_id, donor.namespace, donor.token_ids, stored)

    def exact_candidate(self, namespace: str, tokens: Sequence[int]) -> Candidate | None:
        """The donor holding the longest run of ``tokens``' whole blocks from the first, as a
        candidate; None when no donor's stored blocks start it.

        NOTE: where loads read the store, a block counts only while the store holds it (the
        walk stops at the first evicted one); in discovery_only every registered block counts.
        """
        stored = self._stored if self.materialize else None
        blocks, donor_id = self.prefixes.longest(namespace, tokens, self.bs, stored=stored)
        if donor_id is None:
            return None
        return Candidate(donor_id=donor_id, namespace=namespace, similarity=1.0,
                         num_tokens=blocks * self.bs, signals={"prefix_blocks": float(blocks)})

    def _stored(self, key: bytes) -> bool:
        return self.index.get(key) is not None

    def capture(self, st: RequestState, computed_after: int, meta: SemkvMetadata,
                kv_cache_manager: Any, null_block: int = 0) -> None:
        """Save the prompt blocks complete after this step; register the donor when all are."""
        request = st.request
        prompt = request.num_prompt_tokens
        total_blocks = prompt // self.bs
        if total_blocks * self.bs < self.smallest_span:
            st.may_save = False  # too short to ever be worth reusing
            return
        done = min(computed_after, prompt) // self.bs
        if done <= st.saved_blocks:
            return
        if st.keys is None:
            st.keys = block_keys(st.namespace.digest, request.prompt_token_ids, self.bs)
        if self.saves_blocks:
            if kv_cache_manager is None:
                return
            if total_blocks > self.index.num_slots:
                st.may_save = False  # a donor larger than the whole store could never serve
                return
            op = self._plan_save(st, done, kv_cache_manager.get_block_ids(request.request_id),
                                 null_block)
            if op.slots:
                meta.saves.append(op)
        st.saved_blocks = done
        if done == total_blocks and st.may_save:
            self.register(st)

    def _plan_save(self, st: RequestState, done: int, block_ids: tuple[list[int], ...],
                   null_block: int) -> SaveOp:
        """``block_ids``: the request's blocks of each KV-cache group."""
        assert st.keys is not None
        op = SaveOp([], [], [], [[] for _ in block_ids] if len(block_ids) > 1 else None)
        for i in range(st.saved_blocks, done):
            ids = [group[i] for group in block_ids]
            if null_block in ids and self.index.get(st.keys[i]) is None:
                # a window group no longer holds this block (out of the window of a local
                # prefix hit): the block cannot be stored whole, nor any after it be reached
                st.may_save = False
                break
            got = self.index.reserve(st.keys[i])
            if got is None:
                if self.index.get(st.keys[i]) is None:  # every slot pinned: stop here
                    st.may_save = False
                    break
                continue  # already stored
            self.index.pin([got[0]])
            op.slots.append(got[0])
            op.generations.append(got[1])
            op.block_ids.append(ids[0])
            for group, block in zip(op.groups or (), ids, strict=False):
                group.append(block)
        self.index.unpin(op.slots)
        return op

    @property
    def smallest_span(self) -> int:
        """The fewest tokens any tier this engine may load would take from one donor."""
        c = self.config
        spans = [c.min_reuse_tokens]
        if c.semantic_mode is Mode.MATERIALIZE_SEMANTIC:
            spans += [{QualityTier.VERIFIED: c.verified_min_reuse_tokens,
                       QualityTier.SEMANTIC: c.semantic_min_reuse_tokens}[t]
                      for t in c.semantic_tiers if t is not QualityTier.EXACT]
        return min(spans)

    def register(self, st: RequestState) -> None:
        assert st.keys is not None and self.provider is not None
        st.registered = True
        tail = st.keys[-1]
        if tail in self.by_tail and self.by_tail[tail] in self.donors:
            self.donors.move_to_end(self.by_tail[tail])
            return
        donor_id = f"d{next(self._ids)}"
        tokens = as_tokens(st.request.prompt_token_ids[: len(st.keys) * self.bs])
        cost = self.donor_bytes(len(tokens), len(st.keys))
        self.donors[donor_id] = Donor(donor_id, st.namespace.digest, tokens, st.keys, cost)
        self.nbytes += cost
        self.by_tail[tail] = donor_id
        self.prefixes.add(donor_id, st.keys)
        self.leases.publish(donor_id)
        self.provider.register(DonorRecord(donor_id=donor_id, namespace=st.namespace.digest,
                                           token_ids=tuple(tokens)))
        self.stats.inc("donor_registrations")
        self._trim()

    def donor_bytes(self, num_tokens: int, num_keys: int) -> int:
        """One donor's share of ``index_memory_bytes``: the host's part and the provider's."""
        said = (self.provider.provider.donor_memory_bytes(num_tokens)
                if self.provider is not None else 0)
        return registry_bytes(num_tokens, num_keys) + (
            said if said is not None else UNKNOWN_BYTES_PER_TOKEN * num_tokens)

    def _over(self) -> bool:
        return len(self.donors) > self.config.max_donors or self.nbytes > self.budget.donors

    def _trim(self) -> None:
        for donor_id in list(self.donors):
            if not self._over():
                break
            if self.leases.try_retire(donor_id):
                self._drop(donor_id, "bound")

    def drop_evicted(self, keys: Sequence[bytes]) -> None:
        """Drop every donor that ``keys`` leaving the store leaves with a stored prefix shorter
        than any tier takes (a donor still holding a long enough prefix keeps serving it); a
        leased one once its lease is released (asked again with each call)."""
        doomed = self._doomed
        smallest = self.smallest_span
        for key in keys:
            for donor_id in self.prefixes.holders(key):
                donor = self.donors.get(donor_id)
                if donor is not None and (
                        self.index.stored_prefix(donor.keys) * self.bs < smallest):
                    doomed.add(donor_id)
        for donor_id in list(doomed):
            if donor_id not in self.donors:
                doomed.discard(donor_id)
            elif self.leases.try_retire(donor_id):
                doomed.discard(donor_id)
                self._drop(donor_id, "kv_evicted")

    def _drop(self, donor_id: str, reason: str) -> None:
        donor = self.donors.pop(donor_id)
        self.nbytes -= donor.nbytes
        if self.by_tail.get(donor.keys[-1]) == donor_id:
            del self.by_tail[donor.keys[-1]]
        self.prefixes.remove(donor_id, donor.keys)
        assert self.provider is not None
        self.provider.evict(donor_id)
        self.stats.inc("donor_evictions", reason)

    def clear(self) -> None:
        self.donors.clear()
        self.by_tail.clear()
        self.prefixes.clear()
        self._doomed.clear()
        self.nbytes = 0
