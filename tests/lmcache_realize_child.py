"""One vLLM process of the cross-replica realization test
(``python -m tests.lmcache_realize_child ROLE IN OUT [LMCACHE_URL REDIS_URL]``).

IN is JSON: ``{"donors": [[ids]...], "target": [ids], "evicted": [ids]}``; OUT gets greedy
token ids, semkv summaries and counters (no text, nothing printed). Every role runs the
verified tier with realized spans (commit-policy scheduler, default recompute strategy).

Roles:
- ``donor``: ``donor_store: lmcache`` + a shared discovery store: serves the donors (LMCache
  stores their chunks, Redis their registrations) and nothing else.
- ``realize``: the same stores, another process: serves the target, whose span is planned from
  the first process's donors and realized from their KV fetched out of LMCache; then the target
  again, and cold (lookup and saving off); after each, how much of the target's prefix the
  LMCache server holds (neither a request-only span's KV nor an opted-out request's may enter);
  then the server is cleared and another target of the same donors served (their KV gone:
  donor_stale), and that target cold.
- ``host``: the single-instance reference, ``donor_store: host``: serves the donors, then the
  target, realized from its own host store.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

STORE_BYTES = 128 * 2**20  # host slots: the fetched donors (or the host store's donors)


def realize_config(role: str, url: str | None, redis_url: str | None) -> dict[str, Any]:
    from tests.redis_utils import store_auth

    config: dict[str, Any] = {
        "provider": "chunks", "semantic_mode": "materialize_semantic",
        "semantic_tiers": ["verified"], "realize_spans": True,
        "gate_policy": "ungated", "realize_min_gain": 0.0, "min_reuse_tokens": 64,  # mechanics
        "verified_min_reuse_tokens": 64, "donor_store_bytes": STORE_BYTES,
        "request_options": True}
    if role != "host":
        config.update({"donor_store": "lmcache", "lmcache_server_url": url,
                       "lookup_timeout_ms": 2000,
                       "provider_config": {"discovery_store": redis_url, "instance_id": role,
                                           **store_auth()}})
    return config


def _generate(llm: Any, ids: list[int], max_tokens: int = 16, **options: Any) -> dict[str, Any]:
    """One greedy request; ``options`` are its semkv request options."""
    from vllm import SamplingParams

    from semkv.request_options import request_params

    extra = {"kv_transfer_params": request_params(**options)} if options else None
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                        extra_args=extra)
    out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
    return {"tokens": list(out.outputs[0].token_ids),
            "semkv": (out.kv_transfer_params or {}).get("semkv")}


def _stored_prefix(llm: Any, ids: list[int]) -> int:
    """Tokens of ``ids``' prefix the LMCache server holds (the engine's own lookup keys)."""
    core = llm.llm_engine.engine_core.engine_core  # in-process engine (see __main__)
    adapter = core.scheduler.connector._shared.scheduler_adapter
    probe = f"probe-{time.monotonic_ns()}"
    adapter.maybe_submit_lookup_request(probe, list(ids))
    found = None
    for _ in range(400):
        found = adapter.check_lookup_result(probe)
        if found is not None:
            break
        time.sleep(0.05)
    if found:  # the lookup locked what it found; nothing will retrieve it
        adapter.free_lookup_locks(list(ids), 0, int(found), probe)
    adapter.end_session(probe)
    adapter.cleanup_lookup_result(probe)
    return int(found or 0)


def _wait_stored(llm: Any, ids: list[int], seconds: float = 60.0) -> None:
    """Until the server holds every whole chunk of ``ids`` (stores land after the forward)."""
    whole = len(ids) - len(ids) % 32
    deadline = time.monotonic() + seconds
    while _stored_prefix(llm, ids) < whole:
        if time.monotonic() > deadline:
            raise TimeoutError("the LMCache server never held the donor's chunks")
        time.sleep(0.2)


def main(role: str, in_file: str, out_file: str, url: str | None = None,
         redis_url: str | None = None) -> None:
    from tests.engine_utils import engine, semkv_metrics, settled_reset

    data = json.loads(Path(in_file).read_text())
    result: dict[str, Any] = {"role": role}
    with engine(realize_config(role, url, redis_url),
                scheduler_cls="semkv_vllm.commit_policy.CommitPolicyScheduler") as llm:
        if role in ("donor", "host"):
            for ids in data["donors"]:
                _generate(llm, ids, max_tokens=1)
                if role == "donor":
                    _wait_stored(llm, ids)
        if role in ("realize", "host"):
            result["target"] = _generate(llm, data["target"])
        if role == "realize":
            settled_reset(llm)  # vLLM forgets; what LMCache holds stays
            result["again"] = _generate(llm, data["target"])
            time.sleep(1.0)  # what LMCache would store lands after the forward
            result["stored_after_realized"] = _stored_prefix(llm, data["target"])
            result["cold"] = _generate(llm, data["target"], lookup=False, save=False)
            time.sleep(1.0)
            result["stored_after_opted_out"] = _stored_prefix(llm, data["target"])
            # The server drops what no request holds (the donors' chunks too); Redis still
            # names the donors: a new target's fetch finds nothing, normal prefill. (A new
            # target: vLLM's own reset waits for LMCache's delayed frees of the cold run.)
            llm.reset_prefix_cache(reset_connector=True)
            result["evicted"] = _generate(llm, data["evicted"])
            result["evicted_cold"] = _generate(llm, data["evicted"], lookup=False, save=False)
        result["metrics"] = semkv_metrics(llm)
    Path(out_file).write_text(json.dumps(result))


if __name__ == "__main__":
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler is reachable from here
    main(*sys.argv[1:6])
