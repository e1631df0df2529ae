"""Provider calls under a latency budget, off the caller's thread.

``GuardedProvider`` wraps any provider so that a lookup can never fail or stall a request:
- ``lookup_now`` waits at most the budget; timeout and exceptions become a typed fallback;
  ``StepBudget`` waits for several, one budget per engine step in all;
- ``submit`` starts a lookup in the background (async discovery); ``poll`` says whether it is
  done, and turns a lookup older than the budget into a timeout;
- at most ``max_in_flight`` lookups run at once: a hung provider makes later lookups fail fast
  as timeouts instead of piling up threads.
- ``register`` / ``evict`` run on a separate single background thread, in order, and their
  exceptions are counted, never raised; at most ``max_queued_writes`` wait, registrations
  past it are dropped (counted), evictions and resets never;
- a lookup first waits for the writes queued before it (it sees every donor registered
  earlier), except where the provider's index lives in a shared store: those writes are
  network round trips, and a slow store must not hold lookups back.

- donors the host never registered (``known`` says so: another engine's, found through a
  shared discovery store) get their token ids from ``provider.donors_tokens`` (all of one
  lookup's in one call: one round trip) in the same lookup thread and budget
  (``LookupResult.remote``), so the host can verify them. Those ids were read from a store
  anyone with access can write: a donor whose record is malformed, or whose ids are not all
  ints in ``[0, token_limit)`` (the model's vocabulary), is dropped with its candidate,
  counted ``malformed_records`` together with what the provider's store dropped (its
  ``stats()``).

NOTE: candidates that fail validation (bad spans, NaN similarity, wrong namespace) are dropped
and counted as provider errors; the caller only ever sees well-formed candidates.
"""

from __future__ import annotations

import operator
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from semkv.log import Throttle, get_logger
from semkv.provider import DonorProvider, DonorRecord, LookupQuery
from semkv.types import Candidate, FallbackReason

log = get_logger("semkv.lookup")


@dataclass
class LookupResult:
    candidates: list[Candidate] = field(default_factory=list)
    reason: FallbackReason | None = None  # provider_timeout / provider_error / None
    seconds: float = 0.0
    # token ids of candidates the host did not register (another engine's donors)
    remote: dict[str, tuple[int, ...]] = field(default_factory=dict)


_Found = tuple[list[Candidate], dict[str, tuple[int, ...]]]
MAX_QUEUED_WRITES = 256  # registrations past it are dropped; evictions and resets never are
TOKEN_LIMIT = 2**32  # token ids at or above it are malformed whatever the vocabulary
MALFORMED = "malformed_records"  # counter: remote donors and store records dropped


def _shared_index(provider: DonorProvider) -> bool:
    """Does the provider keep its index in a shared store (``semkv.discovery_store``)?"""
    from semkv.discovery_store import SharedStoreConfig

    return isinstance(provider.config, SharedStoreConfig) and provider.config.shared


@dataclass
class _Pending:
    future: Future[_Found]
    started: float


class GuardedProvider:
    def __init__(
        self, provider: DonorProvider, *, timeout_s: float, max_in_flight: int = 4,
        max_queued_writes: int = MAX_QUEUED_WRITES, token_limit: int = TOKEN_LIMIT,
    ) -> None:
        self.provider = provider
        self.timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._lookups = ThreadPoolExecutor(max_in_flight, thread_name_prefix="semkv-lookup")
        self._writes = ThreadPoolExecutor(1, thread_name_prefix="semkv-index")
        self._max_queued = max_queued_writes
        self._queued = 0  # writes submitted and not yet finished (under _lock)
        # A lookup sees the donors registered before it only where registering is a memory
        # operation: a shared store's writes are network round trips a lookup must not wait on.
        self._shared = _shared_index(provider)
        self._lookups_wait_writes = not self._shared
        self.token_limit = min(token_limit, TOKEN_LIMIT)  # the vocabulary: remote ids below it
        self._store_malformed = 0  # the provider's stats()[MALFORMED], read after each lookup
        self._pending: dict[str, _Pending] = {}
        self._last_write: Future[None] | None = None
        self._throttle = Throttle()  # one warning per kind of failure every 10 s
        self._lock = threading.Lock()
        # NOTE: written by the lookup and index threads, read by the scheduler's stats export:
        # only through _count and counts(), under their own lock.
        self.counters: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        # Does the host hold this donor id itself? Others' token ids come from the provider.
        self.known: Callable[[str], bool] = lambda donor_id: True

    def _count(self, kind: str) -> None:
        with self._counts_lock:
            self.counters[kind] += 1

    def counts(self) -> dict[str, int]:
        """A consistent copy of the error counters (safe while lookups run)."""
        with self._counts_lock:
            out = dict(self.counters)
            if self._store_malformed:
                out[MALFORMED] = out.get(MALFORMED, 0) + self._store_malformed
            return out

    # -- lookups ---------------------------------------------------------------------------
    def _run(self, query: LookupQuery, after: Future[None] | None) -> _Found:
        try:
            if after is not None:  # see every donor registered before this lookup was asked
                after.result(timeout=self.timeout_s)
            found = self._validated(query, self.provider.lookup(query))
            # other engines' donors: their token ids, all in one call (one round trip)
            unknown = list(dict.fromkeys(c.donor_id for c in found if not self.known(c.donor_id)))
            got = self.provider.donors_tokens(unknown, query.namespace) if unknown else {}
            asked = set(unknown)
            remote: dict[str, tuple[int, ...]] = {}
            kept: list[Candidate] = []
            for c in found:
                if c.donor_id in got or c.donor_id not in asked:
                    tokens = self._checked_tokens(got.get(c.donor_id))
                    if tokens is None:  # ids the model could not have read
                        continue
                    if tokens:
                        remote[c.donor_id] = tokens
                    kept.append(c)
                else:  # its record was malformed: dropped with its candidate
                    self._count(MALFORMED)
            if self._shared:
                self._read_store_malformed()
            return kept, remote
        finally:
            self._slots.release()

    def _checked_tokens(self, tokens: object) -> tuple[int, ...] | None:
        """Another engine's donor's token ids, checked: () when it has none (gone), None
        (counted ``malformed_records``) when they are not all ints the model could have read
        (``token_limit``)."""
        if not tokens:
            return ()
        try:
            ids = tuple(operator.index(t) for t in tokens)  # type: ignore[attr-defined]
        except TypeError:  # not integers
            ids = None
        if ids is None or not all(0 <= t < self.token_limit for t in ids):
            self._count(MALFORMED)
            return None
        return ids

    def _read_store_malformed(self) -> None:
        """What the provider's shared store dropped as malformed (lookup thread only: a
        provider's ``stats()`` may wait on its own lock, the scheduler never does)."""
        try:
            value = int(self.provider.stats().get(MALFORMED, 0))
        except Exception:  # noqa: BLE001 - stats are telemetry
            return
        with self._counts_lock:
            self._store_malformed = max(self._store_malformed, value)

    def _validated(self, query: LookupQuery, raw: object) -> list[Candidate]:
        if not isinstance(raw, list):
            raise TypeError("provider lookup must return a list of Candidate")
        good: list[Candidate] = []
        for item in raw[: query.max_candidates]:
            checked = _revalidated(item)
            ok = (
                checked is not None
                and checked.namespace == query.namespace
                and checked.target_start + checked.num_tokens <= len(query.token_ids)
            )
            if ok:
                good.append(item)
            else:
                self._count("invalid_candidates")
        return good

    def submit(self, query: LookupQuery) -> bool:
        """Start a background lookup; False when too many are in flight (counted as timeout)."""
        if not self._slots.acquire(blocking=False):
            self._count("saturated")
            return False
        after = self._last_write if self._lookups_wait_writes else None
        future = self._lookups.submit(self._run, query, after)
        with self._lock:
            self._pending[query.request_id] = _Pending(future, time.monotonic())
        return True

    def poll(self, request_id: str) -> LookupResult | None:
        """The result of a submitted lookup, or None while it may still finish in budget."""
        with self._lock:
            pending = self._pending.get(request_id)
        if pending is None:
            return LookupResult(reason=FallbackReason.PROVIDER_TIMEOUT)
        elapsed = time.monotonic() - pending.started
        if not pending.future.done():
            if elapsed < self.timeout_s:
                return None
            self.forget(request_id)
            self._count("timeouts")
            return LookupResult(reason=FallbackReason.PROVIDER_TIMEOUT, seconds=elapsed)
        self.forget(request_id)
        return self._result(pending.future, elapsed)

    def wait(self, request_id: str, seconds: float) -> LookupResult | None:
        """A submitted lookup's result, waiting at most ``seconds`` for it; None while it may
        still finish within its own budget (ask again, or ``poll``)."""
        with self._lock:
            pending = self._pending.get(request_id)
        if pending is not None and seconds > 0:
            try:
                pending.future.result(timeout=seconds)
            except FutureTimeout:
                pass
            except Exception:  # noqa: BLE001 - reported by poll
                pass
        return self.poll(request_id)

    def lookup_now(self, query: LookupQuery) -> LookupResult:
        started = time.monotonic()
        if not self.submit(query):
            return LookupResult(reason=FallbackReason.PROVIDER_TIMEOUT)
        with self._lock:
            pending = self._pending.pop(query.request_id)
        try:
            pending.future.result(timeout=self.timeout_s)
        except FutureTimeout:
            self._count("timeouts")
            return LookupResult(reason=FallbackReason.PROVIDER_TIMEOUT,
                                seconds=time.monotonic() - started)
        except Exception:  # noqa: BLE001 - reported through _result
            pass
        return self._result(pending.future, time.monotonic() - started)

    def _result(self, future: Future[_Found], seconds: float) -> LookupResult:
        error = future.exception()
        if error is not None:
            self._count("errors")
            kind = type(error).__name__
            held = self._throttle.allow(("lookup", kind))
            if held is not None:
                log.warning("provider_lookup_failed", error_type=kind, held_back=held)
            return LookupResult(reason=FallbackReason.PROVIDER_ERROR, seconds=seconds)
        candidates, remote = future.result()
        return LookupResult(candidates=candidates, seconds=seconds, remote=remote)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._pending.pop(request_id, None)

    # -- index maintenance -----------------------------------------------------------------
    def _safely(self, what: str, fn: object, *args: object) -> None:
        def run() -> None:
            try:
                fn(*args)  # type: ignore[operator]
            except Exception as exc:  # noqa: BLE001 - a provider never fails the engine
                self._count(f"{what}_errors")
                kind = type(exc).__name__
                held = self._throttle.allow((what, kind))
                if held is not None:
                    log.warning("provider_call_failed", call=what, error_type=kind,
                                held_back=held)
            finally:
                with self._lock:
                    self._queued -= 1

        with self._lock:
            self._queued += 1
        self._last_write = self._writes.submit(run)

    def register(self, donor: DonorRecord) -> None:
        """Queued; dropped (counted ``register_dropped``) while ``max_queued_writes`` wait:
        a slow index loses donors, never the engine's time or memory."""
        with self._lock:
            full = self._queued >= self._max_queued
        if full:
            self._count("register_dropped")
            return
        self._safely("register", self.provider.register_donor, donor)

    def evict(self, donor_id: str) -> None:
        self._safely("evict", self.provider.evict, donor_id)

    def reset(self) -> None:
        with self._lock:
            self._pending.clear()
        self._safely("reset", self.provider.reset)

    def flush(self) -> None:
        """Wait for queued registrations (tests and benchmarks)."""
        self._writes.submit(lambda: None).result()
        self.provider.flush()

    def close(self) -> None:
        # NOTE: no provider.reset here: a shared discovery store keeps this engine's donors
        # (their KV may live on in LMCache; TTLs expire them), and close() releases them.
        with self._lock:
            self._pending.clear()
        self._writes.shutdown(wait=True, cancel_futures=False)
        self._lookups.shutdown(wait=False, cancel_futures=True)
        try:
            self.provider.close()
        except Exception:  # noqa: BLE001
            self._count("close_errors")


class StepBudget:
    """Lookups a host waits for, at most one lookup budget per engine step in all.

    A decision needs its lookup, but a burst of new requests must not hold one step for N
    budgets (every running request's next token waits on the step). Each step's waits share
    one budget (``new_step`` starts it): a request that finds it spent is answered "not yet"
    and starts its lookup next step; one whose lookup outlives what was left keeps it running
    in the background and takes its result in a later step (``GuardedProvider.wait``), or a
    timeout once its own budget ran out.
    NOTE: a lookup refused for lack of slots (a hung provider holds them) is a timeout, never
    deferred: a request is never held back by a provider that does not answer.
    """

    def __init__(self) -> None:
        self.spent = 0.0  # seconds this step waited on lookups

    def new_step(self) -> None:
        self.spent = 0.0

    def lookup(self, guard: GuardedProvider, query: LookupQuery,
               started: bool) -> tuple[bool, LookupResult | None]:
        """(is its lookup started now, its result or None: ask again next step)."""
        left = guard.timeout_s - self.spent
        if not started:
            if left <= 0:
                return False, None
            if not guard.submit(query):
                return False, LookupResult(reason=FallbackReason.PROVIDER_TIMEOUT)
        began = time.monotonic()
        result = guard.wait(query.request_id, left)
        self.spent += time.monotonic() - began
        return True, result


def _revalidated(item: object) -> Candidate | None:
    """The candidate if it passes ``Candidate``'s own checks again, else None.

    NOTE: ``model_copy(update=...)`` and ``model_construct`` skip validation, so a provider can
    hand back negative offsets or a NaN similarity inside a real ``Candidate``; admission would
    then fail on them (a negative ``donor_start`` raised inside the engine's scheduler step).
    """
    if not isinstance(item, Candidate):
        return None
    try:
        return Candidate.model_validate(dict(item))
    except ValueError:  # pydantic's ValidationError is a ValueError
        return None
