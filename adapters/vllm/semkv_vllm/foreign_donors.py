"""Donors this engine did not register, as views for its decisions.

- The shared KV store's prefix of a request (``donor_store: lmcache``): a transient exact-tier
  donor ``shared:<request id>`` holding the request's own tokens, published in the lease table
  for that request's decision and retired once its lease is released.
- Another engine's donors, found through a shared discovery store (their token ids come with
  the lookup: ``LookupResult.remote``). ``discovery_only`` assesses them like this engine's own
  (fleet-wide telemetry); a materializing engine has none of their KV, so admission gets no
  view and ends ``donor_stale``. With ``fetchable`` (``donor_store: lmcache`` and realized
  spans) their KV is in the shared store: span planning gets views (``fetchable`` dict), and
  the donors are published in the lease table while a plan may lease them.

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
                 materialize: bool, fetchable: bool = False) -> None:
        self.leases = leases
        self.bs = block_size
        self.stats = stats
        self.materialize = materialize
        self.shared: dict[str, DonorView] = {}
        self.remote: dict[str, DonorView] = {}  # for admission (discovery_only engines)
        self.fetchable: dict[str, DonorView] = {}  # for span planning (shared KV store)
        self.is_fetchable = fetchable
        self._published: set[str] = set()  # remote donors in the lease table

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
        self.remote, self.fetchable = {}, {}
        self._published = {d for d in self._published if not self.leases.try_retire(d)}
        for c in candidates:
            tokens = remote.get(c.donor_id)
            if tokens is None:
                continue
            self.stats.inc("remote_donors")
            stored = len(tokens) - len(tokens) % self.bs
            view = DonorView(c.donor_id, c.namespace, as_tokens(tokens), stored)
            if not self.materialize:
                self.remote[c.donor_id] = view
            elif self.is_fetchable:
                self.fetchable[c.donor_id] = view
                if self.leases.generation(c.donor_id) is None:
                    self.leases.publish(c.donor_id)
                    self._published.add(c.donor_id)

    def clear(self) -> None:
        self.shared.clear()
        self.remote.clear()
        self.fetchable.clear()
        self._published = {d for d in self._published if not self.leases.try_retire(d)}
