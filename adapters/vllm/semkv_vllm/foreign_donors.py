"""Donors this engine did not register, as views for its decisions.

- The shared KV store's prefix of a request (``donor_store: lmcache``): a transient exact-tier
  donor ``shared:<request id>`` holding the request's own tokens, published in the lease table
  for that request's decision and retired once its lease is released.
- Another engine's donors, found through a shared discovery store (their token ids come with
  the lookup: ``LookupResult.remote``). ``discovery_only`` assesses them like this engine's own
  (fleet-wide telemetry); a materializing engine has none of their KV, so they get no view and
  admission ends ``donor_stale``.

NOTE: remote views live for one decision: ``remote_views`` replaces them.
"""

from __future__ import annotations

from typing import Any

from semkv.admission import DonorView, as_tokens
from semkv.leases import LeaseTable
from semkv.metrics import CounterBag
from semkv.types import Candidate

SHARED_PREFIX = "shared:"


class ForeignDonors:
    def __init__(self, leases: LeaseTable, block_size: int, stats: CounterBag, *,
                 materialize: bool) -> None:
        self.leases = leases
        self.bs = block_size
        self.stats = stats
        self.materialize = materialize
        self.shared: dict[str, DonorView] = {}
        self.remote: dict[str, DonorView] = {}

    def is_shared(self, donor_id: str | None) -> bool:
        return donor_id in self.shared

    def shared_candidate(self, request: Any, namespace: str, stored: int) -> Candidate:
        """The shared store's first ``stored`` tokens of ``request``, as an exact-tier donor."""
        donor_id = f"{SHARED_PREFIX}{request.request_id}"
        self.shared[donor_id] = DonorView(donor_id, namespace,
                                          as_tokens(request.all_token_ids[:stored]), stored)
        self.leases.publish(donor_id)
        return Candidate(donor_id=donor_id, namespace=namespace, similarity=1.0)

    def drop_shared(self, request_id: str) -> None:
        donor_id = f"{SHARED_PREFIX}{request_id}"
        if donor_id in self.shared and self.leases.try_retire(donor_id):
            del self.shared[donor_id]

    def remote_views(self, remote: dict[str, tuple[int, ...]],
                     candidates: list[Candidate]) -> None:
        """This decision's views of other engines' candidates (counted: ``remote_donors``)."""
        self.remote = {}
        for c in candidates:
            tokens = remote.get(c.donor_id)
            if tokens is None:
                continue
            self.stats.inc("remote_donors")
            if not self.materialize:
                stored = len(tokens) - len(tokens) % self.bs
                self.remote[c.donor_id] = DonorView(c.donor_id, c.namespace, as_tokens(tokens),
                                                    stored)

    def clear(self) -> None:
        self.shared.clear()
        self.remote.clear()
