"""``semkv bench`` end to end on the real vLLM CPU engine, on a very small config.

The bench runs in a subprocess (it switches vLLM to in-process engines through environment
variables, which must not leak into other test modules), on the tiny random-weight Llama of
tests/tiny_engine_model.py (``--model``, a folder: the mechanism, not the model's quality). The
config is the quick preset's machinery with fewer arms and shorter prompts so it fits the CI
budget; the checks are on the JSON: every field present, and values that could be wrong (hits
confirmed by loaded tokens, exact-tier outputs identical to vLLM's own prefix hit, the
wrong-donor control damaging output).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_engine_model import tiny_model_dir

pytestmark = pytest.mark.engine

ARMS = ["disabled", "materialize_exact:chunks", "wrong_donor"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "semkv.cli", "bench", "--preset", "quick", "--model",
           str(tiny_model_dir()), "--dtype", "float32", "--arms", *ARMS,
           "--kinds", "exact_control", "partial_overlap", "negative_unrelated",
           "--target-tokens", "256", "--max-tokens", "8", "--no-progress", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "bench.md").read_text().startswith("Preset `quick`")
    for png in ("ttft_by_length.png", "quality_vs_reuse.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads((out / "bench.json").read_text())


def test_every_arm_reports_speed_reuse_and_quality(bench: dict) -> None:
    assert list(bench["arms"]) == ARMS
    for name, arm in bench["arms"].items():
        for key in ("ttft_s", "e2e_s"):
            p = arm[key]
            assert 0 < p["p50"] <= p["p95"] <= p["p99"], (name, key, p)
        for key in ("throughput_tok_s", "speedup_overall", "hit_rate", "external_tokens",
                    "loaded_tokens", "fallback_reasons", "lookup_ms", "semkv_ms_per_request",
                    "donor_store_bytes", "false_positive_rate", "quality_by_kind"):
            assert key in arm, (name, key)
        assert arm["throughput_tok_s"] > 0
    base = bench["arms"]["disabled"]
    assert base["hits"] == 0 and base["loaded_tokens"] == 0
    assert base["vllm_prefix_hit"]["ttft_s"]["p50"] > 0
    assert base["fallback_reasons"] == {"provider_disabled": base["targets"]}


def test_exact_hits_are_engine_confirmed_and_identical_to_vllm_hits(bench: dict) -> None:
    exact = bench["arms"]["materialize_exact:chunks"]
    rows = [r for r in bench["rows"] if r["arm"] == "materialize_exact:chunks"]
    hits = [r for r in rows if r["hit"]]
    # exact_control and partial_overlap share a whole-block prefix with their donor
    assert {r["kind"] for r in hits} >= {"exact_control", "partial_overlap"}
    assert all(r["loaded_tokens"] == r["external_tokens"] > 0 for r in hits)
    assert not any(r["hit"] for r in rows if r["negative"])
    assert exact["loaded_tokens"] == sum(r["loaded_tokens"] for r in rows)
    assert exact["speedup_hit_only"] is not None and exact["speedup_hit_only"] > 0
    assert exact["miss"]["same_as_cold_rate"] == 1.0
    target = bench["targets"]["exact_tier"]  # exact hits of every arm (wrong_donor's included)
    every = [r for r in bench["rows"] if r["hit"] and r["tier"] == "exact"]
    assert target["exact_hits"] == len(every) >= len(hits)
    assert target["identical_to_vllm_hit"] == len(every)
    for r in hits:  # exact reuse: the cold answer is exactly as likely as on the cold run
        assert abs(r["logprob_delta"]) < 1e-3, r["logprob_delta"]
    assert 0.0 <= exact["quality_by_kind"]["exact_control"]["rouge_l_median"] <= 1.0


def test_wrong_donor_control_shows_damage(bench: dict) -> None:
    rows = [r for r in bench["rows"] if r["arm"] == "wrong_donor"]
    assert rows and all(r["negative"] for r in rows)
    # exact hits on a shared chat-template prefix are the target's own KV; the rest is forced
    forced = [r for r in rows if r["hit"] and r["tier"] != "exact"]
    assert forced, [(r["fallback_reason"], r["tier"]) for r in rows]
    assert all(r["tier"] == "semantic" and r["false_positive"] for r in forced)
    wd = bench["targets"]["wrong_donor"]
    assert wd["forced_through"] == len(forced)
    assert wd["damage_detected"], wd
    assert bench["arms"]["wrong_donor"]["false_positive_rate"] > 0


def test_rows_carry_no_text_or_token_ids(bench: dict) -> None:
    for row in bench["rows"]:
        for value in row.values():
            assert not isinstance(value, list | dict), row
            assert not (isinstance(value, str) and len(value) > 64), row
    assert Path(bench["plots"][0]).name == "ttft_by_length.png"
