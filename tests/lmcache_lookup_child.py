"""LMCache's prefix lookups against a server that hangs (``python -m tests.lmcache_lookup_child
URL``), driven by the test over stdin/stdout, one JSON line per phase.

A child process because importing lmcache in the pytest process breaks vLLM engines built there
later (tests/test_engine_lmcache.py says why). It builds LMCache's own scheduler adapter (what
``LMCacheMPConnector.get_num_new_matched_tokens`` asks) against the real server, says ``ready``
and waits; the test stops the server (SIGSTOP: the process is there, nothing answers) and says
``stopped``:
- LMCache alone: a lookup polled once per 20 ms "step" for 2 s is still unanswered (its own
  limits: the heartbeat's 10 s, ``mq_timeout``'s 300 s);
- under ``LMCacheLookups`` (deadline 0.3 s, breaker 0.5 s): the first request goes on without
  LMCache at the deadline, the next one at once (breaker open).
Then the test resumes the server and says ``resumed``: once the breaker's period has passed, a
lookup is answered and closes it.
"""

from __future__ import annotations

import json
import sys
import time

STEP_S = 0.02


def main(url: str) -> None:
    import zmq
    from lmcache.integration.vllm.vllm_multi_process_adapter import (
        LMCacheMPSchedulerAdapter,
        ParallelStrategy,
    )
    from semkv_vllm.lmcache_lookup import LMCacheLookups

    from semkv.breaker import Breaker
    from semkv.metrics import CounterBag

    strategy = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1,
                                pp_size=1, n_servers=1)
    adapter = LMCacheMPSchedulerAdapter([url], zmq.Context(), "semkv-lookup-test", 32, strategy)
    tokens = list(range(1, 257))

    def ask(request_id: str):  # what LMCacheMPConnector.get_num_new_matched_tokens does
        def asked() -> int | None:
            adapter.maybe_submit_lookup_request(request_id, tokens)
            return adapter.check_lookup_result(request_id)

        return asked

    def until_answered(request_id: str, lookups: LMCacheLookups | None,
                       seconds: float) -> dict[str, object]:
        start, answer, polls = time.monotonic(), None, 0
        while answer is None and time.monotonic() - start < seconds:
            polls += 1
            answer = (lookups.found(request_id, ask(request_id)) if lookups is not None
                      else ask(request_id)())
            if answer is None:
                time.sleep(STEP_S)
        return {"answer": answer, "seconds": round(time.monotonic() - start, 3), "polls": polls}

    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "stopped"
    stats = CounterBag()
    lookups = LMCacheLookups(0.3, Breaker(0.5), stats)
    phase = {"alone": until_answered("alone", None, 2.0),
             "first": until_answered("first", lookups, 5.0),
             "next": until_answered("next", lookups, 5.0),
             "healthy": adapter.is_healthy}
    phase["counts"] = dict(stats.counters)
    print(json.dumps(phase), flush=True)
    assert sys.stdin.readline().strip() == "resumed"
    time.sleep(0.6)  # past the breaker's period: the next lookup probes the server
    after = {"probe": until_answered("probe", lookups, 5.0), "failures": lookups.breaker.failures,
             "counts": dict(stats.counters)}
    print(json.dumps(after), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
