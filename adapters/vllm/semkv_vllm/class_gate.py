"""The gate policy by plan class, on the engine (issue #24, item 3).

Built once by the connector's scheduler side from the ``gate_policy`` key
(``semkv.gate_policy.resolve_policy``) and the engine's model identity: the model folder vLLM
loads (a Hugging Face id resolves to its local snapshot), the dtype and the KV-cache dtype.

``ClassGate.strategy(cls, engine, prompt_tokens)`` is what ``SpanAdmission.plan`` asks for each
plan:

- the policy serves ``cls`` at this prompt length (``min_prompt_tokens``): the engine's strategy
  with the class's strategy laid over it;
- it does not, or there is no policy for this model: ``uncertified_class`` (counted by the
  caller, ``realize_refused{reason=class}``);
- ``gate_policy: ungated``: the engine's strategy, every class.

NOTE: a ``gate_policy`` file that does not parse, is stale, names another model or was measured
on another device raises ``PolicyError`` here, at start-up, naming the file and the field; its
other engine facts (block size, tensor parallelism, vLLM version) are warned about by name.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from semkv.config import SemkvConfig
from semkv.gate_policy import (
    UNGATED,
    EngineFacts,
    GatePolicy,
    engine_differences,
    resolve_policy,
)
from semkv.log import MAX_STRING, get_logger
from semkv.model_identity import ModelIdentity, ModelIdentityError, model_folder, model_identity
from semkv.plan_class import PlanClass
from semkv.realize.recompute import RecomputeStrategy
from semkv.types import FallbackReason
from semkv_vllm.namespace import dtype_name

log = get_logger("semkv.vllm.class_gate")


def engine_identity(vllm_config: Any) -> ModelIdentity | None:
    """The identity of the model this engine serves (None: its folder cannot be read)."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    folder = model_folder(str(mc.model), getattr(mc, "revision", None))
    if folder is None:
        return None
    try:
        return model_identity(folder, dtype=str(dtype_name(mc.dtype)),
                              kv_cache_dtype=str(dtype_name(cc.cache_dtype)))
    except ModelIdentityError as exc:
        log.warning("gate_policy_no_model_identity", why=str(exc)[: MAX_STRING - 1])
        return None


def engine_facts(vllm_config: Any) -> EngineFacts:
    """What a gate policy records of the engine it was measured on (unreadable: None)."""
    import vllm
    from vllm.platforms import current_platform

    def read(fn: Any) -> Any:
        try:
            return fn()
        except Exception:  # noqa: BLE001 - a fact that cannot be read is not compared
            return None

    return EngineFacts(
        device=read(lambda: str(current_platform.device_type)),
        block_size=read(lambda: int(vllm_config.cache_config.block_size)),
        tensor_parallel_size=read(lambda: int(vllm_config.parallel_config.tensor_parallel_size)),
        vllm_version=read(lambda: str(vllm.__version__)))


class ClassGate:
    def __init__(self, policy: GatePolicy | None, source: str, *, ungated: bool = False) -> None:
        self.policy, self.source, self.ungated = policy, source, ungated

    @classmethod
    def from_config(cls, config: SemkvConfig, identity: ModelIdentity | None,
                    facts: EngineFacts | None = None) -> ClassGate:
        policy, source = resolve_policy(config.gate_policy, identity, facts)
        gate = cls(policy, source, ungated=config.gate_policy == UNGATED)
        if policy is not None and facts is not None:
            if policy.engine is None:
                log.warning("gate_policy_engine_unrecorded", source=source[: MAX_STRING - 1],
                            why="the policy does not say which engine it was measured on",
                            fix="calibrate again: semkv calibrate records it")
            for difference in engine_differences(policy, facts)[1]:
                log.warning("gate_policy_engine_differs", source=source[: MAX_STRING - 1],
                            fact=difference.split(":")[0], difference=difference[: MAX_STRING - 1],
                            then="applied; its figures may not hold here")
        if gate.ungated:
            log.warning("gate_policy_ungated", served="every plan class",
                        note="measurement only: semkv calibrate, semkv bench --preset frontier")
        elif policy is None:
            # NOTE: every value short: a log line redacts strings of MAX_STRING characters or
            # more as payload (the identity's description and the hint are longer)
            model = ({} if identity is None else {
                "why": "semkv ships no gate policy for this model",
                "model": identity.architecture[:MAX_STRING - 1], "dtype": identity.dtype,
                "kv_cache_dtype": identity.kv_cache_dtype, "digest": identity.digest})
            log.warning("gate_policy_none", **({"why": source[:MAX_STRING - 1]} | model),
                        counted_as="vllm:semkv_realize_refused_total{reason=class}",
                        how="semkv calibrate --model <folder> --out policy.json",
                        then="gate_policy: policy.json")
        else:
            log.info("gate_policy_loaded", source=source,
                     served=[c.value for c in policy.served_classes()])
        return gate

    @classmethod
    def for_engine(cls, config: SemkvConfig, vllm_config: Any) -> ClassGate:
        ungated = config.gate_policy == UNGATED
        return cls.from_config(config, None if ungated else engine_identity(vllm_config),
                               None if ungated else engine_facts(vllm_config))

    def served(self, cls: PlanClass, prompt_tokens: int) -> bool:
        return self.ungated or bool(self.policy and (r := self.policy.rule(cls))
                                    and r.serves(prompt_tokens))

    def strategy(self, cls: PlanClass, engine: RecomputeStrategy, prompt_tokens: int,
                 ) -> RecomputeStrategy | FallbackReason:
        if self.ungated:
            return engine
        rule = self.policy.rule(cls) if self.policy is not None else None
        if rule is None or not rule.serves(prompt_tokens) or rule.strategy is None:
            return FallbackReason.UNCERTIFIED_CLASS
        fields = rule.strategy.model_dump(exclude_none=True)
        fields["kind"] = fields.pop("strategy")
        return replace(engine, **fields)
