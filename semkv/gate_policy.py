"""Gate policies: which plan classes a model's realized spans may serve, and how (issue #24).

A policy is a JSON file written by ``semkv calibrate`` (or shipped, for the bundled model, in
``semkv/policies/``). Per plan class (``semkv.plan_class``) it says whether realized spans of
that class are served and with which recompute strategy, with the measurement that decided it
(samples, mean KL from cold against the fp8-KV floor's in the same run, TTFT against cold).
It is keyed by the model's identity (``semkv.model_identity``): a policy applies to the model
whose digest it names and to no other. It records the engine it was measured on
(``EngineFacts``: device, block size, tensor parallelism, vLLM version): another device refuses
it (start-up error for a named file; ``auto`` skips it), any other difference is warned about
at start-up by name (``gate_policy_engine_differs``), and a policy without them is applied with
a warning (``gate_policy_engine_unrecorded``).

The connector's ``gate_policy`` key picks it:

- ``auto`` (default): the shipped policy whose digest is the engine's model, if any; else no
  policy, and non-exact plans are refused (``uncertified_class``) and counted, the log saying
  how to calibrate;
- a path: that file; it must parse, be of this format and classes version, and name the
  engine's model, or start-up fails naming the file and the field;
- ``ungated``: every class served with the engine's strategy (measurement only: what
  ``semkv calibrate`` and the frontier bench run).

NOTE: a class a policy does not list is not served. A served class needs a strategy; its
``min_prompt_tokens`` (default 0) refuses the class's plans on shorter prompts, where it was
not certified.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator

from semkv.config import ConfigError
from semkv.model_identity import ModelIdentity
from semkv.plan_class import CLASSES_VERSION, PlanClass
from semkv.request_options import RecomputeOverride

FORMAT = "semkv-gate-policy"
VERSION = 1
SHIPPED = Path(__file__).parent / "policies"
UNGATED = "ungated"
AUTO = "auto"
CALIBRATE_HINT = ("run `semkv calibrate --model <folder> --out policy.json` with the engine "
                  "arguments you serve with, then set gate_policy: policy.json")


class PolicyError(ConfigError):
    """A gate policy file that cannot apply (the message names the file and the field)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PolicyModel(_Strict):
    digest: str = Field(pattern=r"^[0-9a-f]{32}$")
    architecture: str
    dtype: str
    kv_cache_dtype: str
    label: str = ""  # where it was measured, for people (never part of the match)


class EngineFacts(_Strict):
    """The engine a policy was measured on (None: not recorded). ``device`` differing refuses
    the policy (its KL and TTFT were measured on other kernels); the others warn by name."""

    device: str | None = None  # vLLM's platform device type: "cpu", "cuda", ...
    block_size: int | None = None
    tensor_parallel_size: int | None = None
    vllm_version: str | None = None


REFUSING_FACTS = ("device",)


class Measured(_Strict):
    samples: int = Field(ge=0)
    kl_mean: float | None = None
    floor_kl_mean: float | None = None
    ttft_speedup: float | None = None  # median cold TTFT / realized TTFT
    recomputed_share: float | None = None


class ClassRule(_Strict):
    served: StrictBool
    strategy: RecomputeOverride | None = None
    # Served only for prompts of at least this many tokens: the lengths it was certified at
    # (a class can reach the floor at 4K and not at 1K). 0: at any length.
    min_prompt_tokens: int = Field(default=0, ge=0)
    measured: Measured | None = None
    reason: str = ""

    def serves(self, prompt_tokens: int) -> bool:
        """Is a plan of this class served for a prompt of ``prompt_tokens``?"""
        return self.served and prompt_tokens >= self.min_prompt_tokens

    @model_validator(mode="after")
    def _served_needs_strategy(self) -> ClassRule:
        if self.served and (self.strategy is None or self.strategy.strategy is None):
            raise ValueError("a served class needs a strategy with its 'strategy' field")
        return self


class GatePolicy(_Strict):
    format: Literal["semkv-gate-policy"]
    version: int
    classes_version: int
    model: PolicyModel
    engine: EngineFacts | None = None  # None: a policy from before engine facts were recorded
    floor: Literal["fp8_e4m3"] = "fp8_e4m3"
    min_samples: int = Field(ge=1)
    created: str = ""
    source: str = ""  # the prompts it was measured on (a file name or "bundled workloads")
    classes: dict[PlanClass, ClassRule]

    def rule(self, cls: PlanClass) -> ClassRule | None:
        return self.classes.get(cls)

    def served_classes(self) -> list[PlanClass]:
        return [c for c, r in self.classes.items() if r.served]


def read_policy(path: Path) -> GatePolicy:
    """Parse a policy file, or raise ``PolicyError`` naming the file and the field."""
    where = f"gate_policy {str(path)!r}"
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise PolicyError(f"{where}: cannot read ({exc.strerror or type(exc).__name__})") from None
    except ValueError as exc:
        raise PolicyError(f"{where}: not JSON ({exc})") from None
    try:
        policy = GatePolicy.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<policy>'}: {e['msg']}"
                             for e in exc.errors())
        raise PolicyError(f"{where}: {problems}") from None
    if policy.version != VERSION:
        raise PolicyError(f"{where}: version: {policy.version}, this semkv reads version "
                          f"{VERSION}")
    if policy.classes_version != CLASSES_VERSION:
        raise PolicyError(f"{where}: classes_version: {policy.classes_version} is stale, this "
                          f"semkv defines plan classes version {CLASSES_VERSION}; "
                          f"{CALIBRATE_HINT}")
    return policy


def check_model(policy: GatePolicy, identity: ModelIdentity, path: Path) -> None:
    """Raise ``PolicyError`` unless ``policy`` was measured on this model and dtypes."""
    m = policy.model
    for field, want, have in (("model.digest", m.digest, identity.digest),
                              ("model.dtype", m.dtype, identity.dtype),
                              ("model.kv_cache_dtype", m.kv_cache_dtype,
                               identity.kv_cache_dtype)):
        if want != have:
            raise PolicyError(
                f"gate_policy {str(path)!r}: {field}: {want!r} is another model's; this engine "
                f"serves {identity.describe()}; {CALIBRATE_HINT}")


def engine_differences(policy: GatePolicy, facts: EngineFacts | None,
                       ) -> tuple[list[str], list[str]]:
    """(refusing, warning): ``engine.<field>: measured on X, this engine Y`` for each recorded
    fact that differs from ``facts`` (a fact unknown on either side is not compared)."""
    refusing: list[str] = []
    warning: list[str] = []
    if policy.engine is None or facts is None:
        return refusing, warning
    for name in EngineFacts.model_fields:
        want, have = getattr(policy.engine, name), getattr(facts, name)
        if want is not None and have is not None and want != have:
            said = f"engine.{name}: measured with {want!r}, this engine has {have!r}"
            (refusing if name in REFUSING_FACTS else warning).append(said)
    return refusing, warning


def shipped_policy(identity: ModelIdentity, facts: EngineFacts | None = None,
                   ) -> tuple[GatePolicy, Path] | None:
    """The shipped policy measured on this model (and, where recorded, this device)."""
    for path in sorted(SHIPPED.glob("*.json")):
        policy = read_policy(path)  # a broken shipped file is semkv's bug: it raises
        m = policy.model
        if (m.digest, m.dtype, m.kv_cache_dtype) == (identity.digest, identity.dtype,
                                                     identity.kv_cache_dtype):
            if not engine_differences(policy, facts)[0]:
                return policy, path
    return None


def resolve_policy(setting: str, identity: ModelIdentity | None,
                   facts: EngineFacts | None = None) -> tuple[GatePolicy | None, str]:
    """(policy, where it came from) for the ``gate_policy`` key; (None, why) when none applies.

    Raises ``PolicyError`` for a named file that does not apply to ``identity`` or was
    measured on another device (``facts``: this engine's; the caller warns about the others,
    ``engine_differences``).
    """
    if setting == UNGATED:
        return None, UNGATED
    if setting == AUTO:
        if identity is None:
            return None, "the engine's model has no identity (its folder could not be read)"
        found = shipped_policy(identity, facts)
        if found is None:
            device = f" on a {facts.device} engine" if facts and facts.device else ""
            return None, f"semkv ships no gate policy for {identity.describe()}{device}"
        return found[0], f"shipped:{found[1].name}"
    path = Path(setting)
    policy = read_policy(path)
    if identity is None:
        raise PolicyError(f"gate_policy {setting!r}: the engine's model has no identity (its "
                          "folder could not be read), so no policy can be checked against it")
    check_model(policy, identity, path)
    refusing = engine_differences(policy, facts)[0]
    if refusing:
        raise PolicyError(f"gate_policy {setting!r}: {'; '.join(refusing)}: its quality and "
                          f"speed were measured on other kernels; {CALIBRATE_HINT}")
    return policy, str(path)
