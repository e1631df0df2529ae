"""A circuit breaker for calls to a server semkv does not control (Redis, LMCache).

After a failure the breaker is open for ``retry_s``, doubled with each failure in a row up to
``max_s``: a server that stays slow costs one failure per period, not one per call. While it is
open, callers do not touch the server (they fall back at once); once the period has passed the
next call probes it, and one success closes the breaker and resets the doubling.

NOTE: not thread-safe; a caller shared between threads holds its own lock around it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

MAX_RETRY_S = 30.0  # a breaker's longest open period, unless its retry_s is longer


class Breaker:
    def __init__(self, retry_s: float, max_s: float = MAX_RETRY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if retry_s < 0:
            raise ValueError(f"retry_s must be >= 0, not {retry_s}")
        self.retry_s = float(retry_s)
        self.max_s = max(float(max_s), self.retry_s)
        self.failures = 0  # in a row
        self._clock = clock
        self._open_until = 0.0

    def open_for(self) -> float:
        """How long the latest failure keeps it open: ``retry_s * 2**(failures - 1)``, at most
        ``max_s``."""
        return min(self.retry_s * 2.0 ** max(self.failures - 1, 0), self.max_s)

    def is_open(self) -> bool:
        return self._clock() < self._open_until

    def fail(self) -> None:
        self.failures += 1
        self._open_until = self._clock() + self.open_for()

    def succeed(self) -> None:
        self.failures = 0
        self._open_until = 0.0
