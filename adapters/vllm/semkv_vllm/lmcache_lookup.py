"""A deadline and a breaker on LMCache's prefix lookups (``donor_store: lmcache``), scheduler side.

LMCache (0.5.6, multiprocess mode) looks a prompt up asynchronously: its connector's
``get_num_new_matched_tokens`` sends the lookup and answers None until the server has answered;
vLLM asks again at its next step and the request waits meanwhile. LMCache's own limits are
wide: a lookup is given up after ``lmcache.mp.mq_timeout`` (300 s by default), and a server
counts as down once a heartbeat ping (every 10 s, 10 s to answer) goes unanswered. A server that
hangs or crawls would hold every new request that long.

semkv bounds the wait, per request:
- a request whose lookup LMCache has not answered within ``lmcache_lookup_timeout_ms`` of the
  first ask goes on without LMCache (0 tokens from it; semkv's own decision follows as for any
  miss), counted ``lookup_errors{kind="lmcache_timeout"}``;
- each such timeout opens a breaker (``semkv.breaker``) for ``lmcache_retry_s``, doubled with
  each timeout in a row up to 30 s: while it is open a lookup LMCache cannot answer at once is
  not waited for (``lookup_errors{kind="lmcache_breaker_open"}``); after the period the next
  request waits again (up to the deadline), and the first answer closes it.

NOTE: LMCache is still asked about every request, even with the breaker open: it tracks a
request's blocks for its saves from that first ask on. The one asked is answered once: a request
given up on stays without LMCache until it finishes (never 0 now and a hit a step later).
NOTE: a lookup given up on leaves its chunks' read locks to the server's lock TTL, as LMCache's
own timeout does; it is handed 0 external tokens at allocation, which closes its lookup.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from semkv.breaker import Breaker
from semkv.metrics import CounterBag

TIMEOUT = "lmcache_timeout"  # lookup_errors kinds
BREAKER_OPEN = "lmcache_breaker_open"


class LMCacheLookups:
    def __init__(self, timeout_s: float, breaker: Breaker, stats: CounterBag,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.breaker = breaker
        self.stats = stats
        self._clock = clock
        self._waiting: dict[str, float] = {}  # request id -> when LMCache was first asked
        self._given_up: set[str] = set()

    def found(self, request_id: str, ask: Callable[[], int | None]) -> int | None:
        """Tokens LMCache holds for the request (``ask`` asks it), 0 once not worth waiting
        for, or None: not answered yet, ask again next step."""
        if request_id in self._given_up:
            return 0
        answer = ask()
        if answer is not None:
            self._waiting.pop(request_id, None)
            self.breaker.succeed()
            return int(answer)
        if self.breaker.is_open():
            return self._give_up(request_id, BREAKER_OPEN)
        now = self._clock()
        if now - self._waiting.setdefault(request_id, now) >= self.timeout_s:
            self.breaker.fail()
            return self._give_up(request_id, TIMEOUT)
        return None

    def _give_up(self, request_id: str, kind: str) -> int:
        self._waiting.pop(request_id, None)
        self._given_up.add(request_id)
        self.stats.inc("lookup_errors", kind)
        return 0

    def forget(self, request_id: str) -> None:
        """The request finished: its bookkeeping goes."""
        self._waiting.pop(request_id, None)
        self._given_up.discard(request_id)
