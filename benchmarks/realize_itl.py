"""Does a span realization stall the requests that keep decoding beside it?

One vLLM CPU engine on the bundled model, driven through the serving path
(``vllm.v1.engine.async_llm.AsyncLLM``, ``RequestOutputKind.DELTA``): every streamed delta of a
decode gets a wall-clock arrival time in this process, as a streaming client would see it.
Each round runs three phases, their order rotating per round so drift hits all alike:

- ``A`` (baseline): ``--decodes`` short prompts, greedy, ``ignore_eos``, decode alone.
- ``B`` (realize): the same decodes; once each has ``--warm`` tokens, ``--targets`` RAG
  targets are submitted together. Their donors (one passage each) were served beforehand and
  then dropped from vLLM's prefix cache (``reset_prefix_cache``), so each target is realized:
  it waits in WAITING_FOR_REMOTE_KVS while the worker copies donor KV and computes the gaps
  between engine steps (a bounded amount per busy step). Checked per target:
  ``provenance == request_only_semantic_reuse``.
- ``C`` (cold control): the same decodes and targets with semkv's store emptied
  (``reset_prefix_cache(reset_connector=True)``): plain prefills (``fallback_recompute``,
  ``provider_miss``).

ITL = time between consecutive deltas of a decode (a delta holding k > 1 tokens counts once;
their number is reported; the decodes share every step: one step, one sample per decode).
A, all gaps after ``--warm`` tokens up to ``--decode-tokens``. B and C, the gaps ending
inside the window from the targets' submission to the last target's first token
(submit-to-first-token spans the realization and the final prefill of the tail; in C the cold
prefill); the decodes run on until then. ``vllm:semkv_realize_seconds`` (worker time
per realization) is reported beside the window. Prints median / p99 / max ITL per phase, the
ratios B/A and C/A, the targets' TTFT realized vs cold; raw JSON to ``--out``.

    .venv/bin/python benchmarks/realize_itl.py --rounds 3 --targets 2 --target-tokens 1024
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONNECTOR = {"kv_connector": "SemanticKVConnector",
             "kv_connector_module_path": "semkv_vllm.connector",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
EXTRA = {"provider": "minhash", "semantic_mode": "materialize_semantic",
         "semantic_tiers": ["verified"], "realize_spans": True,
         "min_reuse_tokens": 100_000,  # the exact tier never wins: every hit is a realization
         "verified_min_reuse_tokens": 64, "lookup_timeout_ms": 10_000,
         "provider_config": {"threshold": 0.1}}
TOPICS = ["a lighthouse keeper", "a city under the sea", "a clockmaker's apprentice",
          "a long winter voyage", "a forgotten library", "a mountain railway"]
BLOCK = 32
MAX_LEN = 4096
SETTLE_S = 0.5  # lets a background donor save finish before the next phase


@dataclass
class Stream:
    submitted: float
    times: list[float] = field(default_factory=list)  # arrival of each delta
    counts: list[int] = field(default_factory=list)  # tokens in each delta
    semkv: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(self.counts)

    def gaps(self) -> list[tuple[float, float, int]]:
        """(end time, gap s, tokens) per delta after the first."""
        return [(self.times[i], self.times[i] - self.times[i - 1], self.counts[i])
                for i in range(1, len(self.times))]


async def stream(engine: Any, prompt: str, max_tokens: int, rid: str, rec: Stream | None = None,
                 stop: asyncio.Event | None = None, min_tokens: int = 0) -> Stream:
    """Stream one greedy request into ``rec``; with ``stop``, end it once set and
    ``min_tokens`` are out."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA)
    rec = rec or Stream(0.0)
    rec.submitted = time.perf_counter()
    gen = engine.generate(prompt, sp, rid)
    try:
        async for out in gen:
            now = time.perf_counter()
            n = len(out.outputs[0].token_ids)
            if n:
                rec.times.append(now)
                rec.counts.append(n)
            if out.kv_transfer_params:
                rec.semkv = dict(out.kv_transfer_params.get("semkv", {}))
            if stop is not None and stop.is_set() and rec.tokens >= min_tokens:
                break
    finally:
        await gen.aclose()  # aborts the request when it was left early
    return rec


def realize_stats() -> tuple[float, float]:
    """Sum and count of ``vllm:semkv_realize_seconds`` so far (this process's registry)."""
    from vllm.v1.metrics.reader import Histogram, get_metrics_snapshot

    total, count = 0.0, 0.0
    for m in get_metrics_snapshot():
        if m.name == "vllm:semkv_realize_seconds" and isinstance(m, Histogram):
            total, count = total + m.sum, count + m.count
    return total, count


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summarize(itls: list[float]) -> dict[str, Any]:
    return {"n": len(itls), "median_ms": statistics.median(itls) * 1e3 if itls else None,
            "p99_ms": pct(itls, 0.99) * 1e3, "max_ms": max(itls, default=float("nan")) * 1e3}


class Bench:
    def __init__(self, engine: Any, args: argparse.Namespace,
                 clusters: list[tuple[list[str], str]]) -> None:
        self.engine, self.args = engine, args
        self.clusters = clusters  # (donor passages, target) per cluster
        self.decode_prompts = [f"Write a very long story about {TOPICS[i % len(TOPICS)]}."
                               for i in range(args.decodes)]
        self.seq = 0

    def rid(self, tag: str) -> str:
        self.seq += 1
        return f"{tag}-{self.seq}"

    async def serve_donors(self, clusters: list[tuple[list[str], str]]) -> None:
        await self.engine.reset_prefix_cache(reset_connector=True)
        for donors, _ in clusters:
            for d in donors:
                await stream(self.engine, d, 1, self.rid("donor"))
        await asyncio.sleep(SETTLE_S)
        await self.engine.reset_prefix_cache()  # vLLM forgets them; semkv's store keeps them

    async def phase(self, kind: str, clusters: list[tuple[list[str], str]]) -> dict[str, Any]:
        a = self.args
        if kind == "B":
            await self.serve_donors(clusters)
        else:  # A and C: nothing in semkv's store, nothing in vLLM's prefix cache
            await self.engine.reset_prefix_cache(reset_connector=True)
        stop = asyncio.Event()  # A's decodes end at their token budget
        budget = a.decode_tokens if kind == "A" else MAX_LEN - 64
        live = [Stream(0.0) for _ in self.decode_prompts]
        decodes = [asyncio.create_task(stream(self.engine, p, budget, self.rid(f"dec{kind}"),
                                              rec, stop, a.decode_tokens))
                   for p, rec in zip(self.decode_prompts, live, strict=True)]
        out: dict[str, Any] = {"phase": kind}
        if kind == "A":
            recs = await asyncio.gather(*decodes)
            cut = [r.times[a.warm] if len(r.times) > a.warm else float("inf") for r in recs]
            itl = [g for r, c in zip(recs, cut, strict=True) for t, g, _ in r.gaps() if t > c]
        else:
            while min(s.tokens for s in live) < a.warm and not any(t.done() for t in decodes):
                await asyncio.sleep(0.002)
            before = realize_stats()
            t0 = time.perf_counter()
            targets = await asyncio.gather(*(
                stream(self.engine, target, a.target_out, self.rid(f"tgt{kind}"))
                for _, target in clusters))
            t1 = max(r.times[0] for r in targets)
            after = realize_stats()
            stop.set()
            recs = await asyncio.gather(*decodes)
            itl = [g for r in recs for t, g, _ in r.gaps() if t0 < t <= t1]
            out.update(window_s=t1 - t0,
                       realize_seconds=after[0] - before[0], realizations=after[1] - before[1],
                       targets=[{"ttft_s": r.times[0] - r.submitted,
                                 "submit_offset_s": r.submitted - t0,
                                 "provenance": r.semkv.get("provenance"),
                                 "span": r.semkv.get("span"),
                                 "external_tokens": r.semkv.get("external_tokens"),
                                 "confirmed_loaded_tokens": r.semkv.get(
                                     "confirmed_loaded_tokens"),
                                 "fallback_reason": r.semkv.get("fallback_reason")}
                                for r in targets])
        out["itl_s"] = itl
        out["coalesced_deltas"] = sum(1 for r in recs for c in r.counts[1:] if c > 1)
        out["decode_tokens"] = [r.tokens for r in recs]
        out["decode_times"] = [[round(t - r.submitted, 5) for t in r.times] for r in recs]
        return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from semkv.bundled_model import ensure_model
    from semkv.eval import build_workload
    from semkv.kv_sizing import bundled_kv_cache_bytes

    measured = git_state()  # before the engine imports the adapter
    engine_args = AsyncEngineArgs(
        model=str(ensure_model()), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK,
        enable_prefix_caching=True, enforce_eager=True, max_num_batched_tokens=1024,
        disable_log_stats=False, seed=0,
        kv_cache_memory_bytes=bundled_kv_cache_bytes(
            max_model_len=MAX_LEN, max_num_seqs=args.decodes + args.targets, block_size=BLOCK),
        kv_transfer_config=dict(CONNECTOR, kv_connector_extra_config={
            "summary_to_client": True, **EXTRA}),  # its own operator: reads summaries
        scheduler_cls="semkv_vllm.commit_policy.CommitPolicyScheduler")
    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        tok = engine.get_tokenizer()
        wl = build_workload(args.seed, clusters_per_type=args.targets + 1,
                            target_tokens=args.target_tokens,
                            tokenizer=lambda t: list(tok(t)["input_ids"]),
                            kinds=["multi_passage_rag"])
        by_cluster = wl.clusters()
        clusters = [([p.text for p in ps if p.role == "donor"],
                     next(p.text for p in ps if p.role == "target"))
                    for ps in by_cluster.values()]
        bench = Bench(engine, args, clusters[1:])
        started = time.perf_counter()
        # warm-up: one realization and one cold prefill on a cluster never measured
        for kind in ("B", "C"):
            await bench.phase(kind, clusters[:1])
        phases: list[dict[str, Any]] = []
        orders = ["ABC", "BCA", "CAB"]
        for rnd in range(args.rounds):
            for kind in orders[rnd % 3]:
                res = await bench.phase(kind, bench.clusters)
                res["round"] = rnd
                phases.append(res)
                r = summarize(res["itl_s"])
                print(f"round {rnd} {kind}: n={r['n']} median={r['median_ms']:.1f} ms "
                      f"p99={r['p99_ms']:.1f} ms window={res.get('window_s', 0):.2f} s",
                      flush=True)
        return {"args": vars(args), "seconds": time.perf_counter() - started, "git": measured,
                "target_prompt_tokens": [len(tok(t)["input_ids"]) for _, t in bench.clusters],
                "phases": phases}
    finally:
        engine.shutdown()
        del engine
        gc.collect()  # not at interpreter exit, where AsyncLLM.__del__ fails


def git_state() -> dict[str, Any]:
    """The commit measured and which tracked files differed from it (a shared checkout)."""
    def git(*cmd: str) -> str:
        done = subprocess.run(["git", *cmd], capture_output=True, text=True, check=False)
        return done.stdout.rstrip()

    return {"commit": git("rev-parse", "HEAD"),
            "modified": git("status", "--porcelain", "-uno").splitlines()}


def report(raw: dict[str, Any]) -> dict[str, Any]:
    by = {k: [p for p in raw["phases"] if p["phase"] == k] for k in "ABC"}
    s = {k: summarize([g for p in ps for g in p["itl_s"]]) for k, ps in by.items()}
    print(f"\n{'phase':<22}{'n':>6}{'median ms':>11}{'p99 ms':>9}{'max ms':>9}"
          f"{'med/A':>8}{'p99/A':>8}")
    names = {"A": "A decode alone", "B": "B during realization", "C": "C during cold prefill"}
    for k in "ABC":
        r = s[k]
        print(f"{names[k]:<22}{r['n']:>6}{r['median_ms']:>11.1f}{r['p99_ms']:>9.1f}"
              f"{r['max_ms']:>9.1f}{r['median_ms'] / s['A']['median_ms']:>8.2f}"
              f"{r['p99_ms'] / s['A']['p99_ms']:>8.2f}")
    for k, label in (("B", "realized"), ("C", "cold")):
        ttft = [t["ttft_s"] for p in by[k] for t in p["targets"]]
        prov = sorted({str(t["provenance"]) for p in by[k] for t in p["targets"]})
        win = [p["window_s"] for p in by[k]]
        print(f"targets {label:<9} TTFT median {statistics.median(ttft):.2f} s "
              f"(min {min(ttft):.2f}, max {max(ttft):.2f}); window median "
              f"{statistics.median(win):.2f} s; provenance {prov}")
    rs = [p["realize_seconds"] / max(1.0, p["realizations"]) for p in by["B"]]
    print(f"semkv-realize worker seconds per realization (median over rounds): "
          f"{statistics.median(rs):.2f}")
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decodes", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--warm", type=int, default=8, help="decode tokens before targets start")
    ap.add_argument("--targets", type=int, default=2)
    ap.add_argument("--target-tokens", type=int, default=1024)
    ap.add_argument("--target-out", type=int, default=2, help="tokens each target generates")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--out", default="bench-results/realize_itl.json")
    args = ap.parse_args()
    raw = asyncio.run(run(args))
    raw["summary"] = report(raw)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(raw, indent=1))
    print(f"raw: {path}")


if __name__ == "__main__":
    main()
