"""The reuse study: per cluster type and recompute strategy, how much is reused, at what cost.

Protocol: ``run_study(lm, tokenizer, StudyConfig(...))`` builds a labelled workload
(``semkv.eval.build_workload``), prefills every donor into a ``DonorStore``, then for every
target:

1. the reference: a full prefill, its greedy continuation (``max_new_tokens``) and that
   continuation's log-likelihood;
2. for each donor choice: the *true donor* (positives), the *wrong donor* (positives, when
   ``controls``: the best-scoring donor of another cluster, which shares only template text), or
   the *nearest unrelated* donor (negative controls: the best-scoring donor, none being right);
3. for each strategy: plan, assemble, prefill, generate, and score against the reference.

Every run records counts and scores only (no text, no token ids): reused and recomputed tokens,
the fraction of prompt tokens reused, the fraction of token-layers recomputed, the estimated
prefill FLOPs saved, and the quality scores. ``summarize`` averages them per (cluster type,
donor choice, strategy); ``write_results`` writes the JSON and one frontier plot per cluster
type (quality vs recompute fraction) under an output folder (bench-results/ is gitignored).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from semkv.eval import Prompt, build_workload
from semkv.research.assembly import plan_reuse, rank_donors
from semkv.research.donors import DEFAULT_CHUNK_TOKENS, DonorStore
from semkv.research.flops import FlopModel
from semkv.research.generate import answer_logprob, greedy
from semkv.research.layers import LayerwiseModel
from semkv.research.quality import score_generation
from semkv.research.recompute import Strategy, prefill

TRUE_DONOR, WRONG_DONOR, NEAREST_UNRELATED = "true_donor", "wrong_donor", "nearest_unrelated"
REFERENCE = "reference"  # the full prefill every other run is scored against
DEFAULT_STRATEGIES = (Strategy.none(), Strategy.first(16), Strategy.blend(0.15),
                      Strategy.blend(0.5))
MEAN_FIELDS = ("reused_fraction", "recompute_fraction", "flops_saved", "exact_match",
               "first_divergence", "rouge_l", "token_f1", "logprob_delta")


@dataclass(frozen=True)
class StudyConfig:
    seed: int = 0
    clusters_per_type: int = 2
    target_tokens: int | None = 512
    kinds: tuple[str, ...] | None = None  # None: every cluster kind
    max_new_tokens: int = 16
    strategies: tuple[Strategy, ...] = DEFAULT_STRATEGIES
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    min_run_tokens: int = 4
    controls: bool = True  # wrong-donor control for every positive target
    # False: end-of-sequence is never generated, so every continuation is max_new_tokens long
    # (a small model often answers some prompts with an immediate end-of-sequence, which would
    # leave a single token to compare).
    stop_at_eos: bool = False

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["strategies"] = [s.name for s in self.strategies]
        return out


@dataclass
class StudyResult:
    config: dict[str, Any]
    model: dict[str, Any]
    workload: dict[str, Any]
    runs: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
        return summarize(self.runs)

    def as_dict(self) -> dict[str, Any]:
        return {"config": self.config, "model": self.model, "workload": self.workload,
                "summary": self.summary(), "runs": self.runs}


def _donor_choices(target: Prompt, donors: dict[str, tuple[int, ...]], ids: Sequence[int],
                   config: StudyConfig) -> list[tuple[str, str]]:
    options = {"chunk_tokens": config.chunk_tokens, "min_run_tokens": config.min_run_tokens}
    if target.kind.is_negative or target.true_donor_id is None:
        ranked = rank_donors(ids, donors, **options)
        return [(NEAREST_UNRELATED, ranked[0][0])] if ranked else []
    choices = [(TRUE_DONOR, target.true_donor_id)]
    if config.controls:
        ranked = rank_donors(ids, donors, exclude=[target.true_donor_id], **options)
        if ranked:
            choices.append((WRONG_DONOR, ranked[0][0]))
    return choices


def _eos_ids(lm: LayerwiseModel, tokenizer: Any) -> set[int]:
    found: set[int] = set()
    for source in (getattr(lm.model, "generation_config", None), lm.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        found.update(value if isinstance(value, list) else [] if value is None else [value])
    return {int(v) for v in found}


def run_study(
    lm: LayerwiseModel, tokenizer: Any, config: StudyConfig, *,
    progress: Callable[[Iterable[Prompt]], Iterable[Prompt]] | None = None,
) -> StudyResult:
    """Run the study; ``progress`` wraps the target loop (e.g. ``tqdm``)."""
    workload = build_workload(config.seed, clusters_per_type=config.clusters_per_type,
                              target_tokens=config.target_tokens, tokenizer=tokenizer.encode,
                              kinds=config.kinds)
    store = DonorStore(lm, chunk_tokens=config.chunk_tokens)
    for donor in workload.donors:
        store.add(donor.prompt_id, donor.token_ids or ())
    donors = store.token_map()
    flops = FlopModel.from_config(lm.config)
    eos = _eos_ids(lm, tokenizer)
    stops, suppressed = (eos, set()) if config.stop_at_eos else (set(), eos)
    result = StudyResult(
        config=config.as_dict(),
        model={"type": lm.config.model_type, "layers": lm.num_layers, "heads": lm.num_heads,
               "kv_heads": lm.kv_heads, "head_dim": lm.head_dim},
        workload=workload.summary(),
    )
    targets: Iterable[Prompt] = workload.targets
    for target in progress(targets) if progress else targets:
        ids = list(target.token_ids or ())
        room = len(ids) + config.max_new_tokens
        started = time.perf_counter()
        reference = prefill(lm, ids, plan_reuse(ids, {}), store, Strategy.full(), capacity=room)
        answer = greedy(lm, reference, config.max_new_tokens, stops, suppress_ids=suppressed)
        reference_lp = answer_logprob(lm, reference, answer)
        base = {"target_id": target.prompt_id, "kind": target.kind.value,
                "negative": target.kind.is_negative, "prompt_tokens": len(ids),
                "reference_tokens": len(answer)}
        result.runs.append({**base, "donor_mode": REFERENCE, "donor_id": None, "strategy": "full",
                            "reused_tokens": 0, "reused_fraction": 0.0,
                            "recompute_fraction": 1.0, "flops_saved": 0.0,
                            **score_generation(answer, answer, reference_logprob=reference_lp,
                                               reuse_logprob=reference_lp).as_dict(),
                            "seconds": time.perf_counter() - started})
        for mode, donor_id in _donor_choices(target, donors, ids, config):
            plan = plan_reuse(ids, {donor_id: donors[donor_id]}, chunk_tokens=config.chunk_tokens,
                              min_run_tokens=config.min_run_tokens)
            for strategy in config.strategies:
                started = time.perf_counter()
                run = prefill(lm, ids, plan, store, strategy, capacity=room)
                candidate = greedy(lm, run, config.max_new_tokens, stops, suppress_ids=suppressed)
                scores = score_generation(candidate, answer, reference_logprob=reference_lp,
                                          reuse_logprob=answer_logprob(lm, run, answer))
                result.runs.append({
                    **base, "donor_mode": mode, "donor_id": donor_id, "strategy": strategy.name,
                    "planned_reuse_tokens": plan.reused_tokens,
                    "shifted_tokens": plan.shifted_tokens, "segments": len(plan.segments),
                    "reused_tokens": run.reused_tokens,
                    "reused_fraction": run.reused_tokens / len(ids),
                    "recompute_fraction": run.recompute_fraction,
                    "flops_saved": flops.saved(run.passes, len(ids), lm.num_layers),
                    **scores.as_dict(), "seconds": time.perf_counter() - started,
                })
    return result


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """Means per cluster type -> donor choice -> strategy (plus ``n``, the runs averaged)."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["kind"], run["donor_mode"], run["strategy"]), []).append(run)
    out: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for (kind, mode, strategy), rows in sorted(groups.items()):
        means = {name: statistics.fmean(float(r[name]) for r in rows) for name in MEAN_FIELDS}
        out.setdefault(kind, {}).setdefault(mode, {})[strategy] = {"n": float(len(rows)), **means}
    return out


def write_results(result: StudyResult, out_dir: str | Path, *, plots: bool = True) -> list[Path]:
    """Write ``research-study.json`` (and one frontier PNG per cluster type); returns the paths."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "research-study.json"
    path.write_text(json.dumps(result.as_dict(), indent=2, sort_keys=True) + "\n")
    written = [path]
    if plots:
        from semkv.research.plot import plot_frontiers

        written.extend(plot_frontiers(result.summary(), folder))
    return written
