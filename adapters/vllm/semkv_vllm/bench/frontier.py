"""The quality-vs-recompute frontier of realized spans, on one engine (``--preset frontier``).

Every arm is a request option (``semkv.request_options``), not an engine: per target the
donors are stored once and every arm's request sees the same store, engine and cores, side by
side. The engine runs ``materialize_semantic`` with the verified tier, realized spans, MinHash
discovery (LSH threshold 0.1, as ``materialize_realized:minhash``) and the ``recompute`` and
``kv_floor`` request overrides allowed (``request_overrides``).

Per reuse target (the store emptied first; vLLM's prefix cache reset before every request, so
all reuse is semkv's):

1. *donors*: each labelled donor served with lookup off (stored); its answer is the
   response-cache baseline;
2. *cold*: the target with lookup and saving off: the reference answer and TTFT; then the
   cold answer teacher forced through a cold prefill (top-``TOP`` log-probs per position);
3. *realized:<strategy>*: the target realized under the arm's recompute strategy: answer,
   TTFT, span counts; then the cold answer teacher forced under the same strategy
   (``reuse_until`` keeps every answer position vLLM's, so each has its log-probs);
   after the first arm the target runs again: a local prefix hit would mean a realized block
   became prefix-cache state (REQUEST_ONLY broken);
4. *fp8_floor*: the target stored as its own donor, then served and teacher forced with
   ``kv_floor: fp8_e4m3``: its own KV rounded through fp8, the floor operators accept.

Negative controls: donors stored (the decoy of a same-topic negative, plus one donor of a
reuse target of another cluster), cold, then one request under the first arm: any non-exact
reuse is a false positive.

Rows are scored by the engine-free ``semkv.bench.frontier``.

NOTE: rows hold counts, times and scores only, never token ids or text.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from semkv.bench.config import COLD, FLOOR, STRATEGIES, Arm, BenchConfig
from semkv.bench.frontier import (
    OFF,
    TOP,
    donors_of,
    planned_requests,
    row,
    served,
    teacher_scores,
)
from semkv.bench.results import Run
from semkv.bench.workload import Workload
from semkv.research.quality import rouge_l
from semkv_vllm.bench.engine import answer_distributions, generate, kv_bytes_for, open_engine
from semkv_vllm.bench.runner import progress_bar

Tick = Callable[[str, int], Any] | None


def engine_arm(config: BenchConfig, donors_per_target: int,
               overrides: Mapping[str, Any] | None = None) -> Arm:
    """The frontier engine's connector config; ``overrides`` laid over it (``semkv calibrate``:
    the donor store sized for its model)."""
    overrides = dict(overrides or {})
    if "donor_store_bytes" not in overrides:
        # one target's donors and the target itself, whole prompts, in the store at once
        overrides["donor_store_bytes"] = kv_bytes_for(config, donors_per_target + 2)
    extra = {"semantic_mode": "materialize_semantic", "provider": "minhash",
             "semantic_tiers": ["verified"], "realize_spans": True, "request_options": True,
             "request_overrides": ["recompute", "kv_floor"],  # every arm is an override
             "provider_config": {"threshold": 0.1},
             "gate_policy": "ungated",  # every class measured: the frontier certifies them
             "realize_min_gain": 0.0,  # every plan measured; rows still carry predicted gains
             **overrides}
    return Arm(name="frontier", mode="materialize_semantic", provider="minhash", extra=extra,
               commit_policy=True)


# what a lean run does not measure (the greedy answers of every arm but cold)
GREEDY_FIELDS = ("exact_match", "rouge_l", "first_divergence", "cold_margin_at_divergence",
                 "response_cache_rouge_l")


class FrontierRun:
    """One engine; ``target`` runs every phase for one prompt and returns its rows.

    ``lean`` (``semkv calibrate``): only what a gate policy reads, KL and TTFT: donors generate
    one token, every arm but cold two (the TTFT, and a load confirmed), no response cache, no
    REQUEST_ONLY re-run; the greedy fields of those rows are None.
    """

    def __init__(self, llm: Any, config: BenchConfig, wl: Workload, arms: tuple[str, ...],
                 tick: Tick = None, *, lean: bool = False) -> None:
        self.llm, self.config, self.wl, self.tick = llm, config, wl, tick
        self.strategies = [a for a in arms if a in STRATEGIES]
        self.floor = FLOOR in arms
        self.lean = lean
        self.request_only_violations = 0

    def _gen(self, ids: list[int], options: dict[str, Any] | None, max_tokens: int) -> Run:
        self.llm.reset_prefix_cache()
        run = generate(self.llm, ids, max_tokens, options)
        if self.tick:
            self.tick("requests", 1)
        return run

    def _teach(self, ids: list[int], answer: list[int], options: dict[str, Any],
               ) -> list[dict[int, float] | None]:
        self.llm.reset_prefix_cache()
        dists, _ = answer_distributions(self.llm, ids, answer, top=TOP,
                                        options={**options, "reuse_until": len(ids) - 1})
        return dists

    def _store(self, donor_ids: list[str]) -> list[list[int]]:
        """Empty the store, serve and store the donors (their answers: the response cache)."""
        self.llm.reset_prefix_cache(reset_connector=True)
        n = 1 if self.lean else self.config.max_tokens
        return [self._gen(self.wl.ids[d], {"lookup": False}, n).output for d in donor_ids]

    def _row(self, *args: Any) -> dict[str, Any]:
        r = row(*args)
        if self.lean and r["arm"] != COLD:
            r.update(dict.fromkeys(GREEDY_FIELDS))
        return r

    def target(self, t: str, extra_donors: list[str]) -> list[dict[str, Any]]:
        wl, n = self.wl, self.config.max_tokens
        ids = wl.ids[t]
        answers = self._store(donors_of(wl, t) + extra_donors)
        cold = self._gen(ids, OFF, n)
        rc = None if self.lean else max((rouge_l(a, cold.output) for a in answers),
                                        default=None)
        # lean: the arms' TTFT only; 2 tokens, as a request that ends in the step of its load
        # has no confirmed load (the floor's row would not count as served)
        n_arm = min(2, n) if self.lean else n
        if wl.negative[t]:
            arm = self.strategies[0]
            run = self._gen(ids, {"recompute": STRATEGIES[arm]}, n_arm)
            return [self._row(t, wl, arm, run, cold, [], None, rc)]
        cold_dists = self._teach(ids, cold.output, OFF)
        rows = [row(t, wl, COLD, cold, cold, cold_dists,
                    teacher_scores(cold_dists, cold_dists, cold.output), rc)]
        for i, arm in enumerate(self.strategies):
            option = {"recompute": STRATEGIES[arm]}
            run = self._gen(ids, option, n_arm)
            # REQUEST_ONLY: nothing realized is prefix-cache state
            if i == 0 and served(run) and not self.lean:
                again = generate(self.llm, ids, 1, OFF)
                self.request_only_violations += int(
                    int(again.summary.get("local_prefix_tokens") or 0) > 0)
            teacher = teacher_scores(self._teach(ids, cold.output, option), cold_dists,
                                     cold.output)
            rows.append(self._row(t, wl, arm, run, cold, cold_dists, teacher, rc))
        if self.floor:
            self._gen(ids, {"lookup": False}, 1)  # the target's own KV, stored
            floor: dict[str, Any] = {"kv_floor": "fp8_e4m3"}
            run = self._gen(ids, floor, n_arm)
            teacher = teacher_scores(self._teach(ids, cold.output, floor), cold_dists,
                                     cold.output)
            rows.append(self._row(t, wl, FLOOR, run, cold, cold_dists, teacher, rc))
        return rows


def most_donors(wl: Workload) -> int:
    """Donors the store must hold at once: the most of any target, plus one."""
    return max((len(donors_of(wl, t)) for t in wl.targets), default=1) + 1


def run_frontier(config: BenchConfig, wl: Workload, *, show_progress: bool = True,
                 engine_args: Mapping[str, Any] | None = None,
                 overrides: Mapping[str, Any] | None = None,
                 on_open: Callable[[Any], Any] | None = None, lean: bool = False,
                 ) -> dict[str, Any]:
    """Every target of ``wl`` through every arm of ``config`` on one engine.

    ``engine_args`` and ``overrides`` go to ``open_engine`` and ``engine_arm``; ``on_open`` is
    called with the engine after its warm-up request, before the first measured one
    (``semkv calibrate`` reads its identity and whether it can realize spans);
    ``lean``: see ``FrontierRun`` (``request_only_violations`` is then None: not checked).
    """
    reuse = [t for t in wl.targets if not wl.negative[t]]
    arm = engine_arm(config, most_donors(wl), overrides)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    with open_engine(arm, config, max_num_seqs=1, engine_args=engine_args) as llm, \
            progress_bar(planned_requests(config, wl, config.arms), show_progress) as tick:
        generate(llm, list(range(100, 164)), 2)  # the first forward of an engine is slow
        if on_open is not None:  # after that step the workers have reported what they can do
            on_open(llm)
        run = FrontierRun(llm, config, wl, config.arms, tick, lean=lean)
        negatives = [t for t in wl.targets if wl.negative[t]]
        for t in reuse:
            rows += run.target(t, [])
        for i, t in enumerate(negatives):
            other = donors_of(wl, reuse[i % len(reuse)])[:1] if reuse else []
            rows += run.target(t, other)
    return {"rows": rows, "engine": arm.as_dict(), "wall_s": time.perf_counter() - started,
            "request_only_violations": None if lean else run.request_only_violations}
