"""A discovery store shared by several engines: donor records and posting sets in Redis.

Protocol (what a provider that opts in does; ``chunks`` and ``minhash`` do exactly this):
- its ``Config`` inherits ``SharedStoreConfig``: ``discovery_store`` is ``"memory"`` (the
  default: the provider's own in-process index) or ``redis://host:port/db`` (``rediss://`` for
  TLS); when it names a server the provider builds one ``RedisStore`` and keeps its index there;
  credentials come from where ``store_password_env`` / ``store_password_file`` point
  (``semkv.store_credentials``: checked with one ``PING`` at start-up, never in the config),
  TLS from ``store_tls_*`` (``semkv.store_tls``: the server's certificate always verified);
- a donor is one record (a hash: its token ids as compact bytes plus provider fields) and any
  number of *postings*: members of sorted sets keyed by what the provider hashes (a chunk, an
  LSH band), scored by time so that the newest ``cap`` are kept;
- donor ids are qualified by the registering instance (``instance/donor_id``): the ids of this
  instance's own donors come back unqualified, other instances' donors qualified, and
  ``DonorProvider.donor_tokens`` gives their token ids to the host's verifier;
- nothing read back is trusted (anyone who can write to the server can write any bytes): a
  posting member that is not a stored id of the shape ``SharedDonors`` writes, a token record
  whose type code is not ``I`` or ``q`` (or whose length or values do not fit it), a count that
  is not a small decimal, is dropped and counted (``malformed_records``), never raised into a
  lookup, let alone the host: ``checked_id``, ``unpack_tokens``, ``count_field``;
- every key is ``{store_prefix}:{provider}:{variant}:{namespace}:...``: the namespace is part
  of every key (a lookup only ever reads its own namespace's keys) and ``variant`` fingerprints
  the provider settings that change the keys (two differently configured fleets never mix);
- donors expire: each record has a TTL (``donor_ttl_s``, refreshed when a lookup returns it)
  and each namespace keeps at most ``store_max_donors`` (least recently registered or found
  by a lookup are evicted first, by whichever instance registers past the bound);
- failure: every call runs under the socket timeouts set from ``store_timeout_ms`` (reads) and
  ``store_write_timeout_ms`` (writes), with no retries; a connection error or a timeout raises
  ``DiscoveryStoreUnavailable`` and opens the breaker of its kind (reads and writes have one
  each: slow registrations never refuse lookups, nor the reverse) for ``store_retry_s``,
  doubled with each failure in a row up to 30 s (``semkv.breaker``), during which calls of that kind
  fail at once (no socket touched); one success closes it. A lookup reads at most
  ``store_lookup_max_keys`` posting sets (a long prompt's are sampled), their newest
  ``store_lookup_max_members`` members in all, and the records of at most
  ``store_lookup_max_records`` donors (``most_found``), so no one prompt's lookup, nor sets
  filled by a fleet, outgrows the read timeout. The host's ``GuardedProvider`` turns a
  raised lookup into a ``provider_error`` fallback (normal prefill) and counts failed
  registrations; when the server returns, the next call after the breaker closes succeeds
  and registration resumes. ``RedisStore.counters`` counts errors, timeouts, calls refused by
  the open breaker and records dropped as malformed.

``redis`` (redis-py) is imported when a store is built, never at module import.
"""

from __future__ import annotations

import re
import sys
import threading
import time
import uuid
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from semkv.breaker import Breaker

TOKEN_WIDTHS = {"I": 4, "q": 8}  # the type codes pack_tokens writes, and their item sizes
MAX_COUNT_DIGITS = 9  # a count field (a donor's length, a shingle count) below 10**9
# A stored donor id: the registering instance's name (``instance_id``'s pattern), then the
# host's donor id. NOTE: host ids in a shared store have no ``/`` and no ``:`` (the vLLM
# adapter's are ``d{n}``; its transient ``shared:<request>`` donors are never stored), so an id
# read back can never alias a host-local one it did not register.
_HOST_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_STORED_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}/[A-Za-z0-9_.-]{1,128}")
INSTALL_HINT = "pip install redis (built-in providers: pip install 'semkv-chunks[redis]')"
_URL = re.compile(r"^(redis|rediss)://(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+)(:\d{1,5})?(/\d{1,2})?$")

Posting = tuple[str, str]  # (key suffix, member)
Row = list[bytes | None]  # the requested fields of one donor record


class DiscoveryStoreUnavailable(ConnectionError):
    """The shared store did not answer in time (or is known to be down)."""


class MalformedRecord(ValueError):
    """A record or posting read from the shared store is not what semkv writes."""


class SharedStoreConfig(BaseModel):
    """``provider_config`` keys of a provider that can keep its index in a shared store."""

    # a refused value is never echoed: a URL may carry a password by mistake
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    discovery_store: str = Field(default="memory", description=(
        "Where the discovery index lives: 'memory' (this process) or 'redis://host:port/db' "
        "(shared by every engine that names the same server and store_prefix; rediss:// for "
        "TLS, see store_tls_*)."))
    donor_ttl_s: float = Field(default=86_400.0, gt=0.0, description=(
        "Shared store: a donor not registered or found by a lookup for this long expires."))
    store_max_donors: int = Field(default=100_000, ge=1, description=(
        "Shared store: donors kept per namespace; past it the least recently used go first."))
    store_timeout_ms: float = Field(default=25.0, gt=0.0, le=60_000.0, description=(
        "Shared store: socket timeout of each of a lookup's round trips (at most three: "
        "postings, records, other engines' donors' tokens); the host's lookup_timeout_ms "
        "bounds the whole lookup."))
    store_write_timeout_ms: float = Field(default=1_000.0, gt=0.0, le=60_000.0, description=(
        "Shared store: socket timeout of registrations and evictions (off the request path)."))
    store_lookup_max_keys: int = Field(default=128, ge=2, le=100_000, description=(
        "Shared store: posting sets one lookup reads at most (a long prompt's chunks are "
        "sampled, its first ones always), so its round trip stays within store_timeout_ms."))
    store_lookup_max_members: int = Field(default=1024, ge=1, le=1_000_000, description=(
        "Shared store: posting-set members one lookup reads at most, split evenly over the "
        "sets it reads (the newest of each), so sets filled by a fleet (a system prompt every "
        "chat shares) keep its first round trip within store_timeout_ms."))
    store_lookup_max_records: int = Field(default=128, ge=1, le=100_000, description=(
        "Shared store: donor records one lookup reads at most (its second round trip): the "
        "donors found in the most of its posting sets first, then the newest."))
    store_retry_s: float = Field(default=1.0, ge=0.0, le=3_600.0, description=(
        "Shared store: after a failure, calls fail at once for this long, then retry."))
    store_prefix: str = Field(default="semkv", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description=(
        "Shared store: first part of every key (separates deployments on one server)."))
    instance_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$", description=(
        "Shared store: this engine's name in donor ids (default: random per process)."))
    store_username: str | None = Field(default=None, pattern=r"^[^\s:@/]{1,128}$", description=(
        "Shared store: the Redis ACL user to authenticate as (default: the default user)."))
    store_password_env: str | None = Field(
        default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$", description=(
            "Shared store: the NAME of the environment variable holding the password (read at "
            "start-up; the password itself never goes into the config)."))
    store_password_file: str | None = Field(default=None, min_length=1, description=(
        "Shared store: a file whose first line is the password (read at start-up)."))
    store_tls_ca_file: str | None = Field(default=None, min_length=1, description=(
        "rediss:// store: PEM file of the authority that signed the server's certificate "
        "(default: the system's authorities)."))
    store_tls_cert_file: str | None = Field(default=None, min_length=1, description=(
        "rediss:// store: PEM client certificate, for a server with tls-auth-clients yes."))
    store_tls_key_file: str | None = Field(default=None, min_length=1, description=(
        "rediss:// store: PEM key of store_tls_cert_file (default: in the certificate's file)."))
    store_tls_check_hostname: bool = Field(default=True, description=(
        "rediss:// store: the server's certificate must name the host of discovery_store."))

    @field_validator("discovery_store")
    @classmethod
    def _store_url(cls, value: str) -> str:
        if "@" in value:
            raise ValueError(
                "discovery_store must not carry credentials (a config is dumped and logged): "
                "put the user in store_username and the password in the environment variable "
                "named by store_password_env, or in the file named by store_password_file")
        if value != "memory" and not _URL.match(value):
            raise ValueError("discovery_store must be 'memory' or redis[s]://host[:port][/db]")
        return value

    @model_validator(mode="after")
    def _one_password_source(self) -> SharedStoreConfig:
        if self.store_password_env is not None and self.store_password_file is not None:
            raise ValueError("set store_password_env or store_password_file, not both")
        return self

    @model_validator(mode="after")
    def _tls_needs_rediss(self) -> SharedStoreConfig:
        tls = [name for name in ("store_tls_ca_file", "store_tls_cert_file",
                                 "store_tls_key_file") if getattr(self, name) is not None]
        if not self.store_tls_check_hostname:
            tls.append("store_tls_check_hostname")
        if tls and not self.discovery_store.startswith("rediss://"):
            raise ValueError(f"{', '.join(tls)} apply to a TLS store: discovery_store must be "
                             "rediss://host[:port][/db]")
        if self.store_tls_key_file is not None and self.store_tls_cert_file is None:
            raise ValueError("store_tls_key_file is the key of store_tls_cert_file: set both")
        return self

    @property
    def shared(self) -> bool:
        return self.discovery_store != "memory"


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as 4 bytes each (8 when one does not fit), little-endian, with a type tag."""
    code = "I" if all(0 <= t < 2**32 for t in tokens) else "q"
    packed = array(code, tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    return code.encode() + packed.tobytes()


def unpack_tokens(raw: bytes) -> tuple[int, ...]:
    """The token ids of a record ``pack_tokens`` wrote; raises ``MalformedRecord`` for any
    other bytes: a type code other than ``I`` / ``q``, a length that is not a whole number of
    items, no token, a negative id."""
    code = chr(raw[0]) if raw else ""
    width = TOKEN_WIDTHS.get(code)
    if width is None or len(raw) == 1 or (len(raw) - 1) % width:
        raise MalformedRecord("token record: not a type code I or q followed by whole items")
    packed = array(code, raw[1:])
    if sys.byteorder == "big":
        packed.byteswap()
    if code == "q" and min(packed) < 0:
        raise MalformedRecord("token record: a negative token id")
    return tuple(packed)


def count_field(raw: bytes | None) -> int:
    """A count field semkv wrote (``str(n).encode()``); ``MalformedRecord`` for anything else."""
    if raw is None or not 0 < len(raw) <= MAX_COUNT_DIGITS or not raw.isdigit():
        raise MalformedRecord("count field: not a decimal number")
    return int(raw)


def host_id_ok(donor_id: str) -> bool:
    """Can ``donor_id`` be stored (and read back unambiguously) in a shared store?"""
    return _HOST_ID.fullmatch(donor_id) is not None


class RedisStore:
    """Donor records, an LRU per namespace and posting sets of one provider in Redis.

    Thread-safe (redis-py's connection pool); every method may raise
    ``DiscoveryStoreUnavailable``.
    """

    def __init__(self, config: SharedStoreConfig, provider: str, variant: str) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise ImportError(f"discovery_store={config.discovery_store!r} needs redis-py: "
                              f"{INSTALL_HINT}") from exc
        self.config = config
        self.instance = config.instance_id or uuid.uuid4().hex[:12]
        self._base = f"{config.store_prefix}:{provider}:{variant}"
        self._errors: tuple[type[BaseException], ...] = (
            redis.ConnectionError, redis.TimeoutError, OSError)

        from semkv.store_credentials import check_at_start, client_credentials, warn_if_in_clear
        from semkv.store_tls import tls_arguments

        credentials = client_credentials(config)  # the secret: read here, kept by redis-py only
        warn_if_in_clear(config.discovery_store, config)
        tls = tls_arguments(config)  # files checked here: a bad one stops the start

        def client(timeout_ms: float, with_credentials: bool = True) -> Any:
            return redis.Redis.from_url(
                config.discovery_store, socket_timeout=timeout_ms / 1e3,
                socket_connect_timeout=timeout_ms / 1e3, retry=Retry(NoBackoff(), 0),
                health_check_interval=0, **tls, **(credentials if with_credentials else {}))

        self._read: Any = client(config.store_timeout_ms)
        self._write: Any = client(config.store_write_timeout_ms)
        check_at_start(self._write, config.discovery_store, config,
                       anonymous=lambda: client(config.store_write_timeout_ms, False))
        # NOTE: reads and writes have breakers of their own (semkv.breaker)
        self.breakers = {kind: Breaker(config.store_retry_s) for kind in ("read", "write")}
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()

    # -- names ---------------------------------------------------------------------------------
    def key(self, namespace: str, suffix: str) -> str:
        return f"{self._base}:{namespace}:{suffix}"

    def qualify(self, donor_id: str) -> str:
        if not host_id_ok(donor_id):  # NOTE: read back, it would be dropped as malformed
            raise ValueError("a donor id in a shared store is 1-128 of A-Z a-z 0-9 _ . -")
        return f"{self.instance}/{donor_id}"

    def local(self, qid: str) -> str:
        """The host's id of a stored donor: unqualified when this instance registered it."""
        own = self.instance + "/"
        return qid[len(own):] if qid.startswith(own) else qid

    def checked_id(self, member: str) -> str | None:
        """``member`` when it is a stored id of the shape ``qualify`` writes, else None
        (counted ``malformed_records``): a posting member read back is never trusted."""
        if _STORED_ID.fullmatch(member) is not None:
            return member
        self.malformed()
        return None

    def malformed(self, count: int = 1) -> None:
        """Count records or members read back and dropped as malformed."""
        self._count("malformed_records", by=count)

    def _count(self, *kinds: str, by: int = 1) -> None:
        with self._lock:
            for kind in kinds:
                self.counters[kind] += by

    def counts(self) -> dict[str, int]:
        """A copy of ``counters`` (safe while lookup and index threads count)."""
        with self._lock:
            return dict(self.counters)

    def most_found(self, sets: Sequence[Sequence[str]]) -> list[str]:
        """The ids to read records of, at most ``store_lookup_max_records``: those in the most
        of ``sets`` (each posting set a donor shares with the query is evidence of overlap),
        then the newest (sets read newest first, taken in turn)."""
        seen: dict[str, list[int]] = {}  # id -> [sets it is in, -(first turn it came up)]
        for turn in range(max((len(members) for members in sets), default=0)):
            for members in sets:
                if turn < len(members):
                    entry = seen.setdefault(members[turn], [0, -turn])
                    entry[0] += 1
        ranked = sorted(seen, key=lambda qid: (-seen[qid][0], -seen[qid][1], qid))
        return ranked[: self.config.store_lookup_max_records]

    def stored(self, donor_id: str) -> str:
        """The stored id of a host id: qualified unless it names another instance's donor.

        NOTE: host donor ids never contain ``/`` (the vLLM adapter's are ``d{n}``)."""
        return donor_id if "/" in donor_id else self.qualify(donor_id)

    # -- calls under the breaker ---------------------------------------------------------------
    def _run(self, write: bool, fill: Callable[[Any], None]) -> list[Any]:
        kind = "write" if write else "read"
        breaker = self.breakers[kind]
        if breaker.is_open():
            self._count("store_refused", f"store_{kind}_refused")
            raise DiscoveryStoreUnavailable(f"discovery store {kind}s marked down; retrying later")
        pipe = (self._write if write else self._read).pipeline(transaction=False)
        fill(pipe)
        try:
            result: list[Any] = pipe.execute()
        except self._errors as exc:
            timeout = "Timeout" in type(exc).__name__ or isinstance(exc, TimeoutError)
            self._count("store_timeouts" if timeout else "store_errors")
            with self._lock:
                breaker.fail()
            raise DiscoveryStoreUnavailable(type(exc).__name__) from exc
        if breaker.failures:
            with self._lock:
                breaker.succeed()
        return result

    def open_for(self, kind: str) -> float:
        """How long the breaker of ``kind`` stays open after its latest failure:
        ``store_retry_s``, doubled with each failure in a row (a store that stays slow costs
        one timeout per period, not one per ``store_retry_s``), at most 30 s."""
        return self.breakers[kind].open_for()

    def read(self, fill: Callable[[Any], None]) -> list[Any]:
        return self._run(False, fill)

    def write(self, fill: Callable[[Any], None]) -> list[Any]:
        return self._run(True, fill)

    # -- donors --------------------------------------------------------------------------------
    def add(self, namespace: str, qid: str, fields: dict[str, bytes], postings: list[Posting],
            cap: int) -> list[str]:
        """Store a donor and its postings; returns the stored ids pushed out by the LRU bound."""
        ttl = max(1, int(self.config.donor_ttl_s))
        now = time.time()
        lru = self.key(namespace, "lru")

        def fill(p: Any) -> None:
            record = self.key(namespace, "d:" + qid)
            p.delete(record)
            p.hset(record, mapping=fields)
            p.expire(record, ttl)
            for suffix, member in postings:
                k = self.key(namespace, suffix)
                p.zadd(k, {member: now})
                p.zremrangebyrank(k, 0, -cap - 1)
                p.expire(k, ttl)
            p.zadd(lru, {qid: now})
            p.zremrangebyscore(lru, "-inf", now - ttl)
            p.expire(lru, ttl)
            p.zcard(lru)

        size = int(self.write(fill)[-1])
        over = size - self.config.store_max_donors
        if over <= 0:
            return []
        popped = self.write(lambda p: p.zpopmin(lru, over))[0]
        self._count("store_lru_evictions", by=len(popped))
        members = [m.decode() for m, _ in popped if isinstance(m, bytes) and m.isascii()]
        if len(members) < len(popped):
            self.malformed(len(popped) - len(members))
        return [qid for qid in members if self.checked_id(qid) is not None]

    def records(self, namespace: str, qids: Sequence[str], fields: Sequence[str], *,
                touch: bool = False, refresh: Sequence[str] = ()) -> list[Row | None]:
        """Fields of each donor record (None: expired or evicted), in one round trip.

        ``touch``: the donors were found by a lookup: their records' TTL and LRU rank are
        renewed, and so is the TTL of the posting sets named in ``refresh`` (those the lookup
        found them through), so that a donor in use stays discoverable."""
        ttl = max(1, int(self.config.donor_ttl_s))
        now = time.time()

        def fill(p: Any) -> None:
            for qid in qids:
                p.hmget(self.key(namespace, "d:" + qid), list(fields))
            if touch:
                for qid in qids:
                    p.expire(self.key(namespace, "d:" + qid), ttl)
                    p.zadd(self.key(namespace, "lru"), {qid: now}, xx=True)
                for suffix in refresh:
                    p.expire(self.key(namespace, suffix), ttl)

        got = self.read(fill)[: len(qids)] if qids else []
        return [None if row[0] is None else list(row) for row in got]

    def remove(self, namespace: str, qid: str, postings: list[Posting]) -> None:
        def fill(p: Any) -> None:
            for suffix, member in postings:
                p.zrem(self.key(namespace, suffix), member)
            p.delete(self.key(namespace, "d:" + qid))
            p.zrem(self.key(namespace, "lru"), qid)

        self.write(fill)

    def postings(self, namespace: str, suffixes: Sequence[str]) -> list[list[str]]:
        """The newest members of each posting set, newest first, ``store_lookup_max_members``
        in all at most (one round trip); members that are not ASCII are dropped (counted):
        what a member holds is the provider's to check."""
        last = max(1, self.config.store_lookup_max_members // max(1, len(suffixes))) - 1

        def fill(p: Any) -> None:
            for suffix in suffixes:
                p.zrevrange(self.key(namespace, suffix), 0, last)

        rows = self.read(fill) if suffixes else []
        out = [[m.decode() for m in row if isinstance(m, bytes) and m.isascii()] for row in rows]
        dropped = sum(len(row) for row in rows) - sum(len(row) for row in out)
        if dropped:
            self.malformed(dropped)
        return out

    def close(self) -> None:
        for client in (self._read, self._write):
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a dead connection is no error
                pass


class SharedDonors:
    """The register / evict / reset / donor-tokens flow of a provider over a ``RedisStore``.

    The provider supplies ``postings_of(stored id, fields)``: the postings of a stored donor,
    from the record fields named by ``key_fields`` (e.g. the token ids), so that replacing,
    evicting or LRU-dropping a donor removes exactly what registering it added. Writes are
    serialized.
    """

    def __init__(self, store: RedisStore, key_fields: Sequence[str],
                 postings_of: Callable[[str, list[bytes | None]], list[Posting]],
                 cap: int) -> None:
        self.store = store
        self.key_fields = list(key_fields)
        self.postings_of = postings_of
        self.cap = cap
        self._own: dict[str, str] = {}  # this instance's donor id -> namespace
        self._lock = threading.Lock()

    def register(self, namespace: str, donor_id: str, fields: dict[str, bytes],
                 postings: list[Posting]) -> None:
        store = self.store
        with self._lock:
            old = self._own.pop(donor_id, None)
            if old is not None:
                self._drop(old, [store.qualify(donor_id)])
            popped = store.add(namespace, store.qualify(donor_id), fields, postings, self.cap)
            self._own[donor_id] = namespace
            if popped:
                self._drop(namespace, popped)
                for qid in popped:
                    self._own.pop(store.local(qid), None)

    def _drop(self, namespace: str, qids: list[str]) -> None:
        rows = self.store.records(namespace, qids, self.key_fields)
        for qid, row in zip(qids, rows, strict=True):
            try:
                postings = [] if row is None else self.postings_of(qid, row)
            except MalformedRecord:  # the record goes; postings it cannot name expire
                self.store.malformed()
                postings = []
            self.store.remove(namespace, qid, postings)

    def evict(self, donor_id: str) -> None:
        with self._lock:
            namespace = self._own.pop(donor_id, None)
            if namespace is not None:
                self._drop(namespace, [self.store.qualify(donor_id)])

    def reset(self) -> None:
        """Forget this instance's donors (other instances' donors stay theirs)."""
        with self._lock:
            own, self._own = self._own, {}
            for donor_id, namespace in own.items():
                self._drop(namespace, [self.store.qualify(donor_id)])

    def tokens(self, donor_id: str, namespace: str) -> tuple[int, ...] | None:
        """A stored donor's token ids; None when it is gone; ``MalformedRecord`` when its
        record is not what semkv writes (``GuardedProvider`` drops the candidate, counted)."""
        row = self.store.records(namespace, [self.store.stored(donor_id)], ["t"])[0]
        return None if row is None or row[0] is None else unpack_tokens(row[0])

    def tokens_many(self, donor_ids: Sequence[str],
                    namespace: str) -> dict[str, tuple[int, ...] | None]:
        """``tokens`` of several donors in one round trip (``DonorProvider.donors_tokens``):
        None for a donor gone, a malformed record's id left out."""
        if not donor_ids:
            return {}
        rows = self.store.records(namespace, [self.store.stored(d) for d in donor_ids], ["t"])
        out: dict[str, tuple[int, ...] | None] = {}
        for donor_id, row in zip(donor_ids, rows, strict=True):
            try:
                out[donor_id] = None if row is None or row[0] is None else unpack_tokens(row[0])
            except MalformedRecord:
                continue
        return out

    def stats(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.store.counts().items()}
        out["own_donors"] = float(len(self._own))
        out["shared_store"] = 1.0
        return out

    def close(self) -> None:
        self.store.close()
