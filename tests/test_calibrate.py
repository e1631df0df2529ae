"""``semkv calibrate`` without an engine: rows -> policy, the file, the prompts file, the CLI.

The engine run is ``tests/test_engine_calibrate.py``; here synthetic frontier rows (the fields
``semkv.calibrate`` reads) check the decision rule (certified, refused by KL or by TTFT, too
few samples, the cheapest strategy, pairing with the floor's rows), that the written file reads
back through ``read_policy`` / ``check_model`` / ``ClassGate`` and is refused for another
model or a stale classes version, and that a bad prompts file is an exit-2 error naming its
line, never its text.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from semkv_vllm.bench.calibrate import (
    CalibrateError,
    Options,
    parse_engine_arg,
    rows_path,
)
from semkv_vllm.class_gate import ClassGate

from semkv.calibrate import build_policy, measure, policy_json, summary_table, write_policy
from semkv.calibrate_prompts import (
    PromptsError,
    donors_of,
    prompts_workload,
    read_prompts,
    require_targets,
)
from semkv.config import SemkvConfig
from semkv.gate_policy import PolicyError, check_model, read_policy
from semkv.model_identity import ModelIdentity
from semkv.plan_class import PlanClass
from semkv.realize.recompute import RecomputeStrategy
from semkv.types import FallbackReason

FK, BLEND = "realized:first_k16", "realized:first_k16+blend15"
ME = ModelIdentity("0123456789abcdef0123456789abcdef", "llama/LlamaForCausalLM", "float32",
                   "auto")
SEMKV = [sys.executable, "-m", "semkv.cli"]


def rows(cls: str, n: int, *, kl: float, floor: float, speedup: float = 3.0,
         recomputed: int = 20, arm: str = FK, start: int = 0, with_floor: bool = True,
         served: bool = True) -> list[dict[str, Any]]:
    """``n`` targets of ``cls``: a strategy row each and (``with_floor``) its floor row."""
    out: list[dict[str, Any]] = []
    for i in range(start, start + n):
        t = f"{cls}/{i}"
        out.append({"target": t, "arm": arm, "negative": False, "served": served,
                    "plan_class": cls, "kl_mean": kl, "speedup": speedup,
                    "recomputed": recomputed, "prompt_tokens": 1000})
        if with_floor:
            out.append({"target": t, "arm": "fp8_floor", "negative": False, "served": True,
                        "plan_class": None, "kl_mean": floor, "speedup": 9.0,
                        "recomputed": 0, "prompt_tokens": 1000})
    return out


def test_certified_refused_and_too_few_samples() -> None:
    data = (rows("one_donor_in_order", 12, kl=0.001, floor=0.002, speedup=4.0)
            + rows("one_donor_reordered", 9, kl=0.02, floor=0.002)
            + rows("multi_donor", 5, kl=0.0001, floor=0.002))
    policy = build_policy(data, ME, source="test")
    assert [c for c in PlanClass if c not in policy.classes] == []
    served = policy.classes[PlanClass.ONE_DONOR_IN_ORDER]
    assert served.served and served.strategy is not None
    assert served.strategy.model_dump(exclude_none=True) == {"strategy": "first_k",
                                                              "first_k": 16}
    assert served.measured is not None and served.measured.samples == 12
    assert served.measured.kl_mean == 0.001 and served.measured.floor_kl_mean == 0.002
    assert served.measured.ttft_speedup == 4.0 and served.measured.recomputed_share == 0.02
    assert policy.served_classes() == [PlanClass.ONE_DONOR_IN_ORDER]
    reordered = policy.classes[PlanClass.ONE_DONOR_REORDERED]
    assert not reordered.served and "above the fp8 floor's 0.0020" in reordered.reason
    few = policy.classes[PlanClass.MULTI_DONOR]  # at the floor, but 5 targets only
    assert not few.served and few.reason.startswith("too few samples (5 of 8)")
    none = policy.classes[PlanClass.GAP_DOMINATED]
    assert not none.served and none.measured is not None and none.measured.samples == 0
    assert none.reason.startswith("too few samples (0 of 8)")
    assert none.reason.endswith("no calibration target was planned in this class")
    assert few.reason.endswith("too few calibration targets were planned in this class")
    assert policy.min_samples == 8 and policy.model.digest == ME.digest


def test_a_class_whose_plans_the_engine_refused_says_so() -> None:
    refused = [{"target": f"m/{i}", "arm": arm, "negative": False, "served": False,
                "plan_class": None, "refused_class": "multi_donor",
                "refused_reason": "allocation_failed" if i < 3 else "unsupported_kv_groups",
                "kl_mean": None, "speedup": None, "recomputed": 0, "prompt_tokens": 1000}
               for i in range(5) for arm in (FK, BLEND)]
    negative = dict(refused[0], negative=True, refused_class="gap_dominated")
    policy = build_policy(refused + [negative], ME, source="test")
    rule = policy.classes[PlanClass.MULTI_DONOR]
    assert not rule.served
    assert rule.reason == ("too few samples (0 of 8): the engine refused 10 plan(s) of this "
                           "class (allocation_failed 6, unsupported_kv_groups 4)")
    # a negative target's refusal is not a reuse target's: the class was never planned
    assert policy.classes[PlanClass.GAP_DOMINATED].reason.endswith("was planned in this class")


def test_min_samples_and_min_gain_are_the_callers() -> None:
    data = rows("multi_donor", 5, kl=0.001, floor=0.002, speedup=1.1)
    slow = build_policy(data, ME, source="t", min_samples=5).classes[PlanClass.MULTI_DONOR]
    assert not slow.served and "1.10x TTFT is below the minimum gain 1.2x" in slow.reason
    ok = build_policy(data, ME, source="t", min_samples=5, min_gain=1.05)
    assert ok.classes[PlanClass.MULTI_DONOR].served
    with pytest.raises(ValueError, match="min_samples"):
        build_policy(data, ME, source="t", min_samples=0)


def test_the_cheapest_qualifying_strategy_is_certified() -> None:
    both = (rows("one_donor_in_order", 8, kl=0.0015, floor=0.002, recomputed=20)
            + rows("one_donor_in_order", 8, kl=0.0005, floor=0.002, recomputed=150, arm=BLEND,
                   with_floor=False))
    rule = build_policy(both, ME, source="t").classes[PlanClass.ONE_DONOR_IN_ORDER]
    assert rule.strategy is not None and rule.strategy.strategy == "first_k"
    # first_k16 above the floor: the dearer strategy that is at it is certified
    dear = (rows("one_donor_in_order", 8, kl=0.003, floor=0.002, recomputed=20)
            + rows("one_donor_in_order", 8, kl=0.0005, floor=0.002, recomputed=150, arm=BLEND,
                   with_floor=False))
    rule = build_policy(dear, ME, source="t").classes[PlanClass.ONE_DONOR_IN_ORDER]
    assert rule.served and rule.strategy is not None
    assert rule.strategy.strategy == "first_k_blend" and rule.strategy.fraction == 0.15
    table = summary_table(build_policy(dear, ME, source="t"), measure(dear))
    assert "| one_donor_in_order | first_k16 | 8 |" in table and "not chosen" in table
    assert "| one_donor_in_order | first_k16+blend15 | 8 |" in table and "| served |" in table


def test_samples_pair_each_strategy_row_with_the_floor_of_the_same_target() -> None:
    data = (rows("one_donor_in_order", 8, kl=0.001, floor=0.002)
            + rows("one_donor_in_order", 3, kl=0.001, floor=0.0, start=8, with_floor=False)
            + rows("one_donor_in_order", 4, kl=0.5, floor=0.002, start=20, served=False))
    data.append({"target": "other", "arm": "fp8_floor", "negative": False, "served": True,
                 "plan_class": None, "kl_mean": 0.0, "speedup": 1.0, "recomputed": 0,
                 "prompt_tokens": 1000})  # a floor row of no target of the class
    [m] = measure(data)
    assert (m.plan_class, m.strategy, m.samples) == ("one_donor_in_order", FK, 8)
    assert m.kl_mean == pytest.approx(0.001) and m.floor_kl_mean == pytest.approx(0.002)


def test_the_written_policy_round_trips_and_applies_to_its_model_only(tmp_path: Path) -> None:
    policy = build_policy(rows("one_donor_in_order", 8, kl=0.001, floor=0.002)
                          + rows("multi_donor", 8, kl=0.05, floor=0.002), ME, source="test",
                          label="unit test")
    path = tmp_path / "policy.json"
    write_policy(policy, path)
    assert path.read_text() == policy_json(policy)
    back = read_policy(path)
    assert back == policy
    check_model(back, ME, path)
    gate = ClassGate.from_config(SemkvConfig.load({"gate_policy": str(path)}), ME)
    engine = RecomputeStrategy()
    for cls in PlanClass:
        decided = gate.strategy(cls, engine, 1024)
        assert (decided is not FallbackReason.UNCERTIFIED_CLASS) == policy.classes[cls].served
    for field, other in (("model.digest", ModelIdentity("f" * 32, ME.architecture, "float32",
                                                        "auto")),
                         ("model.dtype", ModelIdentity(ME.digest, ME.architecture, "bfloat16",
                                                       "auto")),
                         ("model.kv_cache_dtype", ModelIdentity(ME.digest, ME.architecture,
                                                                "float32", "fp8"))):
        with pytest.raises(PolicyError, match=rf"{str(path)!r}: {field}: .*another model's"):
            check_model(back, other, path)
        with pytest.raises(PolicyError, match=field):
            ClassGate.from_config(SemkvConfig.load({"gate_policy": str(path)}), other)
    stale = json.loads(path.read_text())
    stale["classes_version"] = 0
    (tmp_path / "stale.json").write_text(json.dumps(stale))
    with pytest.raises(PolicyError, match=r"stale\.json.*classes_version: 0 is stale"):
        read_policy(tmp_path / "stale.json")
    broken = json.loads(path.read_text())
    del broken["classes"]["one_donor_in_order"]["strategy"]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    with pytest.raises(PolicyError, match=r"broken\.json.*classes\.one_donor_in_order"):
        read_policy(tmp_path / "broken.json")


SECRET = "the quarterly numbers of ACME"


@pytest.mark.parametrize(("line", "why"), [
    ('{"prompt": "x", ', "line 3: not JSON"),
    ('["a list"]', "line 3: not a JSON object"),
    ('{"group": "g"}', "line 3: 'prompt' must be a non-empty string"),
    ('{"prompt": "   "}', "line 3: 'prompt' must be a non-empty string"),
    ('{"prompt": "x", "grp": "g"}', "line 3: unknown key(s) ['grp']"),
    ('{"prompt": "x", "group": 7}', "line 3: 'group' must be a string"),
    ('{"prompt": "x", "id": "a"}', "line 3: 'id' repeats the id of line 1"),
])
def test_a_bad_prompts_line_is_named_never_shown(tmp_path: Path, line: str, why: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(f'{{"prompt": "{SECRET}", "id": "a"}}\n\n{line}\n')
    with pytest.raises(PromptsError) as err:
        read_prompts(path)
    assert f"prompts file {str(path)!r}: {why}" in str(err.value)
    assert SECRET not in str(err.value)


def test_donors_are_the_earlier_prompts_of_the_group(tmp_path: Path) -> None:
    lines = [{"prompt": f"p{i}", **({"group": g} if g else {})}
             for i, g in enumerate(["a", "b", None, "a", "a", None, "b"])]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    prompts = read_prompts(path)
    assert [p.id for p in prompts] == [f"line-{i}" for i in range(1, 8)]
    assert donors_of(prompts) == {"line-4": ["line-1"], "line-5": ["line-4", "line-1"],
                                  "line-6": ["line-3"], "line-7": ["line-2"]}
    assert donors_of(prompts, donors=1)["line-5"] == ["line-4"]
    wl = prompts_workload(prompts, lambda text: [len(text), 1, 2], where=str(path))
    assert wl.targets == ["line-4", "line-5", "line-6", "line-7"]
    assert wl.ids["line-1"] == [2, 1, 2] and set(wl.kind.values()) == {"prompts"}
    assert wl.donor_ids["line-5"] == ["line-4", "line-1"] and not any(wl.negative.values())
    with pytest.raises(PromptsError, match=r"too few prompts: 7 prompt\(s\), 4 with an earlier"):
        require_targets(prompts, where=str(path), min_targets=8)


def test_engine_args_and_options() -> None:
    assert parse_engine_arg("enforce_eager=false") == ("enforce_eager", False)
    assert parse_engine_arg("--max-num-batched-tokens=4096") == ("max_num_batched_tokens", 4096)
    assert parse_engine_arg("revision=main") == ("revision", "main")
    with pytest.raises(CalibrateError, match="expected KEY=VALUE"):
        parse_engine_arg("enforce_eager")
    assert rows_path(Path("out/policy.json")) == Path("out/policy.rows.json")
    with pytest.raises(CalibrateError, match="set by semkv calibrate itself"):
        Options(engine_args={"max_model_len": 9}).validate()
    with pytest.raises(CalibrateError, match="unknown or negative kind"):
        Options(kinds=("negative_unrelated",)).validate()
    with pytest.raises(CalibrateError, match="unknown strategy"):
        Options(strategies=("first_k16",)).validate()
    Options().validate()


def test_a_bundled_models_name_is_its_converted_folder_served_in_fp32(monkeypatch, tmp_path):
    import semkv.bundled_model as bundled
    from semkv.bundled_model import served_as

    made: list[str] = []

    def ensure(name: str = bundled.DEFAULT) -> Path:  # converting is measured elsewhere
        made.append(name)
        return tmp_path / name

    monkeypatch.setattr(bundled, "ensure_model", ensure)
    assert served_as("gemma3-270m") == (str(tmp_path / "gemma3-270m"), "float32")
    assert served_as(None) == (str(tmp_path / "smollm2-135m"), "float32")
    assert served_as("gemma3-270m", "bfloat16")[1] == "bfloat16"
    assert served_as("/models/x") == ("/models/x", "auto")
    assert made == ["gemma3-270m", "smollm2-135m", "gemma3-270m"]


def _calibrate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SEMKV, "calibrate", "--no-progress", *args], capture_output=True,
                          text=True, timeout=120)


def test_the_cli_refuses_bad_input_with_exit_2(tmp_path: Path) -> None:
    out = _calibrate("--prompts", str(tmp_path / "missing.jsonl"))
    assert out.returncode == 2 and "does not exist" in out.stderr, out.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text(f'{{"prompt": "{SECRET}"}}\n{{"prompt": {SECRET}}}\n')
    out = _calibrate("--prompts", str(bad))
    assert out.returncode == 2 and "line 2: not JSON" in out.stderr, out.stderr
    assert SECRET not in out.stderr + out.stdout and "Traceback" not in out.stderr
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"prompt": f"{SECRET} {i}"}) + "\n" for i in range(5)))
    out = _calibrate("--prompts", str(few))
    assert out.returncode == 2 and "too few prompts: 5 prompt(s), 4 with" in out.stderr
    assert "--min-samples 8" in out.stderr and SECRET not in out.stderr
    out = _calibrate("--strategies", "first_k16")
    assert out.returncode == 2 and "unknown strategy" in out.stderr
    out = subprocess.run([*SEMKV, "calibrate", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for option in ("--model", "--dtype", "--kv-cache-dtype", "--block-size", "--max-model-len",
                   "--kv-cache-memory-bytes", "--engine-arg", "--prompts", "--strategies",
                   "--min-samples", "--min-gain", "--out"):
        assert option in out.stdout
