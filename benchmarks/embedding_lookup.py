"""The embedding provider's lookup at 1K / 4K / 8K prompt tokens: its time against the lookup
budget, and what it finds, per embedded length.

Issue #51, step 1: on two cores a ~4.1K-token prompt's embedding lookup did not answer within
the connector's default ``lookup_timeout_ms`` (``provider_timeout``). The cost is one MiniLM
forward over the embedded head of the prompt (``max_text_chars``), not the prompt's length, so
this sweeps the embedded length and measures, on the real parts the engine uses:

- ``detokenize``: the bundled SmolLM2 tokenizer's ``decode`` of the whole prompt (the engine's
  ``ProviderContext.detokenize``; the provider gets token ids, not text);
- ``encode``: MiniLM on the text as the provider embeds it;
- ``lookup``: ``EmbeddingProvider.lookup`` end to end (detokenize, encode, faiss search) with
  the workload's donors registered and flushed, the vector cache off (every lookup encodes);
- ``cached``: the same lookup again with the vector cache on (a chat's next turn, a retry);
- discovery quality beside it: per kind, how often the true donor (or, for multi-donor RAG,
  one of its donors) comes first, the median cosine of that first candidate, and the highest
  cosine any negative control got (a threshold between the two separates them).

Prompts are the labelled workload (``semkv.eval``) at each length, ``--clusters`` per kind,
each looked up ``--repeats`` times after a warm-up. Torch and faiss get ``--threads`` (default
1: the engine's process has its own). Raw JSON to ``--out``; medians and p99 printed. Nothing is
stored but times, counts and cosines.

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
CHARS = (1000, 600, 400)
KINDS = ("cross_instruction", "paraphrased_lead_in", "partial_overlap", "reordered_chunks",
         "multi_passage_rag", "negative_same_topic", "negative_unrelated")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _summary(ms: list[float]) -> dict[str, float]:
    return {"p50_ms": statistics.median(ms), "p99_ms": _pct(ms, 0.99), "max_ms": max(ms),
            "n": len(ms)}


def _workload(length: int, args: argparse.Namespace, tokenizer: Any) -> tuple[Any, list[str]]:
    """One workload of every kind (one call: no two clusters share a document); where the
    corpora cannot supply them all at this length, the last kinds listed are dropped."""
    from semkv.eval import WorkloadSizeError, build_workload

    kinds = list(args.kinds)
    while kinds:
        try:
            return build_workload(0, clusters_per_type=args.clusters, target_tokens=length,
                                  tokenizer=tokenizer.encode, kinds=kinds), kinds
        except WorkloadSizeError:
            kinds.pop()
    raise SystemExit(f"no kind fits {length} tokens")


def _right(hits: list[Any], target: Any) -> bool:
    wanted = set(target.metadata.get("donor_ids") or []) | {target.true_donor_id}
    return bool(hits) and hits[0].donor_id in wanted


def measure(length: int, chars: int, prompts: dict[str, Any], ids: dict[str, list[int]],
            args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    from semkv.plugins import get_provider_class
    from semkv.provider import DonorRecord, LookupQuery, ProviderContext

    ctx = ProviderContext(block_size=32, detokenize=tokenizer.decode)
    config = {"max_text_chars": chars, "chunk_chars": chars, "vector_cache_entries": 0}
    provider = get_provider_class("embedding").from_config(config, ctx)
    cached = get_provider_class("embedding").from_config(
        dict(config, vector_cache_entries=1024), ctx)
    for d in prompts["donors"]:
        record = DonorRecord(donor_id=d.prompt_id, namespace="ns",
                             token_ids=tuple(ids[d.prompt_id]))
        provider.register_donor(record)
        cached.register_donor(record)
    provider.flush()
    cached.flush()
    encoder = provider._encoder  # noqa: SLF001 - the provider's own, as its lookup calls it
    times: dict[str, list[float]] = {"detokenize": [], "encode": [], "lookup": [], "cached": []}
    kinds: dict[str, dict[str, Any]] = {}
    tokens: list[int] = []
    clock = time.perf_counter
    for t in prompts["targets"]:
        q = tuple(ids[t.prompt_id])
        tokens.append(len(q))
        query = LookupQuery(request_id=t.prompt_id, namespace="ns", token_ids=q)
        provider.lookup(query)  # warm-up
        cached.lookup(query)  # fills its cache
        for _ in range(args.repeats):
            t0 = clock()
            text = tokenizer.decode(list(q))
            t1 = clock()
            encoder.encode([text], timeout_s=None)
            t2 = clock()
            hits = provider.lookup(query)
            t3 = clock()
            cached.lookup(query)
            t4 = clock()
            for key, ms in (("detokenize", t1 - t0), ("encode", t2 - t1), ("lookup", t3 - t2),
                            ("cached", t4 - t3)):
                times[key].append(ms * 1e3)
        row = kinds.setdefault(t.kind.value, {"targets": 0, "first": 0, "cosines": []})
        row["targets"] += 1
        row["cosines"].append(hits[0].similarity if hits else 0.0)
        row["first"] += int(t.true_donor_id is not None and _right(hits, t))
    provider.close()
    cached.close()
    for row in kinds.values():
        row["median_cosine"] = statistics.median(row["cosines"])
        row["max_cosine"] = max(row["cosines"])
    return {"target_tokens": length, "max_text_chars": chars,
            "prompt_tokens": {"min": min(tokens), "max": max(tokens)},
            "targets": len(prompts["targets"]), "kinds": kinds,
            **{k: _summary(v) for k, v in times.items()}}


def _print(r: dict[str, Any]) -> None:
    t = r["prompt_tokens"]
    print(f"{t['min']}-{t['max']} tokens, {r['max_text_chars']} chars: "
          + "; ".join(f"{k} p50 {r[k]['p50_ms']:.1f} p99 {r[k]['p99_ms']:.1f} ms"
                      for k in ("detokenize", "encode", "lookup", "cached")))
    for kind, row in sorted(r["kinds"].items()):
        first = "" if kind.startswith("negative") else f"first {row['first']}/{row['targets']}, "
        print(f"    {kind}: {first}cosine median {row['median_cosine']:.3f} "
              f"max {row['max_cosine']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    ap.add_argument("--chars", type=int, nargs="+", default=list(CHARS),
                    help="max_text_chars values to sweep (chunk_chars follows)")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS))
    ap.add_argument("--clusters", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
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
    print(f"lookup_timeout_ms default {budget:.0f}; {args.threads} thread(s)")
    rows = []
    for length in args.lengths:
        wl, kinds = _workload(length, args, tokenizer)
        if kinds != args.kinds:
            print(f"{length} tokens: kinds {kinds} (the corpora hold no more)")
        prompts = {"donors": wl.donors, "targets": wl.targets}
        ids = {p.prompt_id: list(p.token_ids or tokenizer.encode(p.text))
               for p in [*wl.donors, *wl.targets]}
        for chars in args.chars:
            rows.append(measure(length, chars, prompts, ids, args, tokenizer))
            _print(rows[-1])
    result = {"threads": args.threads, "cpus": os.cpu_count(), "lookup_timeout_ms": budget,
              "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
