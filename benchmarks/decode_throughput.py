"""Decode throughput with the commit policy on and off, the plain engine beside them.

One run, three engines on the bundled model (vLLM CPU), all alive and used in turn so that
machine load drifts hit all alike, all bound to the same cores (``VLLM_CPU_OMP_THREADS_BIND``,
default core 0):
- ``plain``: no connector, vLLM's own scheduler (the ceiling);
- ``exact``: semkv's connector, ``materialize_exact``, vLLM's own scheduler (no policy needed);
- ``policy``: the README's setting, ``materialize_semantic`` with
  ``--scheduler-cls semkv_vllm.commit_policy.CommitPolicyScheduler`` (every commit asks the
  connector first).
Each round sends every engine the same ``--decodes`` short prompts (new ones per round, so no
prefix-cache hit), greedy, ``ignore_eos``, ``--decode-tokens`` each, in one batch: the time is
almost all decode steps. Throughput = output tokens / wall time of the batch. The engines'
order rotates per round. Prints median tokens/s per engine and the paired ratios per round
(exact/plain, policy/plain, policy/exact); raw JSON to ``--out``.

NOTE: vLLM's CPU platform turns async scheduling off whatever is asked, so on this machine all
three run the synchronous scheduler; the policy's class is the one vLLM would choose (an
``AsyncScheduler`` on a GPU: ``tests/test_commit_policy.py`` runs it there, in the harness).
The figure here is the cost of asking the connector before each commit, and of the connector
itself, per decode step.

    .venv/bin/python benchmarks/decode_throughput.py --rounds 5 --decodes 8 --decode-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

CONNECTOR = {"kv_connector": "SemanticKVConnector",
             "kv_connector_module_path": "semkv_vllm.connector",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
ENGINES: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "exact": {"provider": "chunks", "semantic_mode": "materialize_exact"},
    "policy": {"provider": "minhash", "semantic_mode": "materialize_semantic"},
}
TOPICS = ["a lighthouse keeper", "a city under the sea", "a clockmaker's apprentice",
          "a long winter voyage", "a forgotten library", "a mountain railway",
          "a desert observatory", "a river ferry"]
MAX_LEN = 1024


def build(extra: dict[str, Any] | None, max_seqs: int) -> Any:
    from vllm import LLM

    from semkv.bundled_model import ensure_model
    from semkv.kv_sizing import bundled_kv_cache_bytes

    kw: dict[str, Any] = dict(model=str(ensure_model()), dtype="float32",
                              kv_cache_memory_bytes=bundled_kv_cache_bytes(
                                  max_model_len=MAX_LEN, max_num_seqs=max_seqs),
                              max_model_len=MAX_LEN, max_num_seqs=max_seqs,
                              enable_prefix_caching=True, enforce_eager=True)
    if extra is not None:
        kw["kv_transfer_config"] = dict(CONNECTOR, kv_connector_extra_config=extra)
        if extra["semantic_mode"] == "materialize_semantic":
            kw["scheduler_cls"] = "semkv_vllm.commit_policy.CommitPolicyScheduler"
    return LLM(**kw)


def prompts(round_: int, count: int) -> list[str]:
    return [f"[{round_}-{i}] Write a long story about {TOPICS[i % len(TOPICS)]}. Story:"
            for i in range(count)]


def batch(llm: Any, texts: list[str], tokens: int) -> dict[str, float]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(texts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": wall, "tokens": produced, "tokens_per_s": produced / wall}


def main() -> None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decodes", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--reverse-build", action="store_true",
                        help="build the engines in reverse order (policy, exact, plain)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/decode_throughput.json"))
    args = parser.parse_args()
    # NOTE: the order engines are built in biases them (benchmarks/exact_ttft.py saw ~10 %):
    # --reverse-build reverses it, so the two orders together counterbalance it.
    built = list(ENGINES)[::-1] if args.reverse_build else list(ENGINES)
    engines = {name: build(ENGINES[name], args.decodes) for name in built}
    engines = {name: engines[name] for name in ENGINES}  # measured in the same rotation
    for llm in engines.values():
        batch(llm, ["warm-up: the first forward is always slower"], 8)
    names = list(engines)
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        texts = prompts(r, args.decodes)
        row = {name: batch(engines[name], texts, args.decode_tokens) for name in order}
        row["order"] = order
        rounds.append(row)
        print(f"round {r}: " + "  ".join(f"{n} {row[n]['tokens_per_s']:.1f} tok/s" for n in names))
    med = statistics.median
    summary: dict[str, Any] = {n: med(r[n]["tokens_per_s"] for r in rounds) for n in names}
    for a, b in (("exact", "plain"), ("policy", "plain"), ("policy", "exact")):
        summary[f"{a}/{b}"] = med(r[a]["tokens_per_s"] / r[b]["tokens_per_s"] for r in rounds)
    print("median tokens/s: " + "  ".join(f"{n} {summary[n]:.1f}" for n in names))
    print("paired ratios (median over rounds): " + "  ".join(
        f"{k} {v:.3f}" for k, v in summary.items() if "/" in k))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                    "engines": ENGINES, "rounds": rounds, "summary": summary},
                                   indent=2))


if __name__ == "__main__":
    main()
