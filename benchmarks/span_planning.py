"""Span planning on vLLM's scheduler side: 16 candidate donors, a 4K-token prompt (issue #25).

No engine, no model forward; low priority (another job may share the machine)::

    nice -n 19 .venv/bin/python benchmarks/span_planning.py
    nice -n 19 .venv/bin/python benchmarks/span_planning.py --reps 400 --profile rag

What is timed: ``SpanAdmission.plan`` (``semkv_vllm.span_admission``), the call
``SpanDecision.realize`` makes per request, with the arguments the connector passes: the target
as a vLLM ``Request``'s ``all_token_ids`` (a real ``vllm.v1.request.Request``), local prefix 0,
the candidates, a donor-view callable (``DonorRegistry.view``'s work: the stored prefix of the
donor's block keys in a real ``StoreIndex``; token ids as ``array('q')``), the namespace, no
exact match, the engine's recompute strategy (config defaults). On it: a ``ClassGate``
(``--gate ungated``, the default, serves every class so every phase runs; ``shipped``: the
bundled model's policy, which refuses all but ``one_donor_in_order``), an ``EngineCost`` whose
rates were fitted on synthetic samples of the bundled model's order (``tests/test_cost_gate.py``),
the realization's memory bound (the bundled model's geometry), and the hold: one lease per donor
and every block a copy reads pinned. Each served plan is released before the next repetition.

Inputs: ``semkv.eval.build_workload`` at ``--target-tokens`` (4,096) tokenized with the bundled
model's tokenizer (token ids only are kept; no corpus text is written). Shapes (each target gets
its labelled donors, then other clusters' donors, up to ``--candidates``):

- ``in_order``: another instruction before the same document (``cross_instruction``);
- ``rag``: passages of 3-4 donors in a new order (``multi_passage_rag``);
- ``reordered``: one donor's chunks in another order (``reordered_chunks``);
- ``unrelated``: no donor shares the document (``negative_unrelated``: the plan is refused).

Per shape: median / p90 / p99 / max of ``--reps`` repetitions over the shape's targets in turn
(after ``--warmup``), then a second pass with the sub-calls wrapped in ``perf_counter_ns`` (from
here: the product holds no timing code) for the per-phase breakdown (mean ms per call). Beside
the wall clock, the thread's CPU time per call (``time.thread_time_ns``): on a shared machine
the wall clock also counts the time another job held the core.
Prints a table, writes raw JSON (numbers only) to ``bench-results/span_planning.json``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import shlex
import statistics
import sys
import time
from array import array
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

SHAPES = {"in_order": "cross_instruction", "rag": "multi_passage_rag",
          "reordered": "reordered_chunks", "unrelated": "negative_unrelated"}
NAMESPACE = "bench-namespace"
BLOCK = 32
TARGET_P99_MS = 5.0


def percentiles(samples_ns: list[int]) -> dict[str, float]:
    ms = sorted(s / 1e6 for s in samples_ns)
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"n": len(ms), "p50_ms": statistics.median(ms), "p90_ms": q[89], "p99_ms": q[98],
            "max_ms": ms[-1], "mean_ms": statistics.fmean(ms)}


def build_inputs(args: argparse.Namespace) -> dict[str, list[tuple[list[int], list[str]]]]:
    """Per shape: (target token ids, candidate donor ids) per target; and the donors' ids."""
    import tokenizers

    from semkv.bundled_model import model_dir
    from semkv.eval import build_workload

    tok = tokenizers.Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    wl = build_workload(args.seed, clusters_per_type=args.clusters,
                        target_tokens=args.target_tokens, kinds=tuple(SHAPES.values()),
                        tokenizer=lambda text: tok.encode(text, add_special_tokens=False).ids)
    global DONOR_TOKENS
    DONOR_TOKENS = {p.prompt_id: list(p.token_ids or ()) for p in wl.donors}
    rng = random.Random(args.seed)
    out: dict[str, list[tuple[list[int], list[str]]]] = {}
    for shape, kind in SHAPES.items():
        rows = []
        for t in (t for t in wl.targets if t.kind.value == kind):
            labelled = list(t.metadata.get("donor_ids") or ([t.true_donor_id]
                                                            if t.true_donor_id else []))
            others = sorted(d for d in DONOR_TOKENS if d not in labelled
                            and not d.startswith(t.cluster_id + "/"))
            rng.shuffle(others)
            picked = (labelled + others)[: args.candidates]
            if len(picked) < args.candidates:
                sys.exit(f"{t.prompt_id}: only {len(picked)} donors; raise --clusters")
            rng.shuffle(picked)  # a provider's order is its score's, not the label's
            rows.append((list(t.token_ids or ()), picked))
        out[shape] = rows
    return out


DONOR_TOKENS: dict[str, list[int]] = {}


class Scheduler:
    """The scheduler-side objects ``SpanAdmission.plan`` reads, real but engine-free."""

    def __init__(self, args: argparse.Namespace) -> None:
        from semkv_vllm.class_gate import ClassGate
        from semkv_vllm.cost_gate import EngineCost
        from semkv_vllm.span_admission import SpanAdmission, strategy_of
        from semkv_vllm.store_index import StoreIndex, block_keys

        from semkv.config import SemkvConfig
        from semkv.cost import RealizeWork, prefill_steps
        from semkv.gate_policy import read_policy
        from semkv.leases import LeaseTable
        from semkv.metrics import CounterBag
        from semkv.realize.memory import Budget, Geometry

        self.config = SemkvConfig()
        blocks = sum(len(t) // BLOCK for t in DONOR_TOKENS.values())
        self.index, self.leases = StoreIndex(blocks + 64), LeaseTable()
        self.keys: dict[str, list[bytes]] = {}
        self.tokens: dict[str, array[int]] = {}
        for donor_id, ids in DONOR_TOKENS.items():
            self.keys[donor_id] = block_keys(NAMESPACE, ids, BLOCK)
            for key in self.keys[donor_id]:
                self.index.reserve(key)
            self.tokens[donor_id] = array("q", ids)
            self.leases.publish(donor_id)
        # The bundled model's per-rank geometry (SmolLM2-135M, float32).
        geometry = Geometry(layers=30, kv_heads=3, heads=9, head_dim=64, hidden=576,
                            intermediate=1536, dtype_bytes=4)
        budget = Budget(geometry, int(self.config.realize_memory_bytes), 4096)
        self.spans = SpanAdmission(self.config, BLOCK, self.index, self.leases, self.keys.get,
                                   budget=budget, stats=CounterBag())
        if args.gate == "ungated":
            self.spans.classes = ClassGate(None, "ungated", ungated=True)
        else:
            root = Path(__file__).resolve().parents[1] / "semkv" / "policies"
            path = root / "smollm2-135m-instruct-float32.json"
            self.spans.classes = ClassGate(read_policy(path), str(path))
        cost = EngineCost(4096, 30)
        rng = random.Random(0)  # rates of the bundled model's order (tests/test_cost_gate.py)
        for _ in range(30):
            for w in prefill_steps(0, rng.randint(100, 4000), 1024):
                cost.rates.add_step(w, sum(r * f for r, f in zip(
                    (0.02, 1.5e-3, 1.7e-6), w.features(), strict=True)))
        for _ in range(12):
            r = RealizeWork(rng.randint(0, 4000), float(rng.randint(0, 2000)),
                            float(rng.randint(0, 4_000_000)))
            cost.rates.add_realization(r, sum(a * f for a, f in zip(
                (0.05, 1e-4, 2.0e-3, 2.5e-6), r.features(), strict=True)))
        self.spans.cost = cost
        self.recompute = strategy_of(self.config)

    def view(self, donor_id: str) -> Any:
        from semkv.admission import DonorView

        keys = self.keys.get(donor_id)
        if keys is None:
            return None
        return DonorView(donor_id, NAMESPACE, self.tokens[donor_id],
                         self.index.stored_prefix(keys) * BLOCK)


def requests(rows: list[tuple[list[int], list[str]]]) -> list[tuple[Any, list[Any]]]:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from semkv.types import Candidate

    out = []
    for i, (ids, donors) in enumerate(rows):
        req = Request(request_id=f"bench-{i}", prompt_token_ids=ids, pooling_params=None,
                      sampling_params=SamplingParams(max_tokens=1))
        out.append((req, [Candidate(donor_id=d, namespace=NAMESPACE, similarity=0.5)
                          for d in donors]))
    return out


def plan_once(side: Scheduler, req: Any, cands: list[Any]) -> tuple[str, int]:
    got = side.spans.plan(req.request_id, req.all_token_ids, 0, cands, side.view, NAMESPACE,
                          None, side.recompute, None, request_recompute=False)
    if isinstance(got, tuple):
        side.spans.release(got[1])
        return "served", got[1].plan.copied_tokens
    return str(got.value), 0


def timed(side: Scheduler, reqs: list[tuple[Any, list[Any]]], reps: int,
          warmup: int) -> tuple[list[int], list[int], dict[str, int]]:
    outcomes: dict[str, int] = defaultdict(int)
    for i in range(warmup):
        plan_once(side, *reqs[i % len(reqs)])
    clock, cpu, samples, cpu_samples = time.perf_counter_ns, time.thread_time_ns, [], []
    for i in range(reps):
        t0, c0 = clock(), cpu()
        outcome, _ = plan_once(side, *reqs[i % len(reqs)])
        samples.append(clock() - t0)
        cpu_samples.append(cpu() - c0)
        outcomes[outcome] += 1
    return samples, cpu_samples, dict(outcomes)


def breakdown(side: Scheduler, reqs: list[tuple[Any, list[Any]]], reps: int) -> dict[str, float]:
    """Mean ms per plan call by phase: the sub-calls wrapped from here (nested ones subtracted)."""
    import semkv_vllm.span_admission as admission

    import semkv.span_map as span_map
    import semkv.span_plan as span_plan

    spent: dict[str, int] = defaultdict(int)
    stack: list[int] = []  # time spent in wrapped callees, per open wrapped call

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*a: Any, **k: Any) -> Any:
            stack.append(0)
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                total = time.perf_counter_ns() - t0
                spent[name] += total - stack.pop()  # own time only
                if stack:
                    stack[-1] += total
        return inner

    patches = [(span_map, "anchor_index", "map: donor anchor index"),
               (span_plan, "anchor_index", "map: donor anchor index"),
               (span_map, "_walk", "map: walk"),
               (span_plan, "walk_donor", "map: anchor look-ups"),
               (span_plan, "gram_keys", "map: target k-grams"),
               (span_map, "gram_keys", "map: target k-grams"),
               (span_plan, "_choose", "decide: target keys, usable"),
               (getattr(span_map, "TargetGrams", None), "sampled_held",
                "candidates: sampled anchors held"),
               (span_plan, "map_tokens", "map: walk"),  # before issue #25's walk
               (span_plan, "_map_donor", "map: continue past a short donor"),
               (span_plan, "_best_donor_per_chunk", "best donor per chunk"),
               (span_plan, "_runs", "runs"),
               (admission, "plan_span", "plan_span: clip + SpanPlan"),
               (admission, "plan_class", "class"),
               (admission, "plan_working_set", "memory bound")]
    patches = [p for p in patches if hasattr(p[0], p[1])]
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in patches]
    sp = side.spans
    inst = [(sp, "_hold", "hold: leases + pins"), (sp.classes, "strategy", "class gate"),
            (sp.cost, "predicted_gain", "cost gate")]
    view = side.view
    try:
        for mod, attr, name in patches:
            setattr(mod, attr, wrap(name, getattr(mod, attr)))
        for obj, attr, name in inst:
            setattr(obj, attr, wrap(name, getattr(obj, attr)))
        side.view = wrap("donor views", view)  # type: ignore[method-assign]
        plan = wrap("other (candidates, match)", side.spans.plan)
        for i in range(reps):
            req, cands = reqs[i % len(reqs)]
            got = plan(req.request_id, req.all_token_ids, 0, cands, side.view, NAMESPACE,
                       None, side.recompute, None, request_recompute=False)
            if isinstance(got, tuple):
                sp.release(got[1])
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)
        for obj, attr, _ in inst:
            delattr(obj, attr)
        side.view = view  # type: ignore[method-assign]
    return {k: v / reps / 1e6 for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}


def profile(side: Scheduler, reqs: list[tuple[Any, list[Any]]], reps: int) -> None:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for i in range(reps):
        plan_once(side, *reqs[i % len(reqs)])
    prof.disable()
    top = int(os.environ.get("TOP", "25"))  # SORT=cumulative TOP=40: the call tree's view
    pstats.Stats(prof).sort_stats(os.environ.get("SORT", "tottime")).print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--reps", type=int, default=300, help="timed plan calls per shape")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--breakdown-reps", type=int, default=100)
    parser.add_argument("--candidates", type=int, default=16)
    parser.add_argument("--target-tokens", type=int, default=4096)
    parser.add_argument("--clusters", type=int, default=4, help="clusters per shape (targets)")
    parser.add_argument("--gate", choices=("ungated", "shipped"), default="ungated")
    parser.add_argument("--profile", choices=list(SHAPES), help="cProfile one shape, then exit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-results/span_planning.json"))
    args = parser.parse_args()
    command = shlex.join([sys.executable, *sys.argv])
    print(f"command: {command}", flush=True)
    inputs = build_inputs(args)
    side = Scheduler(args)
    # vLLM's EngineCore freezes its start-up heap (vllm.utils.gc_utils.freeze_gc_heap), so the
    # scheduler's full collections skip the static objects; the same here, or one collection
    # of this process's start-up heap (tokenizer, vLLM modules) lands in a timed call.
    gc.collect()
    gc.freeze()
    if args.profile:
        profile(side, requests(inputs[args.profile]), args.reps)
        return
    results = []
    for shape in args.shapes:
        reqs = requests(inputs[shape])
        samples, cpu_samples, outcomes = timed(side, reqs, args.reps, args.warmup)
        copied = [plan_once(side, *r)[1] for r in reqs]
        res = {"shape": shape, "kind": SHAPES[shape], "targets": len(reqs),
               "target_tokens": [len(r[0].all_token_ids) for r in reqs],
               "candidates": args.candidates, "copied_tokens": copied, "outcomes": outcomes,
               "plan": percentiles(samples), "plan_thread_cpu": percentiles(cpu_samples),
               "breakdown_mean_ms": breakdown(side, reqs, args.breakdown_reps)}
        results.append(res)
        p = res["plan"]
        print(f"{shape}: p50 {p['p50_ms']:.2f} ms, p99 {p['p99_ms']:.2f} ms; {outcomes}",
              flush=True)
    assert side.leases.live_count() == 0 and side.index.pinned_slots() == 0, "hold leak"
    print("\n| shape | outcome | p50 ms | p90 ms | p99 ms | max ms | p99 < 5 ms "
          "| thread CPU p50 / p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        p, c = r["plan"], r["plan_thread_cpu"]
        print(f"| {r['shape']} | {', '.join(r['outcomes'])} | {p['p50_ms']:.2f} | "
              f"{p['p90_ms']:.2f} | {p['p99_ms']:.2f} | {p['max_ms']:.2f} | "
              f"{'PASS' if p['p99_ms'] < TARGET_P99_MS else 'MISS'} | "
              f"{c['p50_ms']:.2f} / {c['p99_ms']:.2f} |")
    print("\nbreakdown, mean ms per call (own time; wrapped calls add a little overhead):")
    for r in results:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in r["breakdown_mean_ms"].items() if v >= 0.005)
        print(f"- {r['shape']}: {parts}")
    out = {"command": command,
           "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "loadavg": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
           "nice": os.nice(0), "params": {k: str(v) for k, v in vars(args).items()},
           "block_size": BLOCK, "target_p99_ms": TARGET_P99_MS, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"\nraw JSON: {args.out}")


if __name__ == "__main__":
    main()
