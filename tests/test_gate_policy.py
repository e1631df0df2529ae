"""Gate policies (issue #24, item 3): model identity, the file's checks, the class gate.

No engine: the policy files are read and checked as the connector's start-up reads them; the
bundled model's folder is the real converted model (its identity, never its weights, is read).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from semkv_vllm.class_gate import ClassGate

from semkv.bundled_model import ensure_model
from semkv.config import ConfigError, SemkvConfig
from semkv.gate_policy import (
    SHIPPED,
    EngineFacts,
    PolicyError,
    check_model,
    engine_differences,
    read_policy,
    resolve_policy,
    shipped_policy,
)
from semkv.model_identity import ModelIdentityError, model_identity
from semkv.plan_class import CLASSES_VERSION, PlanClass
from semkv.realize.recompute import RecomputeKind, RecomputeStrategy
from semkv.types import FallbackReason

BUNDLED = "smollm2-135m-instruct-float32.json"


@pytest.fixture(scope="module")
def bundled_identity():  # noqa: ANN201
    return model_identity(ensure_model(), dtype="float32", kv_cache_dtype="auto")


@pytest.fixture
def policy_data() -> dict:
    return json.loads((SHIPPED / BUNDLED).read_text())


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(data))
    return path


def test_the_shipped_policy_is_the_bundled_models(bundled_identity) -> None:  # noqa: ANN001
    found = shipped_policy(bundled_identity)
    assert found is not None, f"no shipped policy for {bundled_identity.describe()}"
    policy, path = found
    assert path.name == BUNDLED
    assert policy.served_classes() == [PlanClass.ONE_DONOR_IN_ORDER,
                                       PlanClass.ONE_DONOR_REORDERED, PlanClass.MULTI_DONOR]
    assert policy.classes[PlanClass.ONE_DONOR_IN_ORDER].min_prompt_tokens == 0
    assert policy.classes[PlanClass.ONE_DONOR_REORDERED].min_prompt_tokens > 1024
    assert policy.classes[PlanClass.MULTI_DONOR].min_prompt_tokens > 1024
    assert set(policy.classes) == set(PlanClass)  # every class has a rule and a reason
    assert all(rule.reason for rule in policy.classes.values())


def test_identity_follows_content_not_folder(tmp_path: Path, bundled_identity) -> None:  # noqa: ANN001
    moved = tmp_path / "elsewhere"
    shutil.copytree(ensure_model(), moved)
    assert model_identity(moved, dtype="float32", kv_cache_dtype="auto") == bundled_identity
    config = json.loads((moved / "config.json").read_text())
    config["_name_or_path"] = "/some/other/place"  # a path is not identity
    (moved / "config.json").write_text(json.dumps(config))
    assert model_identity(moved, dtype="float32", kv_cache_dtype="auto") == bundled_identity
    # the KV dtype, the compute dtype, the config and the weights are
    assert model_identity(moved, dtype="float32", kv_cache_dtype="fp8").digest != \
        bundled_identity.digest
    assert model_identity(moved, dtype="bfloat16", kv_cache_dtype="auto").digest != \
        bundled_identity.digest
    config["rope_theta"] = float(config.get("rope_theta", 10000.0)) * 2
    (moved / "config.json").write_text(json.dumps(config))
    other_config = model_identity(moved, dtype="float32", kv_cache_dtype="auto")
    assert other_config.digest != bundled_identity.digest
    shutil.copy(ensure_model() / "config.json", moved / "config.json")
    weights = moved / "model.safetensors"
    data = bytearray(weights.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    for i in range(start, len(data), 4096):  # a fine-tune: every tensor moves, same header
        data[i] ^= 0x01
    weights.write_bytes(bytes(data))
    assert model_identity(moved, dtype="float32", kv_cache_dtype="auto").digest != \
        bundled_identity.digest


def test_identity_of_a_folder_without_weights_names_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelIdentityError, match="no weight files"):
        model_identity(tmp_path, dtype="float32", kv_cache_dtype="auto")
    with pytest.raises(ModelIdentityError, match="config.json"):
        model_identity(tmp_path / "missing", dtype="float32", kv_cache_dtype="auto")


def test_a_policy_file_round_trips(tmp_path: Path, policy_data: dict, bundled_identity) -> None:  # noqa: ANN001
    path = _write(tmp_path, policy_data)
    policy, source = resolve_policy(str(path), bundled_identity)
    assert policy is not None and source == str(path)
    assert policy.rule(PlanClass.ONE_DONOR_IN_ORDER).served  # type: ignore[union-attr]


@pytest.mark.parametrize(("edit", "field"), [
    (lambda d: d["classes"]["one_donor_in_order"].update(served="yes"),
     "classes.one_donor_in_order.served"),
    (lambda d: d["classes"]["multi_donor"].update(served=True, strategy=None),
     "classes.multi_donor"),
    (lambda d: d["classes"].update(two_donors={"served": False}), "classes.two_donors"),
    (lambda d: d["model"].pop("digest"), "model.digest"),
    (lambda d: d.update(min_samples=0), "min_samples"),
    (lambda d: d.update(surprise=1), "surprise"),
    (lambda d: d.update(classes_version=CLASSES_VERSION + 1), "classes_version"),
    (lambda d: d.update(version=0), "version"),
])
def test_a_malformed_or_stale_policy_names_the_file_and_field(
        tmp_path: Path, policy_data: dict, edit, field: str, bundled_identity) -> None:  # noqa: ANN001
    edit(policy_data)
    path = _write(tmp_path, policy_data)
    with pytest.raises(PolicyError) as err:
        resolve_policy(str(path), bundled_identity)
    assert str(path) in str(err.value) and field in str(err.value)
    assert isinstance(err.value, ConfigError)  # a start-up config error like any other


def test_not_json_and_missing_files_name_the_file(tmp_path: Path, bundled_identity) -> None:  # noqa: ANN001
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(PolicyError, match="not JSON"):
        read_policy(bad)
    with pytest.raises(PolicyError, match="cannot read"):
        resolve_policy(str(tmp_path / "absent.json"), bundled_identity)


@pytest.mark.parametrize("field", ["digest", "dtype", "kv_cache_dtype"])
def test_a_policy_for_another_model_is_refused(tmp_path: Path, policy_data: dict,
                                               field: str, bundled_identity) -> None:  # noqa: ANN001
    policy_data["model"][field] = "0" * 32 if field == "digest" else "float16"
    path = _write(tmp_path, policy_data)
    with pytest.raises(PolicyError, match=rf"model\.{field}.*another model's.*semkv calibrate"):
        check_model(read_policy(path), bundled_identity, path)


def test_auto_without_a_shipped_policy_serves_no_class(tmp_path: Path, bundled_identity,  # noqa: ANN001
                                                       caplog) -> None:  # noqa: ANN001
    import logging

    caplog.set_level(logging.INFO, logger="semkv")
    other = bundled_identity.__class__("f" * 32, "gemma3_text/Gemma3ForCausalLM", "bfloat16",
                                       "auto")
    gate = ClassGate.from_config(SemkvConfig.load({}), other)
    assert gate.policy is None and "ships no gate policy" in gate.source
    # the start-up line says it legibly (a value of 96+ characters would be redacted)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "gate_policy_none" in logged and "redacted" not in logged, logged
    for said in ("Gemma3ForCausalLM", "bfloat16", "f" * 32, "semkv calibrate --model"):
        assert said in logged, said
    engine = RecomputeStrategy()
    for cls in PlanClass:
        assert gate.strategy(cls, engine, 4096) is FallbackReason.UNCERTIFIED_CLASS


def test_the_class_gate_lays_the_classes_strategy_over_the_engines(bundled_identity) -> None:  # noqa: ANN001
    gate = ClassGate.from_config(SemkvConfig.load({}), bundled_identity)
    engine = RecomputeStrategy(RecomputeKind.BLEND, fraction=0.3, first_k=4, probe_layers=3)
    for tokens in (300, 1024, 4096):
        served = gate.strategy(PlanClass.ONE_DONOR_IN_ORDER, engine, tokens)
        assert served == RecomputeStrategy(RecomputeKind.FIRST_K_BLEND, fraction=0.15,
                                           first_k=16, probe_layers=3)
    assert gate.strategy(PlanClass.GAP_DOMINATED, engine, 4096) is (
        FallbackReason.UNCERTIFIED_CLASS)
    # reordered chunks: certified with query15 from 3,561 tokens (docs/frontier.md, 4K)
    reordered = PlanClass.ONE_DONOR_REORDERED
    assert gate.strategy(reordered, engine, 1024) is FallbackReason.UNCERTIFIED_CLASS
    assert gate.strategy(reordered, engine, 4096) == RecomputeStrategy(
        RecomputeKind.QUERY, fraction=0.15, first_k=4, probe_layers=3)
    # multi-passage RAG: certified with queryv40 from 3,933 tokens (docs/frontier.md, 4K)
    rag = PlanClass.MULTI_DONOR
    assert gate.strategy(rag, engine, 3932) is FallbackReason.UNCERTIFIED_CLASS
    assert gate.strategy(rag, engine, 4096) == RecomputeStrategy(
        RecomputeKind.QUERY_VALUED, fraction=0.4, first_k=4, probe_layers=3)
    ungated = ClassGate.from_config(SemkvConfig.load({"gate_policy": "ungated"}), None)
    assert all(ungated.strategy(c, engine, 100) == engine for c in PlanClass)


def test_a_class_certified_from_a_prompt_length_is_refused_below_it(
        tmp_path: Path, policy_data: dict, bundled_identity) -> None:  # noqa: ANN001
    """``min_prompt_tokens``: reordered chunks reach the floor at 4K, not at 1K (docs/frontier.md):
    a rule can serve a class only where it was certified."""
    rule = {"served": True, "strategy": {"strategy": "query", "fraction": 0.15},
            "min_prompt_tokens": 3561}
    data = {**policy_data, "classes": {**policy_data["classes"], "one_donor_reordered": rule}}
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(data))
    gate = ClassGate.from_config(SemkvConfig.load({"gate_policy": str(path)}), bundled_identity)
    engine = RecomputeStrategy()
    cls = PlanClass.ONE_DONOR_REORDERED
    assert gate.strategy(cls, engine, 3560) is FallbackReason.UNCERTIFIED_CLASS
    assert not gate.served(cls, 1024) and gate.served(cls, 3561)
    assert gate.strategy(cls, engine, 3561) == RecomputeStrategy(RecomputeKind.QUERY,
                                                                 fraction=0.15)
    bad = {**data, "classes": {"one_donor_reordered": {**rule, "min_prompt_tokens": -1}}}
    path.write_text(json.dumps(bad))
    with pytest.raises(PolicyError, match="min_prompt_tokens"):
        read_policy(path)


def test_the_default_config_serves_the_verified_tier_only() -> None:
    from semkv.types import QualityTier

    config = SemkvConfig.load({"semantic_mode": "materialize_semantic"})
    assert config.semantic_tiers == frozenset({QualityTier.VERIFIED})
    assert config.realize_spans and config.gate_policy == "auto"


def test_discovery_only_counts_what_the_class_gate_would_do(bundled_identity) -> None:  # noqa: ANN001
    """``SpanDecision.count_would``: the plan a realization would make from the candidates'
    tokens, its class, and whether the policy would serve it; nothing is held."""
    from types import SimpleNamespace

    from semkv_vllm.engine_support import EngineSupport
    from semkv_vllm.span_decision import SpanDecision
    from semkv_vllm.worker_capabilities import WorkerCapabilities

    from semkv.admission import DonorView
    from semkv.leases import LeaseTable
    from semkv.metrics import CounterBag
    from semkv.namespace import Namespace
    from semkv.types import Candidate

    ints = {"block_size", "tensor_parallel_size", "pipeline_parallel_size"}
    ns = Namespace(**{f: 1 if f in ints else "x" for f in Namespace.model_fields})
    doc = list(range(1000, 1640))  # 20 blocks of 32
    views = {"d": DonorView("d", ns.digest, [7] * 64 + doc, 0)}  # nothing stored: discovery
    stats = CounterBag()
    decision = SpanDecision(
        spans=None, leases=LeaseTable(), stats=stats, block_size=32,
        class_gate=ClassGate.from_config(SemkvConfig.load({}), bundled_identity),
        min_copied_tokens=SemkvConfig.load({}).verified_min_reuse_tokens, span_view=views.get,
        request_only_enforced=lambda: True, support=EngineSupport(), workers=WorkerCapabilities(),
        can_shift=True)
    cand = [Candidate(donor_id="d", namespace=ns.digest, similarity=0.9, num_tokens=704)]

    def state(tokens: list[int]) -> SimpleNamespace:
        return SimpleNamespace(namespace=ns, request=SimpleNamespace(all_token_ids=tokens))

    decision.count_would(state([9] * 96 + doc + [5] * 40), 0, cand)  # another instruction
    half = len(doc) // 2
    decision.count_would(state([9] * 96 + doc[half:] + doc[:half] + [5] * 40), 0, cand)
    assert stats.counters == {"would_realize_spans:one_donor_in_order": 1,
                                   "would_refuse_spans:one_donor_reordered": 1}


def _facts(**over: object) -> EngineFacts:
    base: dict[str, object] = {"device": "cpu", "block_size": 32, "tensor_parallel_size": 1,
                               "vllm_version": "0.32.0"}
    return EngineFacts(**{**base, **over})


def test_a_policy_measured_on_another_device_is_refused_by_name(
        tmp_path: Path, policy_data: dict, bundled_identity) -> None:  # noqa: ANN001
    """Its KL against the fp8 floor and its TTFT were measured on other kernels."""
    policy_data["engine"] = {"device": "cuda", "block_size": 16}
    path = _write(tmp_path, policy_data)
    with pytest.raises(PolicyError) as err:
        resolve_policy(str(path), bundled_identity, _facts())
    said = str(err.value)
    assert str(path) in said and "engine.device: measured with 'cuda', this engine has 'cpu'" \
        in said and "semkv calibrate" in said, said
    assert "block_size" not in said  # a warning, not a refusal
    # auto skips a shipped policy of another device: no policy, the reason says which engine
    policy, why = resolve_policy("auto", bundled_identity, _facts(device="cuda"))
    assert policy is None and "on a cuda engine" in why


def test_other_engine_differences_are_warned_about_by_name(
        tmp_path: Path, policy_data: dict, bundled_identity, caplog) -> None:  # noqa: ANN001
    import logging

    policy_data["engine"] = {"device": "cpu", "block_size": 128, "tensor_parallel_size": 1,
                             "vllm_version": "0.31.0"}
    path = _write(tmp_path, policy_data)
    with caplog.at_level(logging.WARNING, logger="semkv"):
        gate = ClassGate.from_config(SemkvConfig.load({"gate_policy": str(path)}),
                                     bundled_identity, _facts())
    assert gate.policy is not None  # applied
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert logged.count("gate_policy_engine_differs") == 2, logged
    assert "engine.block_size: measured with 128, this engine has 32" in logged
    assert "engine.vllm_version: measured with '0.31.0', this engine has '0.32.0'" in logged


def test_a_policy_without_engine_facts_applies_with_a_warning(
        tmp_path: Path, policy_data: dict, bundled_identity, caplog) -> None:  # noqa: ANN001
    import logging

    policy_data.pop("engine", None)
    path = _write(tmp_path, policy_data)
    with caplog.at_level(logging.WARNING, logger="semkv"):
        gate = ClassGate.from_config(SemkvConfig.load({"gate_policy": str(path)}),
                                     bundled_identity, _facts())
    assert gate.policy is not None
    assert "gate_policy_engine_unrecorded" in caplog.text


def test_the_shipped_policies_say_where_they_were_measured(bundled_identity) -> None:  # noqa: ANN001
    found = shipped_policy(bundled_identity, _facts())
    assert found is not None and found[0].engine is not None
    assert found[0].engine.device == "cpu"
    assert not engine_differences(found[0], _facts())[0]


def test_a_policy_is_written_whole_or_not_at_all(tmp_path: Path, policy_data: dict,
                                                 monkeypatch) -> None:  # noqa: ANN001
    """``semkv calibrate`` replaces a policy an engine may be reading: a failure half-way
    (here: the rename) leaves the old file intact and no temporary file behind."""
    import os

    from semkv.calibrate import write_policy

    path = tmp_path / "policy.json"
    old = read_policy(_write(tmp_path, policy_data))
    new = old.model_copy(update={"source": "recalibrated"})

    def fail(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        write_policy(new, path)
    assert read_policy(path) == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy.json"]
    monkeypatch.undo()
    write_policy(new, path)
    assert read_policy(path).source == "recalibrated"
