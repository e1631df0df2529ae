"""A realized span's lifecycle with ``donor_store: lmcache``, on the real vLLM CPU engine and a
real ``lmcache server`` (the module's own, started by ``tests.test_engine_lmcache``'s fixture).

One engine process (``tests/lmcache_lifecycle_child.py``, in-process engine stepped by hand)
serves two donors (LMCache stores them), then:

- an abort while the target's span is being realized from donors fetched out of LMCache:
  LMCache delays every finished request's free and reports it sent on a later step, semkv's
  worker reports the cancelled op received; vLLM must see one report (``finish_order.py``), or
  its engine core dies on ``assert req_id in self.requests``. Two bystanders running beside it
  answer as they did alone; the engine then realizes the same target to its end (= cold);
- a fetch that never lands (``SEMKV_FAULT_STALL_FETCHES``): ``transfer_timeout_s`` fails the
  span, vLLM recomputes it, the answer is the cold one.

After each, nothing is held: leases, pinned slots, requests awaiting a report, open ops,
unsettled lookups; the server holds none of the aborted target's prefix.

The host store's side of the same scenarios runs in ``tests/test_engine_lifecycle.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.engine_utils import essay_prompts
from tests.test_engine_lmcache import _realize_child, lmcache_url  # noqa: F401 - a fixture

pytestmark = pytest.mark.engine
DEADLINE_S = 3.0  # transfer_timeout_s of the engine (the stall phase's deadline)
NOTHING = {"leases": 0, "pinned_slots": 0, "finish_order": 0, "open_ops": 0,
           "unsettled_lookups": 0, "requests": 0, "fetches_in_flight": 0}


def _prompts(path: Path) -> None:
    from transformers import AutoTokenizer

    from semkv.bundled_model import ensure_model

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model()))
    first, second, other, a, b = essay_prompts(5, chars=2600, seed=53)
    doc1 = tokenizer(first)["input_ids"][:320]  # ten whole blocks each
    doc2 = tokenizer(second)["input_ids"][:320]
    instruction = tokenizer(other)["input_ids"][:64]
    question = tokenizer("\n\nQuestion: what do the two passages claim?\nAnswer:")["input_ids"]
    question = (tokenizer(other)["input_ids"][64:] + question)[-32:]  # one whole block
    path.write_text(json.dumps({
        "donors": [doc1 + question, doc2 + question],
        "target": instruction + doc2 + doc1 + question,
        "bystanders": [tokenizer(a)["input_ids"][:600], tokenizer(b)["input_ids"][:600]],
        "transfer_timeout_s": DEADLINE_S}))


def test_abort_mid_realization_and_stalled_fetch_with_lmcache(lmcache_url, tmp_path):  # noqa: F811
    data = tmp_path / "prompts.json"
    _prompts(data)
    r = _realize_child(None, data, tmp_path / "lifecycle.json", lmcache_url,
                       module="tests.lmcache_lifecycle_child",
                       tiny=False)  # the bundled model: its realization spans several steps
    abort, again, stall = r["abort"], r["again"], r["stall"]
    print("lmcache lifecycle:", json.dumps({  # counts only (shown with pytest -rA)
        "abort": {k: abort[k] for k in ("realizing_at_abort", "cancelled_next_step", "delta",
                                        "held", "stored_target_tokens")},
        "again": again["semkv"]["provenance"],
        "stall": {k: stall[k] for k in ("open_seconds", "delta", "held")},
        "stall_summary": {k: stall["semkv"][k] for k in ("provenance", "fallback_reason")},
        "after_stall": {"summary": r["after_stall"]["semkv"],
                        "delta": r["after_stall"]["delta"], "held": r["after_stall"]["held"]}}))
    assert r["worker_deadline_s"] == DEADLINE_S  # transfer_timeout_s reached the worker

    # (a) Aborted while its span was being realized (fetches landed): cancelled at the next
    # step, reported once (the engine core lives on), nothing of it loaded or stored
    assert abort["realizing_at_abort"] and abort["cancelled_next_step"], abort
    assert abort["delta"].get("vllm:semkv_transfers_cancelled", 0) == 1, abort["delta"]
    assert abort["delta"].get("vllm:semkv_loaded_tokens", 0) == 0, abort["delta"]
    assert abort["delta"].get("vllm:semkv_fetched_blocks:landed", 0) >= 20, abort["delta"]
    assert abort["bystanders"] == r["bystanders_alone"]
    assert abort["held"] == NOTHING, abort["held"]
    assert abort["stored_target_tokens"] == 0
    # ... and the engine keeps serving: the same target realized to its end equals cold
    assert again["semkv"]["provenance"] == "request_only_semantic_reuse", again["semkv"]
    assert again["tokens"] == r["cold"]
    assert r["again_held"] == NOTHING, r["again_held"]

    # (b) A retrieve that never lands: the deadline fails the span, vLLM recomputes it
    summary = stall["semkv"]
    assert summary["fallback_reason"] == "load_failed", summary
    assert summary["provenance"] != "request_only_semantic_reuse", summary
    assert stall["delta"].get("vllm:semkv_transfer_timeouts", 0) == 1, stall["delta"]
    assert DEADLINE_S <= stall["open_seconds"] < DEADLINE_S + 10, stall["open_seconds"]
    assert stall["tokens"] == r["cold"]
    held = {k: v for k, v in stall["held"].items() if k != "fetches_in_flight"}
    assert held == {k: v for k, v in NOTHING.items() if k != "fetches_in_flight"}, held
    # ... and once LMCache's reports come through again, the stalled retrieves unfence their
    # slots: the same target is realized again (none of its fetches waits behind them)
    after = r["after_stall"]
    assert after["semkv"]["provenance"] == "request_only_semantic_reuse", after["semkv"]
    assert after["delta"].get("vllm:semkv_transfer_timeouts", 0) == 0, after["delta"]
    assert after["held"] == NOTHING, after["held"]

    # (c) A reset while the realized target decodes: it stays request-only (LMCache stores
    # none of it, not even the blocks completed after the reset)
    reset = r["reset"]
    assert reset["semkv"]["provenance"] == "request_only_semantic_reuse", reset["semkv"]
    assert reset["stored_target_tokens"] == 0, reset
    # ... and the server's clear dropped every donor: no read lock of any phase was left
    assert reset["stored_donor_tokens"] == [0] * len(reset["stored_donor_tokens"]), reset
    assert reset["held"] == NOTHING, reset["held"]
