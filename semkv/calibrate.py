"""A gate policy from frontier rows: what ``semkv calibrate`` certifies (issue #24, item 4).

Engine-free and pure: the rows come from the frontier runner (``semkv.bench.frontier.row``,
driven on the operator's engine by ``semkv_vllm.bench.calibrate``); this module turns them into
a ``semkv.gate_policy.GatePolicy``.

Per plan class (the engine's own label of each realized plan, ``row["plan_class"]``) and
strategy arm (``semkv.bench.config.STRATEGIES``), a ``Measurement``:

- ``samples``: the reuse targets served from a realized span of that class under that strategy
  whose fp8-floor arm was served too, both teacher forced (a target without its floor is no
  sample: nothing to read it against);
- ``kl_mean``: the strategy's mean per-token KL from cold over those targets; ``floor_kl_mean``:
  the fp8 floor arm's over the SAME targets (``kv_floor: fp8_e4m3``, the target's own KV
  rounded through fp8 in the same run);
- ``ttft_speedup``: the median of cold TTFT / realized TTFT, paired per target;
- ``recomputed_share``: the mean share of the prompt's tokens recomputed.

The decision, per class: among the strategies with at least ``min_samples`` samples, a mean KL
at or below the floor's and a median TTFT speedup of at least ``min_gain`` (the connector's
``realize_min_gain`` default, 1.2), the cheapest is certified: the lowest recomputed share,
then the fastest. None qualifies: the class is refused, its reason naming each strategy's
figures; fewer than ``min_samples`` samples under every strategy: refused as
``too few samples (n of min_samples)`` and why: the engine refused its plans (each reason
counted), too few targets were planned in it, or none was. Every class of ``PlanClass`` is in
the policy; one no target was planned in has 0 samples.

NOTE: rows carry counts, times and scores only; so do the policy and its reasons.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from semkv.atomic_file import write_text_atomic
from semkv.bench.config import FLOOR, STRATEGIES
from semkv.gate_policy import (
    FORMAT,
    VERSION,
    ClassRule,
    EngineFacts,
    GatePolicy,
    Measured,
    PolicyModel,
)
from semkv.model_identity import ModelIdentity
from semkv.plan_class import CLASSES_VERSION, PlanClass
from semkv.request_options import RecomputeOverride

MIN_SAMPLES = 8
MIN_GAIN = 1.2  # SemkvConfig.realize_min_gain's default: the least TTFT gain worth serving


@dataclass(frozen=True)
class Measurement:
    """One (plan class, strategy arm) of a calibration run, over its paired targets."""

    plan_class: str
    strategy: str  # the arm, e.g. "realized:first_k16"
    samples: int
    kl_mean: float | None
    floor_kl_mean: float | None
    ttft_speedup: float | None
    recomputed_share: float | None

    def measured(self) -> Measured:
        return Measured(samples=self.samples, kl_mean=_round(self.kl_mean),
                        floor_kl_mean=_round(self.floor_kl_mean),
                        ttft_speedup=_round(self.ttft_speedup, 3),
                        recomputed_share=_round(self.recomputed_share, 4))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _round(x: float | None, digits: int = 6) -> float | None:
    return None if x is None else round(x, digits)


def _scored(r: dict[str, Any]) -> bool:
    return bool(r.get("served")) and not r.get("negative") and r.get("kl_mean") is not None


def measure(rows: list[dict[str, Any]]) -> list[Measurement]:
    """Per plan class met in ``rows`` and strategy arm: the paired measurement."""
    floors = {r["target"]: r for r in rows if r["arm"] == FLOOR and _scored(r)}
    arms = [a for a in STRATEGIES if any(r["arm"] == a for r in rows)]
    classes = sorted({str(r["plan_class"]) for r in rows
                      if r["arm"] in STRATEGIES and r.get("plan_class") and _scored(r)})
    out: list[Measurement] = []
    for cls in classes:
        for arm in arms:
            rs = [r for r in rows if r["arm"] == arm and r.get("plan_class") == cls
                  and _scored(r) and r["target"] in floors]
            speedups = [float(r["speedup"]) for r in rs if r.get("speedup") is not None]
            out.append(Measurement(
                plan_class=cls, strategy=arm, samples=len(rs),
                kl_mean=statistics.fmean(r["kl_mean"] for r in rs) if rs else None,
                floor_kl_mean=(statistics.fmean(floors[r["target"]]["kl_mean"] for r in rs)
                               if rs else None),
                ttft_speedup=statistics.median(speedups) if speedups else None,
                recomputed_share=(statistics.fmean(r["recomputed"] / r["prompt_tokens"]
                                                   for r in rs if r["prompt_tokens"])
                                  if rs else None)))
    return out


def _short(arm: str) -> str:
    return arm.removeprefix("realized:")


def _why_not(m: Measurement, min_gain: float) -> str | None:
    """Why ``m`` cannot be certified (enough samples assumed), or None if it can."""
    if m.kl_mean is None or m.floor_kl_mean is None:
        return f"{_short(m.strategy)}: no scored KL"
    if m.kl_mean > m.floor_kl_mean:
        return (f"{_short(m.strategy)}: mean KL {m.kl_mean:.4f} above the fp8 floor's "
                f"{m.floor_kl_mean:.4f} ({m.kl_mean / max(m.floor_kl_mean, 1e-12):.1f}x)")
    if m.ttft_speedup is None or m.ttft_speedup < min_gain:
        speed = "no TTFT" if m.ttft_speedup is None else f"{m.ttft_speedup:.2f}x TTFT"
        return (f"{_short(m.strategy)}: mean KL {m.kl_mean:.4f} at or below the floor's "
                f"{m.floor_kl_mean:.4f}, but {speed} is below the minimum gain {min_gain}x")
    return None


def refusals(rows: list[dict[str, Any]]) -> dict[str, Counter[str]]:
    """Per plan class: the strategy arms' plans the engine refused, by reason."""
    out: dict[str, Counter[str]] = {}
    for r in rows:
        if r["arm"] in STRATEGIES and r.get("refused_class") and not r.get("negative"):
            out.setdefault(str(r["refused_class"]), Counter())[str(r["refused_reason"])] += 1
    return out


def _why_few(measured: bool, refused: Counter[str] | None) -> str:
    """Why a class has too few samples: the engine refused its plans, too few targets were
    planned in it, or none was."""
    if refused:
        counts = ", ".join(f"{reason} {n}" for reason, n in refused.most_common())
        return f": the engine refused {sum(refused.values())} plan(s) of this class ({counts})"
    if measured:
        return ": too few calibration targets were planned in this class"
    return ": no calibration target was planned in this class"


def decide(measurements: list[Measurement], *, min_samples: int = MIN_SAMPLES,
           min_gain: float = MIN_GAIN, refused: dict[str, Counter[str]] | None = None,
           ) -> dict[PlanClass, ClassRule]:
    """The rule of every plan class (see the module docstring for the decision);
    ``refused`` (``refusals(rows)``) says why a class has too few samples."""
    rules: dict[PlanClass, ClassRule] = {}
    for cls in PlanClass:
        ms = [m for m in measurements if m.plan_class == cls.value]
        most = max((m.samples for m in ms), default=0)
        enough = [m for m in ms if m.samples >= min_samples]
        if not enough:
            why = _why_few(bool(ms), (refused or {}).get(cls.value))
            best = max(ms, key=lambda m: m.samples, default=None)
            rules[cls] = ClassRule(
                served=False, measured=best.measured() if best else Measured(samples=0),
                reason=f"too few samples ({most} of {min_samples}){why}")
            continue
        passing = [m for m in enough if _why_not(m, min_gain) is None]
        if passing:
            pick = min(passing, key=lambda m: (m.recomputed_share or 0.0,
                                               -(m.ttft_speedup or 0.0)))
            assert pick.kl_mean is not None and pick.floor_kl_mean is not None
            rules[cls] = ClassRule(
                served=True, strategy=RecomputeOverride(**STRATEGIES[pick.strategy]),
                measured=pick.measured(),
                reason=(f"{_short(pick.strategy)}: mean KL {pick.kl_mean:.4f} at or below "
                        f"the fp8 floor's {pick.floor_kl_mean:.4f} on the same {pick.samples} "
                        f"targets, {pick.ttft_speedup:.2f}x TTFT, "
                        f"{pick.recomputed_share or 0.0:.1%} of the prompt recomputed; the "
                        f"cheapest of {len(passing)} strategy(ies) that qualify"))
            continue
        closest = min(enough, key=lambda m: (m.kl_mean or float("inf"))
                      / max(m.floor_kl_mean or 0.0, 1e-12))
        rules[cls] = ClassRule(
            served=False, measured=closest.measured(),
            reason="no strategy qualifies: " + "; ".join(
                str(_why_not(m, min_gain)) for m in enough))
    return rules


def build_policy(rows: list[dict[str, Any]], identity: ModelIdentity, *, source: str,
                 label: str = "", min_samples: int = MIN_SAMPLES, min_gain: float = MIN_GAIN,
                 created: str | None = None, engine: EngineFacts | None = None) -> GatePolicy:
    """The gate policy ``rows`` certify for the model of ``identity``."""
    if min_samples < 1:
        raise ValueError("min_samples must be at least 1")
    return GatePolicy(
        format=FORMAT, version=VERSION, classes_version=CLASSES_VERSION,
        model=PolicyModel(digest=identity.digest, architecture=identity.architecture,
                          dtype=identity.dtype, kv_cache_dtype=identity.kv_cache_dtype,
                          label=label),
        engine=engine, min_samples=min_samples,
        created=created or datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        source=source, classes=decide(measure(rows), min_samples=min_samples,
                                      min_gain=min_gain, refused=refusals(rows)))


def policy_json(policy: GatePolicy) -> str:
    """The file ``semkv.gate_policy.read_policy`` reads (unset fields left out)."""
    return json.dumps(policy.model_dump(mode="json", exclude_none=True), indent=2) + "\n"


def write_policy(policy: GatePolicy, path: Path) -> None:
    """Whole or not at all (``semkv.atomic_file``): an engine never reads half a policy."""
    write_text_atomic(path, policy_json(policy))


def summary_table(policy: GatePolicy, measurements: list[Measurement]) -> str:
    """Markdown: per class and strategy, samples, KL against the floor, TTFT, the decision."""
    lines = ["| class | strategy | samples | KL mean | fp8 floor KL | KL / floor | TTFT vs cold "
             "| recomputed | decision |", "|" + "---|" * 9]
    for cls, rule in policy.classes.items():
        ms = [m for m in measurements if m.plan_class == cls.value]
        if not ms:
            lines.append(f"| {cls.value} | - | 0 | - | - | - | - | - | refused |")
        for m in ms:
            chosen = rule.strategy == RecomputeOverride(**STRATEGIES[m.strategy])
            decision = "refused" if not rule.served else "served" if chosen else "not chosen"
            ratio = (m.kl_mean / m.floor_kl_mean if m.kl_mean is not None and m.floor_kl_mean
                     else None)
            lines.append("| " + " | ".join([
                cls.value, _short(m.strategy), str(m.samples), _f(m.kl_mean, ".4f"),
                _f(m.floor_kl_mean, ".4f"), _f(ratio, ".2f", "x"),
                _f(m.ttft_speedup, ".2f", "x"), _f(m.recomputed_share, ".1%"),
                decision]) + " |")
    lines += ["", *[f"- `{c.value}`: {'served' if r.served else 'refused'}: {r.reason}"
                    for c, r in policy.classes.items()]]
    return "\n".join(lines)


def _f(v: float | None, fmt: str, unit: str = "") -> str:
    return "-" if v is None else f"{v:{fmt}}{unit}"
