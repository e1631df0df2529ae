"""The embedding provider's lookup at 1K / 4K / 8K prompt tokens, against the lookup budget.

Issue #51, step 1 (measure first): on two cores a ~4.1K-token prompt's embedding lookup did
not answer within the connector's default ``lookup_timeout_ms`` (``provider_timeout``). This
times, per prompt length, where a lookup's time goes, on the real parts the engine uses:

- ``detokenize``: the bundled SmolLM2 tokenizer's ``decode`` of the whole prompt (the engine's
  ``ProviderContext.detokenize``; the provider gets token ids, not text);
- ``encode``: MiniLM on the text as the provider embeds it (``max_text_chars``, ``chunk_chars``);
- ``lookup``: ``EmbeddingProvider.lookup`` end to end (detokenize, encode, faiss search) with
  the workload's donors registered and flushed.

Prompts are the bundled cross-instruction workload's targets (``semkv.eval``; their donors are
registered), ``--targets`` per length, each looked up ``--repeats`` times after a warm-up.
Threads: torch and faiss get ``--threads`` (default 1: the engine's process has its own).
Raw JSON to ``--out``; medians and p99 printed. Nothing is stored but times.

    .venv/bin/python benchmarks/embedding_lookup.py --out bench-results/embedding_lookup.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

LENGTHS = (1024, 4096, 8192)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _summary(ms: list[float]) -> dict[str, float]:
    return {"p50_ms": statistics.median(ms), "p99_ms": _pct(ms, 0.99), "max_ms": max(ms),
            "n": len(ms)}


def _workload(target_tokens: int, targets: int, tokenizer: Any) -> Any:
    from semkv.eval import build_workload

    return build_workload(0, clusters_per_type=targets, target_tokens=target_tokens,
                          tokenizer=tokenizer.encode, kinds=("cross_instruction",))


def measure(length: int, args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    from semkv.plugins import get_provider_class
    from semkv.provider import DonorRecord, LookupQuery, ProviderContext

    wl = _workload(length, args.targets, tokenizer)
    ids = {p.prompt_id: list(p.token_ids or tokenizer.encode(p.text))
           for p in [*wl.donors, *wl.targets]}
    ctx = ProviderContext(block_size=32, detokenize=tokenizer.decode)
    provider = get_provider_class("embedding").from_config(None, ctx)
    for d in wl.donors:
        provider.register_donor(DonorRecord(donor_id=d.prompt_id, namespace="ns",
                                            token_ids=tuple(ids[d.prompt_id])))
    provider.flush()
    encoder = provider._encoder  # noqa: SLF001 - the provider's own, as its lookup calls it
    times: dict[str, list[float]] = {"detokenize": [], "encode": [], "lookup": []}
    tokens, found = [], 0
    clock = time.perf_counter
    for t in wl.targets:
        q = tuple(ids[t.prompt_id])
        tokens.append(len(q))
        query = LookupQuery(request_id=t.prompt_id, namespace="ns", token_ids=q)
        provider.lookup(query)  # warm-up
        for _ in range(args.repeats):
            t0 = clock()
            text = tokenizer.decode(list(q))
            t1 = clock()
            encoder.encode([text], timeout_s=None)
            t2 = clock()
            hits = provider.lookup(query)
            t3 = clock()
            times["detokenize"].append((t1 - t0) * 1e3)
            times["encode"].append((t2 - t1) * 1e3)
            times["lookup"].append((t3 - t2) * 1e3)
        found += int(bool(hits) and hits[0].donor_id == t.true_donor_id)
    provider.close()
    return {"target_tokens": length, "prompt_tokens": {"min": min(tokens), "max": max(tokens)},
            "targets": len(wl.targets), "true_donor_first": found,
            **{k: _summary(v) for k, v in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    ap.add_argument("--targets", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("bench-results/embedding_lookup.json"))
    args = ap.parse_args()
    import torch
    from transformers import AutoTokenizer

    from semkv.bundled_model import ensure_model
    from semkv.config import SemkvConfig

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model()))
    budget = SemkvConfig().lookup_timeout_ms
    rows = [measure(n, args, tokenizer) for n in args.lengths]
    result = {"threads": args.threads, "cpus": os.cpu_count(), "lookup_timeout_ms": budget,
              "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"lookup_timeout_ms default {budget:.0f}; {args.threads} thread(s)")
    for r in rows:
        print(f"{r['prompt_tokens']['min']}-{r['prompt_tokens']['max']} tokens: "
              + "; ".join(f"{k} p50 {r[k]['p50_ms']:.1f} ms p99 {r[k]['p99_ms']:.1f} ms"
                          for k in ("detokenize", "encode", "lookup"))
              + f"; true donor first {r['true_donor_first']}/{r['targets']}")


if __name__ == "__main__":
    main()
