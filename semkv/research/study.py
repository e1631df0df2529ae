"""The reuse study: per cluster type and recompute strategy, how much is reused, at what cost.

Protocol: ``run_study(lm, tokenizer, StudyConfig(...), providers=("chunks", "minhash"))`` builds
a labelled workload (``semkv.eval.build_workload``), prefills every donor into a
``DonorStore``, registers every donor with each named provider (``semkv.research.discovery``),
then for every target:

1. the reference: a full prefill, its greedy continuation (``max_new_tokens``) and that
   continuation's log-likelihood;
2. for each donor choice: the *true donor* (positives), the *wrong donor* (positives, when
   ``controls``: the best-scoring donor of another cluster, which shares only template text),
   the *nearest unrelated* donor (negative controls: the best-scoring donor, none being
   right), and, per provider, the *discovered* donor: the provider's best candidate. The first
   three are picked by ground truth; only the discovered one is what a deployment would get;
3. for each strategy: plan, assemble, prefill, generate, and score against the reference.

A discovered run records the provider, whether it proposed a donor (``proposed``), for
positives whether that is the true donor (``discovered_correct``) and for negatives whether
anything was proposed at all (``false_positive``). When the provider proposes nothing, nothing
is reused: the run is a full prefill, recorded with the reference's scores (``no_donor``), the
honest outcome of a missed discovery. A donor is measured once per target: a second choice of
the same donor (e.g. the discovered one is the true one) copies its measurements, ``seconds``
included (greedy decoding is deterministic).

Every run records counts and scores only (no text, no token ids): reused and recomputed tokens,
the plan's class (``semkv.plan_class``, as the engine would label it),
the fraction of prompt tokens reused, the fraction of token-layers recomputed, the estimated
prefill FLOPs saved, and the quality scores. ``summarize`` averages them per (cluster type,
donor choice, strategy), the donor choice of a discovered run being ``discovered:<provider>``;
``write_results`` writes the JSON and one frontier plot per cluster type (quality vs recompute
fraction) under an output folder (bench-results/ is gitignored).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from semkv.eval import Prompt, build_workload
from semkv.research.assembly import plan_reuse, rank_donors
from semkv.research.discovery import DEFAULT_BLOCK_SIZE, ProviderDiscovery
from semkv.research.donors import DEFAULT_CHUNK_TOKENS, DonorStore
from semkv.research.flops import FlopModel
from semkv.research.generate import answer_logprob, greedy
from semkv.research.layers import LayerwiseModel
from semkv.research.quality import score_generation
from semkv.research.recompute import Strategy, StrategyKind, prefill

TRUE_DONOR, WRONG_DONOR, NEAREST_UNRELATED = "true_donor", "wrong_donor", "nearest_unrelated"
DISCOVERED = "discovered"  # summary key: "discovered:<provider>"
REFERENCE = "reference"  # the full prefill every other run is scored against
DEFAULT_STRATEGIES = (Strategy.none(), Strategy.first(16), Strategy.blend(0.15),
                      Strategy.blend(0.5))
MEAN_FIELDS = ("reused_fraction", "recompute_fraction", "flops_saved", "exact_match",
               "first_divergence", "rouge_l", "token_f1", "logprob_delta")
# Discovered runs only, averaged over the runs where they apply (None elsewhere): a rate.
DISCOVERY_FIELDS = ("proposed", "discovered_correct", "false_positive")


def strategy_from_name(name: str) -> Strategy:
    """The strategy ``Strategy.name`` gives this name: none, full, first<k>, blend<percent>,
    oracle<percent>, progressive<percent>, query<percent>, queryv<percent>, shift<percent> and
    the halo combinations first<k>+blend<percent>, first<k>+query<percent>."""
    if name in (StrategyKind.NONE.value, StrategyKind.FULL.value):
        return Strategy(StrategyKind(name))
    number = name.lstrip("abcdefghijklmnopqrstuvwxyz")
    if number.isdigit() and name == f"first{number}":
        return Strategy.first(int(number))
    if number.isdigit() and name == f"blend{number}":
        return Strategy.blend(int(number) / 100)
    if number.isdigit() and name == f"oracle{number}":
        return Strategy.oracle(int(number) / 100)
    if number.isdigit() and name == f"progressive{number}":
        return Strategy.progressive(int(number) / 100)
    if number.isdigit() and name == f"query{number}":
        return Strategy.query(int(number) / 100)
    if number.isdigit() and name == f"shift{number}":
        return Strategy.shift(int(number) / 100)
    if number.isdigit() and name == f"queryv{number}":
        return Strategy.queryv(int(number) / 100)
    halo, _, rest = name.partition("+")
    k = halo.removeprefix("first")
    if rest and k.isdigit() and halo == f"first{k}" and int(k) >= 1:
        inner = strategy_from_name(rest)
        if inner.kind is StrategyKind.BLEND:
            return Strategy.first_k_blend(int(k), inner.ratio)
        if inner.kind is StrategyKind.QUERY:
            return Strategy.first_k_query(int(k), inner.ratio)
    raise ValueError(f"unknown strategy {name!r} (none, full, first<k>, blend<percent>, "
                     "query<percent>, first<k>+blend<percent>, first<k>+query<percent>, "
                     "oracle<percent>, progressive<percent>, shift<percent>, queryv<percent>)")


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
    provider_block_size: int = DEFAULT_BLOCK_SIZE  # ProviderContext.block_size for discovery

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
    def rank(exclude: Sequence[str] = ()) -> list[tuple[str, int]]:
        return rank_donors(ids, donors, exclude=exclude, chunk_tokens=config.chunk_tokens,
                           min_run_tokens=config.min_run_tokens)

    if target.kind.is_negative or target.true_donor_id is None:
        ranked = rank()
        return [(NEAREST_UNRELATED, ranked[0][0])] if ranked else []
    choices = [(TRUE_DONOR, target.true_donor_id)]
    if config.controls:
        ranked = rank(exclude=[target.true_donor_id])
        if ranked:
            choices.append((WRONG_DONOR, ranked[0][0]))
    return choices


def _eos_ids(lm: LayerwiseModel, tokenizer: Any) -> set[int]:
    found: set[int] = set()
    for source in (getattr(lm.model, "generation_config", None), lm.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        found.update(value if isinstance(value, list) else [] if value is None else [value])
    return {int(v) for v in found}


@dataclass(frozen=True)
class _Measure:
    """What every run of the study shares: model, donors, costs, decoding settings."""

    lm: LayerwiseModel
    store: DonorStore
    config: StudyConfig
    flops: FlopModel
    stops: set[int]
    suppressed: set[int]

    def reference(self, ids: list[int]) -> tuple[list[int], float, dict[str, Any]]:
        """The full prefill: its continuation, that continuation's log-likelihood, its run."""
        started = time.perf_counter()
        room = len(ids) + self.config.max_new_tokens
        full = prefill(self.lm, ids, plan_reuse(ids, {}), self.store, Strategy.full(),
                       capacity=room)
        answer = greedy(self.lm, full, self.config.max_new_tokens, self.stops,
                        suppress_ids=self.suppressed)
        logprob = answer_logprob(self.lm, full, answer)
        run = {"strategy": "full", "reused_tokens": 0, "reused_fraction": 0.0,
               "recompute_fraction": 1.0, "flops_saved": 0.0,
               **score_generation(answer, answer, reference_logprob=logprob,
                                  reuse_logprob=logprob).as_dict(),
               "seconds": time.perf_counter() - started}
        return answer, logprob, run

    def with_donor(self, ids: list[int], donor_id: str, answer: list[int],
                   reference_logprob: float) -> list[dict[str, Any]]:
        """One run per strategy, reusing ``donor_id``'s KV, scored against the reference."""
        config, lm = self.config, self.lm
        room = len(ids) + config.max_new_tokens
        plan = plan_reuse(ids, {donor_id: self.store.tokens(donor_id)},
                          chunk_tokens=config.chunk_tokens, min_run_tokens=config.min_run_tokens)
        runs = []
        for strategy in config.strategies:
            started = time.perf_counter()
            run = prefill(lm, ids, plan, self.store, strategy, capacity=room)
            candidate = greedy(lm, run, config.max_new_tokens, self.stops,
                               suppress_ids=self.suppressed)
            scores = score_generation(candidate, answer, reference_logprob=reference_logprob,
                                      reuse_logprob=answer_logprob(lm, run, answer))
            runs.append({
                "strategy": strategy.name, "planned_reuse_tokens": plan.reused_tokens,
                "shifted_tokens": plan.shifted_tokens, "segments": len(plan.segments),
                "plan_class": str(plan.plan_class), "reused_tokens": run.reused_tokens,
                "reused_fraction": run.reused_tokens / len(ids),
                "recompute_fraction": run.recompute_fraction,
                "flops_saved": self.flops.saved(run.passes, len(ids), lm.num_layers),
                **scores.as_dict(), "seconds": time.perf_counter() - started,
            })
        return runs

    def without_donor(self, reference: dict[str, Any]) -> list[dict[str, Any]]:
        """No donor: nothing reused, every strategy is a full prefill, i.e. the reference."""
        return [{**reference, "strategy": s.name, "planned_reuse_tokens": 0,
                 "shifted_tokens": 0, "segments": 0, "plan_class": None, "no_donor": True}
                for s in self.config.strategies]


def run_study(
    lm: LayerwiseModel, tokenizer: Any, config: StudyConfig, *,
    providers: Sequence[str] = (),
    progress: Callable[[Iterable[Prompt]], Iterable[Prompt]] | None = None,
) -> StudyResult:
    """Run the study; ``providers`` name semkv providers that discover a donor per target
    (``semkv.plugins``; text-based ones detokenize with ``tokenizer.decode``); ``progress``
    wraps the target loop (e.g. ``tqdm``)."""
    workload = build_workload(config.seed, clusters_per_type=config.clusters_per_type,
                              target_tokens=config.target_tokens, tokenizer=tokenizer.encode,
                              kinds=config.kinds)
    donors = {d.prompt_id: tuple(d.token_ids or ()) for d in workload.donors}
    result = StudyResult(
        config={**config.as_dict(), "providers": list(providers)},
        model={"type": lm.config.model_type, "layers": lm.num_layers, "heads": lm.num_heads,
               "kv_heads": lm.kv_heads, "head_dim": lm.head_dim},
        workload=workload.summary(),
    )
    with ExitStack() as opened:  # every provider is closed, whatever happens
        # Providers first: an unknown name fails before minutes of donor prefill.
        discoveries = [
            opened.enter_context(ProviderDiscovery(
                name, donors, block_size=config.provider_block_size,
                detokenize=lambda ids: tokenizer.decode(list(ids))))
            for name in providers
        ]
        store = DonorStore(lm, chunk_tokens=config.chunk_tokens)
        for donor_id, donor_ids in donors.items():
            store.add(donor_id, donor_ids)
        eos = _eos_ids(lm, tokenizer)
        stops, suppressed = (eos, set()) if config.stop_at_eos else (set(), eos)
        measure = _Measure(lm, store, config, FlopModel.from_config(lm.config), stops,
                           suppressed)
        targets: Iterable[Prompt] = workload.targets
        for target in progress(targets) if progress else targets:
            ids = list(target.token_ids or ())
            answer, reference_lp, reference = measure.reference(ids)
            base = {"target_id": target.prompt_id, "kind": target.kind.value,
                    "negative": target.kind.is_negative, "prompt_tokens": len(ids),
                    "reference_tokens": len(answer)}
            result.runs.append({**base, "donor_mode": REFERENCE, "donor_id": None,
                                **reference})
            measured: dict[str, list[dict[str, Any]]] = {}  # donor id -> its runs, this target
            for mode, donor_id in _donor_choices(target, donors, ids, config):
                if donor_id not in measured:
                    measured[donor_id] = measure.with_donor(ids, donor_id, answer, reference_lp)
                result.runs.extend({**base, "donor_mode": mode, "donor_id": donor_id, **run}
                                   for run in measured[donor_id])
            negative = target.kind.is_negative or target.true_donor_id is None
            for discovery in discoveries:
                proposal = discovery.propose(target.prompt_id, ids)
                found = proposal.donor_id
                if found is None:
                    runs = measure.without_donor(reference)
                else:
                    if found not in measured:
                        measured[found] = measure.with_donor(ids, found, answer, reference_lp)
                    runs = measured[found]
                labels: dict[str, Any] = {
                    "donor_mode": DISCOVERED, "donor_id": found, "provider": discovery.name,
                    "proposed": found is not None, "candidates": proposal.candidates,
                    "discovery_similarity": proposal.similarity,
                    "discovered_correct": None if negative else found == target.true_donor_id,
                    "false_positive": found is not None if negative else None,
                }
                result.runs.extend({**base, **run, **labels} for run in runs)
    return result


def _mode_key(run: dict[str, Any]) -> str:
    provider = run.get("provider")
    return f"{run['donor_mode']}:{provider}" if provider else str(run["donor_mode"])


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """Means per cluster type -> donor choice -> strategy (plus ``n``, the runs averaged).

    The donor choice of a discovered run is ``discovered:<provider>``; its means add
    ``proposed``, ``discovered_correct`` (positives) and ``false_positive`` (negatives): rates
    over the targets.
    """
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["kind"], _mode_key(run), run["strategy"]), []).append(run)
    out: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for (kind, mode, strategy), rows in sorted(groups.items()):
        means = {name: statistics.fmean(float(r[name]) for r in rows) for name in MEAN_FIELDS}
        for name in DISCOVERY_FIELDS:
            values = [float(r[name]) for r in rows if r.get(name) is not None]
            if values:
                means[name] = statistics.fmean(values)
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
