"""One in-process vLLM engine for the LMCache lifecycle tests
(``python -m tests.lmcache_lifecycle_child IN OUT LMCACHE_URL``).

IN is JSON: ``{"donors": [[ids]...], "target": [ids], "bystanders": [[ids], [ids]],
"transfer_timeout_s": s}``; OUT gets greedy token ids, semkv summaries, counter deltas and what
is still held after each phase (no text). ``donor_store: lmcache``, realized spans, verified
tier, no discovery store: this process serves the donors itself (LMCache stores their chunks),
and every realized span fetches them back out of the server into its host slots.

The engine is stepped by hand (``LLMEngine.add_request`` / ``step`` / ``abort_request``), every
loop bounded in steps and in seconds (a hang fails the test instead of stalling it):

- references: the target cold (lookup and saving off), the two bystanders alone;
- ``abort``: the bystanders, then the target with everything recomputed (slow, equals cold);
  once the worker realizes it (its fetches landed) it is aborted; then the target again,
  realized to its end;
- ``stall``: the target while the worker never sees a retrieve finish
  (``SEMKV_FAULT_STALL_FETCHES``): ``transfer_timeout_s`` after the op arrived it is reported
  invalid, vLLM recomputes it; then the target again, served;
- ``reset``: the target realized and reset (``reset_connector=True``) while it decodes: it
  stays request-only, so LMCache never stores any of it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tests.lmcache_realize_child import STORE_BYTES, _stored_prefix, _wait_stored

EVERYTHING = {"strategy": "blend", "fraction": 1.0}  # a realization that equals cold, and is slow
OUT_OF_IT = {"lookup": False, "save": False}  # never a donor, never served, never stored
STALL = "SEMKV_FAULT_STALL_FETCHES"
PHASE_SECONDS = 240.0  # any one loop; a phase past it fails (never hangs)


def lifecycle_config(url: str, timeout_s: float) -> dict[str, Any]:
    return {"provider": "chunks", "semantic_mode": "materialize_semantic",
            "semantic_tiers": ["verified"], "realize_spans": True,
            "gate_policy": "ungated", "realize_min_gain": 0.0, "min_reuse_tokens": 64,  # mechanics
            "verified_min_reuse_tokens": 64, "donor_store_bytes": STORE_BYTES,
            "request_options": True, "request_overrides": ["recompute"],
            "donor_store": "lmcache", "lmcache_server_url": url,
            "lookup_timeout_ms": 2000, "transfer_timeout_s": timeout_s}


class Stepper:
    """Adds requests, steps the engine by hand, keeps each request's last output."""

    def __init__(self, llm: Any) -> None:
        self.engine = llm.llm_engine
        self.outputs: dict[str, Any] = {}
        self.internal: dict[str, str] = {}

    def add(self, name: str, ids: list[int], max_tokens: int = 8, **options: Any) -> None:
        from vllm import SamplingParams

        from semkv.request_options import request_params

        extra = {"kv_transfer_params": request_params(**options)} if options else None
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args=extra)
        self.internal[name] = self.engine.add_request(name, {"prompt_token_ids": ids}, sp)

    def step(self) -> None:
        for out in self.engine.step():
            self.outputs[out.request_id] = out

    def until(self, done: Any, what: str, limit: int = 3000,
              seconds: float = PHASE_SECONDS) -> None:
        deadline = time.monotonic() + seconds
        for _ in range(limit):
            if done():
                return
            if time.monotonic() > deadline:
                break
            self.step()
        raise TimeoutError(f"{what}: not within {limit} steps / {seconds:.0f} s")

    def drain(self, what: str = "the requests never finished") -> None:
        self.until(lambda: not self.engine.has_unfinished_requests(), what)

    def result(self, name: str) -> dict[str, Any]:
        out = self.outputs[name]
        return {"tokens": list(out.outputs[0].token_ids),
                "semkv": (out.kv_transfer_params or {}).get("semkv")}


def _sides(llm: Any) -> tuple[Any, Any, Any]:
    """(vLLM's scheduler, semkv's scheduler side, semkv's worker side) of this process."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    sched = llm.llm_engine.engine_core.engine_core.scheduler
    return sched, sched.connector._scheduler, get_kv_transfer_group()._worker


def _settle(llm: Any) -> None:
    """Step until vLLM holds no request, not even one whose free LMCache delayed."""
    sched = _sides(llm)[0]
    Stepper(llm).until(lambda: not sched.has_requests(), "delayed frees never landed")


def _forget(llm: Any) -> None:
    """vLLM's prefix cache emptied (LMCache's and semkv's state kept)."""
    from tests.engine_utils import settled_reset

    settled_reset(llm)


def _held(llm: Any) -> dict[str, int]:
    """What should be back to zero once everything has finished."""
    _settle(llm)
    _, side, worker = _sides(llm)
    return {"leases": side.leases.live_count(), "pinned_slots": side.index.pinned_slots(),
            "finish_order": side.finish_order.in_flight(), "open_ops": len(worker.spans),
            "unsettled_lookups": side.fetch_lookups.unsettled, "requests": len(side.requests),
            "fetches_in_flight": len(worker.fetcher._in_flight) + len(worker.fetcher._queued)}


def _delta(llm: Any, before: dict[str, float]) -> dict[str, float]:
    from tests.engine_utils import semkv_metrics

    after = semkv_metrics(llm)
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def _abort(llm: Any, target: list[int], bystanders: list[list[int]]) -> dict[str, Any]:
    from tests.engine_utils import semkv_metrics

    _, _, worker = _sides(llm)
    spans = worker.spans
    before = semkv_metrics(llm)
    s = Stepper(llm)
    for i, ids in enumerate(bystanders):
        s.add(f"b{i}", ids, max_tokens=48, **OUT_OF_IT)
    s.step()  # the bystanders' prefill: every later step is busy (the realization goes slowly)
    s.add("t", target, recompute=EVERYTHING)
    rid = s.internal["t"]
    s.until(lambda: rid in spans._open and rid not in spans._awaiting,
            "the target's fetches never landed")
    s.step()
    realizing = rid in spans._open
    s.engine.abort_request(["t"])
    s.step()  # the worker sees the abort: cancelled, reported, vLLM frees its blocks once
    cancelled = rid not in spans._open
    s.drain()
    time.sleep(1.0)  # what LMCache would store lands after the forward
    return {"realizing_at_abort": realizing, "cancelled_next_step": cancelled,
            "bystanders": [s.result(f"b{i}")["tokens"] for i in range(len(bystanders))],
            "target_finished": "t" in s.outputs and s.outputs["t"].finished,
            "delta": _delta(llm, before), "held": _held(llm),
            "stored_target_tokens": _stored_prefix(llm, target)}


def _stall(llm: Any, target: list[int]) -> dict[str, Any]:
    from tests.engine_utils import semkv_metrics

    spans = _sides(llm)[2].spans
    before = semkv_metrics(llm)
    s = Stepper(llm)
    bound = min(20 * spans.timeout_s + 60.0, 120.0)  # no deadline: fail here, never hang
    times: dict[str, float] = {}

    def failed() -> bool:  # when the op reached the worker, when it stopped waiting for it
        now, rid = time.monotonic(), s.internal["stalled"]
        if rid in spans._open:
            times.setdefault("open", spans._open[rid][1] - spans.timeout_s)
        elif "open" in times:
            times.setdefault("closed", now)
        return "closed" in times

    os.environ[STALL] = "1"  # read on every poll of the worker's fetcher
    try:
        s.add("stalled", target)
        s.until(failed, "the stalled fetch was never failed (no deadline?)", seconds=bound)
    finally:
        os.environ.pop(STALL, None)
    s.drain()
    return {**s.result("stalled"), "open_seconds": times["closed"] - times["open"],
            "delta": _delta(llm, before), "held": _held(llm)}


def main(in_file: str, out_file: str, url: str) -> None:
    from tests.engine_utils import engine, semkv_metrics

    data = json.loads(Path(in_file).read_text())
    target, bystanders = data["target"], data["bystanders"]
    result: dict[str, Any] = {}
    with engine(lifecycle_config(url, data["transfer_timeout_s"]),
                scheduler_cls="semkv_vllm.commit_policy.CommitPolicyScheduler") as llm:
        _, _, worker = _sides(llm)
        result["worker_deadline_s"] = worker.spans.timeout_s
        ref = Stepper(llm)  # references, each alone, stepped as later
        ref.add("cold", target, **OUT_OF_IT)
        ref.drain()
        for i, ids in enumerate(bystanders):
            ref.add(f"b{i}", ids, max_tokens=48, **OUT_OF_IT)
        ref.drain()
        result["cold"] = ref.result("cold")["tokens"]
        result["bystanders_alone"] = [ref.result(f"b{i}")["tokens"]
                                      for i in range(len(bystanders))]
        _forget(llm)
        donors = Stepper(llm)
        for i, ids in enumerate(data["donors"]):
            donors.add(f"d{i}", ids, max_tokens=1)
            donors.drain()
            _wait_stored(llm, ids)
        # Every phase but the stall runs under generous deadlines (the worker's ops and the
        # scheduler's donor lookups): an abort or a reset is tested there, not a timeout on
        # a loaded machine.
        _deadlines(llm, PHASE_SECONDS)
        result["abort"] = _abort(llm, target, bystanders)
        again = Stepper(llm)  # the engine keeps serving: the target realized to its end
        again.add("again", target, recompute=EVERYTHING)
        again.drain()
        result["again"] = again.result("again")
        result["again_held"] = _held(llm)
        _deadlines(llm, result["worker_deadline_s"])  # transfer_timeout_s again
        _forget(llm)
        result["stall"] = _stall(llm, target)
        _deadlines(llm, PHASE_SECONDS)
        _forget(llm)
        before = semkv_metrics(llm)
        after = Stepper(llm)  # the stall over: served again (recorded, see the test)
        after.add("after", target)
        after.drain()
        result["after_stall"] = {**after.result("after"), "held": _held(llm),
                                 "delta": _delta(llm, before)}
        _forget(llm)
        result["reset"] = _reset_while_decoding(llm, target, data["donors"])  # clears the server
    Path(out_file).write_text(json.dumps(result))


def _deadlines(llm: Any, seconds: float) -> None:
    """Set every deadline ``transfer_timeout_s`` configured, on both sides, to ``seconds``."""
    _, side, worker = _sides(llm)
    worker.spans.timeout_s = seconds
    if worker.fetcher is not None:
        worker.fetcher.timeout_s = seconds
    if side.fetches is not None:
        side.fetches.timeout_s = seconds
    if side.fetch_lookups is not None:
        side.fetch_lookups.timeout_s = seconds


def _reset_while_decoding(llm: Any, target: list[int],
                          donors: list[list[int]]) -> dict[str, Any]:
    """The target realized, then ``reset_prefix_cache(reset_connector=True)`` while it decodes
    (past two block boundaries, so LMCache is offered blocks to store after the reset).

    The reset also clears the server, which keeps only what a read or write lock protects:
    donors still held there afterwards would mean a lookup lock semkv never released."""
    from tests.engine_utils import BLOCK

    s = Stepper(llm)
    s.add("decoding", target, max_tokens=2 * BLOCK + 8)
    s.until(lambda: "decoding" in s.outputs and len(s.outputs["decoding"].outputs[0].token_ids)
            >= 2, "the realized target never decoded")
    reset = llm.llm_engine.reset_prefix_cache(reset_connector=True)
    s.drain()
    _settle(llm)
    return {**s.result("decoding"), "reset_ok": reset, "held": _held(llm),
            "stored_target_tokens": _stored_prefix(llm, target),
            "stored_donor_tokens": [_stored_prefix(llm, d) for d in donors]}


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler is reachable from here
    os.environ.setdefault("SEMKV_ALLOW_FAULT_INJECTION", "1")
    main(*sys.argv[1:4])
