"""The phases of ``semkv bench``, per arm, on one engine at a time.

Per arm (engine), with the same prompts and cores as every other arm:
1. *miss*: every target alone after ``reset_prefix_cache(reset_connector=True)``: nothing is
   stored anywhere, so this is what a miss costs (for ``disabled``: the cold run whose greedy
   output is the quality reference);
2. *donors*: the store is emptied once, then every donor of the workload runs (and is stored);
   on ``disabled`` the donors' cold answers feed the response-cache baseline;
3. *reuse*: every target after ``reset_prefix_cache()`` (vLLM forgets, semkv's store keeps
   the donors), so any reuse comes from semkv. On ``disabled`` the same prompt then runs again
   without a reset: vLLM's own prefix hit, the ceiling of KV reuse. Then the log-likelihood of
   the cold answer is measured under this arm's reuse (``answer_logprob``);
4. *throughput* (``concurrency > 1``): the store is rebuilt from the donors and every target
   is submitted at once, at most ``concurrency`` in flight.

Arms run in sequence, not interleaved: the connector's mode is fixed at engine start, and two
in-process engines cannot be alive at once (vLLM keeps the worker's connector in a global).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from semkv.bench.config import ARMS, Arm, BenchConfig
from semkv.bench.results import ArmResult
from semkv.bench.workload import Workload
from semkv_vllm.bench.engine import (
    answer_logprobs,
    generate,
    generate_batch,
    open_engine,
    snapshot,
)

Progress = Callable[[str, int], Any]


def _warm_up(llm: Any) -> None:
    generate(llm, list(range(100, 164)), 2)  # the first forward of an engine is always slow


def _store_donors(llm: Any, wl: Workload, result: ArmResult, max_tokens: int,
                  tick: Progress | None) -> None:
    llm.reset_prefix_cache(reset_connector=True)
    for d in wl.donors:
        result.donors[d] = generate(llm, wl.ids[d], max_tokens)
        if tick:
            tick("donors", 1)
    store = snapshot(llm).get("vllm:semkv_donor_store_bytes")
    result.donor_store_bytes = max(result.donor_store_bytes, store)


def run_arm(arm: Arm, config: BenchConfig, wl: Workload, cold: ArmResult | None,
            tick: Progress | None = None) -> ArmResult:
    """All phases of one arm. ``cold`` is the disabled arm's result (None for disabled)."""
    import time

    is_baseline = arm.mode == "disabled"
    targets = [t for t in wl.targets if wl.negative[t] or not arm.negatives_only]
    result = ArmResult(arm=arm)
    start = time.perf_counter()
    with open_engine(arm, config, max_num_seqs=max(config.concurrency, 1)) as llm:
        result.engine_start_s = time.perf_counter() - start
        _warm_up(llm)
        if not arm.negatives_only:
            for t in targets:
                llm.reset_prefix_cache(reset_connector=True)
                result.miss[t] = generate(llm, wl.ids[t], config.max_tokens)
                if tick:
                    tick("miss", 1)
        # the baseline's donor answers are the response-cache baseline; others only store
        _store_donors(llm, wl, result, config.max_tokens if is_baseline else 1, tick)
        for t in targets:
            llm.reset_prefix_cache()  # vLLM forgets; semkv's store keeps the donors
            result.reuse[t] = generate(llm, wl.ids[t], config.max_tokens)
            if is_baseline:  # the same prompt again: vLLM's own prefix-cache hit
                result.vllm_hit[t] = generate(llm, wl.ids[t], config.max_tokens)
            answer = (result.miss if is_baseline else cold.miss)[t].output  # type: ignore[union-attr]
            llm.reset_prefix_cache()
            # with request options the span stops before the answer: every answer position is
            # scored, under the same span as the target run
            options = ({"reuse_until": len(wl.ids[t]) - 1} if arm.extra.get("request_options")
                       else None)
            result.logprob[t], result.logprob_summary[t] = answer_logprobs(
                llm, wl.ids[t], answer, options)
            if tick:
                tick("reuse", 1)
        if config.concurrency > 1 and not arm.negatives_only:
            _store_donors(llm, wl, result, 1, None)
            llm.reset_prefix_cache()
            wall, runs = generate_batch(llm, [wl.ids[t] for t in targets], config.max_tokens)
            result.batch_wall_s, result.batch = wall, dict(zip(targets, runs, strict=True))
            if tick:
                tick("throughput", len(targets))
    return result


def planned_requests(config: BenchConfig, wl: Workload) -> int:
    """Progress-bar total: every request the run will send (warm-ups aside)."""
    total = 0
    negatives = sum(wl.negative[t] for t in wl.targets)
    for name in config.arms:
        arm = ARMS[name]
        n = negatives if arm.negatives_only else len(wl.targets)
        total += (0 if arm.negatives_only else n) + len(wl.donors) + n
        if config.concurrency > 1 and not arm.negatives_only:
            total += n
    return total


@contextlib.contextmanager
def progress_bar(total: int, enabled: bool) -> Iterator[Progress | None]:
    if not enabled:
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="req", dynamic_ncols=True) as bar:
        def tick(phase: str, n: int) -> None:
            bar.set_postfix_str(phase)
            bar.update(n)

        yield tick


def run_all(config: BenchConfig, wl: Workload, *, show_progress: bool = True,
            describe: Callable[[str], Any] | None = None) -> dict[str, ArmResult]:
    """Every arm of the config, the disabled baseline first (its cold runs are the reference)."""
    order = ["disabled", *[a for a in config.arms if a != "disabled"]]
    results: dict[str, ArmResult] = {}
    with progress_bar(planned_requests(config, wl), show_progress) as tick:
        for name in order:
            if describe:
                describe(name)
            results[name] = run_arm(ARMS[name], config, wl, results.get("disabled"), tick)
    return results
