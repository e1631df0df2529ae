"""Each request's blocks are handed back to vLLM once, after every writer is done with them.

vLLM frees a finished request's blocks (and forgets the request) at the first report naming it:
``finished_recving`` for a request that finished while waiting for remote KV, or
``finished_sending`` for one whose connector delayed the free (``request_finished`` answered
True). A second report for the same request meets ``assert req_id in self.requests`` and the
engine core dies; an early one frees blocks a writer still fills, which then belong to other
requests (wrong output, no error).

With ``donor_store: lmcache`` both reports come: LMCache delays every finished request's free
(``kv_both``) and reports it sent on a later step, whether or not semkv's worker is still
realizing or loading into that request's blocks. ``FinishOrder`` (scheduler side) rewrites the
step's ``KVConnectorOutput`` before vLLM reads it:

- a ``finished_sending`` for a request semkv still owes a ``finished_recving`` is held back;
- a ``finished_recving`` for a finished request whose shared-store save has not reported yet
  is held back;
- once both have come, the request is reported once, as received (vLLM frees a finished
  request's blocks there).

NOTE: vLLM calls the connector's ``update_connector_output`` first in
``Scheduler._update_from_kv_xfer_finished``, before it reads either set: that is what makes
the rewrite possible (checked against vLLM 0.32 and 0.33).
NOTE: with the host store alone vLLM itself keeps an aborted request's blocks until its
``finished_recving`` (``finish_requests``: ``delay_free_blocks`` for WAITING_FOR_REMOTE_KVS), and
nothing else reports it: ``owed`` alone changes nothing then.
"""

from __future__ import annotations

from typing import Any


class FinishOrder:
    def __init__(self) -> None:
        self.owed: set[str] = set()  # semkv's worker still owes these a finished_recving
        self.delayed: set[str] = set()  # finished, owed, and the shared store delays the free
        self._sent: set[str] = set()  # held finished_sending (semkv still writing)
        self._received: set[str] = set()  # held finished_recving (the save still running)

    def expect(self, request_id: str) -> None:
        """An asynchronous load or realization of this request went to the workers."""
        self.owed.add(request_id)

    def finished(self, request_id: str, *, shared_delays_free: bool) -> None:
        if shared_delays_free and request_id in self.owed:
            self.delayed.add(request_id)

    def rewrite(self, output: Any) -> None:
        """Rewrite ``output.finished_recving`` / ``finished_sending`` in place (see above)."""
        recving = set(output.finished_recving or ())
        sending = set(output.finished_sending or ())
        if not (recving or sending or self._sent or self._received):
            return
        for rid in sorted(recving & self.owed):
            self.owed.discard(rid)
            if rid in self._sent:  # the save reported first: now both are done
                self._sent.discard(rid)
                self.delayed.discard(rid)
            elif rid in self.delayed:  # finished; its save has not reported yet
                recving.discard(rid)
                self._received.add(rid)
        for rid in sorted(sending):
            if rid in self.owed:  # semkv still writes into its blocks
                sending.discard(rid)
                self._sent.add(rid)
            elif rid in self._received:  # semkv's report was held for this one
                sending.discard(rid)
                self._received.discard(rid)
                self.delayed.discard(rid)
                recving.add(rid)
        output.finished_recving = recving or None
        output.finished_sending = sending or None

    def in_flight(self) -> int:
        """Requests whose blocks are still held for a report (0 when everything is settled)."""
        return len(self.owed | self._sent | self._received)
