"""Discovery latency, insert throughput and memory per donor at 1K / 10K / 100K donors.

One core, low priority (another job may share the machine)::

    taskset -c 0 nice -n 5 .venv/bin/python benchmarks/discovery_latency.py
    taskset -c 0 nice -n 5 .venv/bin/python benchmarks/discovery_latency.py --sizes 100000 \\
        --providers chunks

OMP / MKL / OpenBLAS / torch / faiss threads are set to 1 here, before numpy loads. Each
(provider, size) runs in a fresh subprocess (clean RSS, no state carried over), which inherits
the CPU affinity and niceness of this one.

What is measured (``ProviderContext(block_size=32, detokenize=synthetic_detokenize)``, default
``provider_config`` unless noted):

- ``chunks``, ``minhash``: donors are synthetic token documents, 512 ids each drawn uniformly
  from ``semkv.testing.synthetic``'s 4,096-id vocabulary (numpy, seeded; the same distribution
  as ``SyntheticCorpus``, generated faster). Insert throughput = ``register_donor`` calls per
  second (record construction excluded). Lookup = ``provider.lookup`` wall time over a mix of
  512-token queries: a registered donor repeated (hit), a donor's first 256 tokens followed by
  256 new ones (partial hit), and a new document (miss), in equal shares.
- ``embedding`` (index ``flat``, the default, and ``hnsw``): embedding 100K texts with MiniLM on
  one core would take over an hour, so at every size the index is filled with **synthetic
  random unit vectors** (384-d), inserted through the provider's own indexing step
  (``EmbeddingProvider._insert``, batches of ``batch_size``), i.e. no model call. Two lookup
  figures: "index search" = ``NamespaceIndex.search`` alone (the faiss call and its filtering),
  and "lookup, pre-computed embedding" = ``provider.lookup`` end to end with the encoder
  swapped for a table of pre-computed query vectors (state lock, search, candidate building;
  no model). Queries: half near-duplicates of a donor vector (small noise), half random.
  Insert throughput here is index-only (no embedding).
- ``embedding (real MiniLM)``, at sizes up to ``--embed-real`` (default 1,000): real donors
  (synthetic documents detokenized to pseudo-words), ``register_donor`` + ``flush`` timed
  together (background embedding + indexing: the real insert throughput), and real end-to-end
  lookups including the query embedding, plus the pre-computed-embedding lookup on those
  real vectors.
- Memory per donor: RSS growth over the inserts / donors (``/proc/self/statm``, after a full
  GC), and for the Python-side state, ``tracemalloc`` over a fresh provider with
  min(size, 2,000) donors (tracemalloc does not see faiss' C++ allocations).
- Full GC pause: one ``gc.collect()`` with all donors held (a stall of the serving process).

Targets (from the issue): p99 lookup < 1 ms for chunks and minhash at 100K donors, < 5 ms for
the embedding index search at 100K. Prints a table with PASS/MISS, writes raw JSON (numbers
only) to ``bench-results/discovery_latency.json``.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
             "VECLIB_MAXIMUM_THREADS"):
    os.environ[_var] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

NAMESPACE = "bench"
DOC_TOKENS = 512
BLOCK_SIZE = 32
BATCH = 1000
TARGET_SIZE = 100_000
TARGETS_MS = {"chunks": 1.0, "minhash": 1.0, "embedding-flat": 5.0, "embedding-hnsw": 5.0}
VARIANTS = ("chunks", "minhash", "embedding-flat", "embedding-hnsw")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def percentiles(samples_ns: list[int]) -> dict[str, float]:
    ms = sorted(s / 1e6 for s in samples_ns)
    if not ms:
        return {}
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"n": len(ms), "p50_ms": statistics.median(ms), "p90_ms": q[89], "p99_ms": q[98],
            "max_ms": ms[-1], "mean_ms": statistics.fmean(ms)}


class Docs:
    """Seeded uniform token documents over the synthetic vocabulary; ids share int objects."""

    def __init__(self, seed: int) -> None:
        import numpy as np

        from semkv.testing.synthetic import VOCAB_SIZE

        self._rng = np.random.default_rng(seed)
        self._vocab = VOCAB_SIZE
        self._ints = list(range(VOCAB_SIZE))

    def batch(self, count: int, tokens: int = DOC_TOKENS) -> list[tuple[int, ...]]:
        rows = self._rng.integers(0, self._vocab, size=(count, tokens)).tolist()
        get = self._ints.__getitem__
        return [tuple(map(get, row)) for row in rows]


def full_gc_ms() -> float:
    t0 = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - t0) * 1000


def timed_lookups(provider: Any, queries: list[Any], warmup: int) -> list[int]:
    for q in queries[:warmup]:
        provider.lookup(q)
    out = []
    clock = time.perf_counter_ns
    for q in queries:
        t0 = clock()
        provider.lookup(q)
        out.append(clock() - t0)
    return out


# -- chunks / minhash ---------------------------------------------------------------------------


def token_worker(name: str, size: int, args: argparse.Namespace) -> dict[str, Any]:
    from semkv.plugins import get_provider_class
    from semkv.provider import DonorRecord, LookupQuery, ProviderContext
    from semkv.testing.synthetic import synthetic_detokenize

    cls = get_provider_class(name)
    ctx = ProviderContext(block_size=BLOCK_SIZE, detokenize=synthetic_detokenize)
    docs = Docs(args.seed)
    provider = cls.from_config(None, ctx)
    provider.register_donor(DonorRecord(donor_id="warm", namespace="warm",
                                        token_ids=docs.batch(1)[0]))  # lazy imports, first use
    provider.evict("warm")
    gc.collect()
    rss0 = rss_bytes()
    keep_every = max(1, size // args.lookups)
    kept: list[tuple[str, tuple[int, ...]]] = []
    insert_ns = 0
    clock = time.perf_counter_ns
    for start in range(0, size, BATCH):
        batch = docs.batch(min(BATCH, size - start))
        records = [DonorRecord(donor_id=f"d{start + i}", namespace=NAMESPACE, token_ids=t)
                   for i, t in enumerate(batch)]
        t0 = clock()
        for r in records:
            provider.register_donor(r)
        insert_ns += clock() - t0
        kept.extend((r.donor_id, r.token_ids) for i, r in enumerate(records)
                    if (start + i) % keep_every == 0)
        del batch, records
    gc.collect()
    rss1 = rss_bytes()
    # Queries: exact repeat / half-shared / unrelated, in turn.
    fresh = docs.batch(args.lookups)
    queries, expect = [], []
    for i in range(args.lookups):
        donor_id, tokens = kept[i % len(kept)]
        shape = ("exact", "partial", "miss")[i % 3]
        if shape == "exact":
            q = tokens
        elif shape == "partial":
            q = tokens[: DOC_TOKENS // 2] + fresh[i][: DOC_TOKENS // 2]
        else:
            q = fresh[i]
        queries.append(LookupQuery(request_id=f"q{i}", namespace=NAMESPACE, token_ids=q,
                                   max_candidates=5))
        expect.append((shape, donor_id))
    gc_before = [s["collections"] for s in gc.get_stats()]
    samples = timed_lookups(provider, queries, args.warmup)
    gc_after = [s["collections"] for s in gc.get_stats()]
    found = {"exact": 0, "partial": 0, "miss_with_candidates": 0}
    for q, (shape, donor_id) in zip(queries, expect, strict=True):
        cands = provider.lookup(q)
        if shape == "miss":
            found["miss_with_candidates"] += bool(cands)
        elif cands and cands[0].donor_id == donor_id:
            found[shape] += 1
    by_shape = {s: percentiles([x for x, (sh, _) in zip(samples, expect, strict=True) if sh == s])
                for s in ("exact", "partial", "miss")}
    gc_ms = full_gc_ms()
    stats = provider.stats()
    provider.close()
    del provider, kept, queries
    gc.collect()
    return {
        "provider": name, "variant": name, "donors": size, "vectors": None,
        "insert_donors_per_s": size / (insert_ns / 1e9),
        "insert_s": insert_ns / 1e9,
        "lookup": percentiles(samples),
        "lookup_by_query_shape": by_shape,
        "top1_correct": {k: v for k, v in found.items()},
        "queries_per_shape": args.lookups // 3,
        "gc_collections_during_lookups": [b - a for a, b in zip(gc_before, gc_after, strict=True)],
        "rss_per_donor_bytes": (rss1 - rss0) / size,
        "rss_growth_bytes": rss1 - rss0,
        "tracemalloc_per_donor_bytes": tracemalloc_per_donor(cls, ctx, min(size, 2000), args.seed),
        "full_gc_ms": gc_ms,
        "provider_stats": stats,
    }


def tracemalloc_per_donor(cls: Any, ctx: Any, count: int, seed: int) -> float:
    from semkv.provider import DonorRecord

    provider = cls.from_config(None, ctx)
    provider.register_donor(DonorRecord(donor_id="warm", namespace="warm",
                                        token_ids=tuple(range(DOC_TOKENS))))
    provider.evict("warm")
    docs = Docs(seed + 1).batch(count)
    records = [DonorRecord(donor_id=f"t{i}", namespace=NAMESPACE, token_ids=t)
               for i, t in enumerate(docs)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for r in records:
        provider.register_donor(r)
    del r
    provider.flush()
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    provider.close()
    return (after - before) / count


# -- embedding ------------------------------------------------------------------------------------


class PrecomputedEncoder:
    """Stands in for the provider's encoder at lookup: returns pre-computed vectors by text."""

    def __init__(self, inner: Any, table: dict[str, Any]) -> None:
        self.inner = inner
        self.table = table

    @property
    def dim(self) -> int:
        return int(self.inner.dim)

    def encode(self, texts: list[str], timeout_s: float | None = None) -> Any:
        import numpy as np

        return np.stack([self.table[t] for t in texts])


def _unit(rng: Any, n: int, dim: int) -> Any:
    import numpy as np

    v = rng.standard_normal((n, dim)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return v


def _insert_vectors(provider: Any, ids: list[str], vectors: Any) -> None:
    """Index ``vectors`` through the provider's own insert step (its background thread's)."""
    from semkv_embedding.provider import _Pending

    bs = provider.config.batch_size
    with provider._state:
        for s in range(0, len(ids), bs):
            batch = []
            for donor_id in ids[s : s + bs]:
                provider._tickets += 1
                item = _Pending(provider._tickets, donor_id, NAMESPACE, (), None)
                provider._taken[donor_id] = item.ticket
                batch.append(item)
            provider._insert(batch, vectors[s : s + bs])
            for item in batch:
                del provider._taken[item.donor_id]


def embedding_worker(variant: str, size: int, args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch
    from semkv_embedding import EmbeddingProvider

    from semkv.provider import LookupQuery, ProviderContext
    from semkv.testing.synthetic import synthetic_detokenize

    torch.set_num_threads(1)
    kind = variant.split("-", 1)[1]
    ctx = ProviderContext(block_size=BLOCK_SIZE, detokenize=synthetic_detokenize)
    provider = EmbeddingProvider.from_config({"index": kind}, ctx)
    dim = provider._encoder.dim
    rng = np.random.default_rng(args.seed)
    gc.collect()
    rss0 = rss_bytes()
    donor_ids = [f"d{i}" for i in range(size)]
    t0 = time.perf_counter()
    for s in range(0, size, BATCH):
        _insert_vectors(provider, donor_ids[s : s + BATCH], _unit(rng, min(BATCH, size - s), dim))
    insert_s = time.perf_counter() - t0
    gc.collect()
    rss1 = rss_bytes()
    space = provider._spaces[NAMESPACE]
    q = args.embedding_lookups
    picks = rng.integers(0, size, size=q)
    # Faiss ids are the provider's own (sequential here); IndexIDMap2 reconstructs by id.
    donor_vecs = np.stack(
        [space.index.reconstruct(provider._indexed[f"d{int(i)}"][1]) for i in picks]
    )
    noisy = donor_vecs + 0.05 * _unit(rng, q, dim)
    noisy /= np.linalg.norm(noisy, axis=1, keepdims=True)
    rand = _unit(rng, q, dim)
    qvecs = np.where((np.arange(q) % 2 == 0)[:, None], noisy, rand).astype(np.float32)
    expect = [f"d{int(i)}" if k % 2 == 0 else None for k, i in enumerate(picks)]
    # Index search alone.
    clock = time.perf_counter_ns
    for v in qvecs[: args.warmup]:
        space.search(v, 5)
    search_ns, hits = [], 0
    for v, want in zip(qvecs, expect, strict=True):
        t = clock()
        found = space.search(v, 5)
        search_ns.append(clock() - t)
        if want is not None and found and provider._donor_of.get(found[0][0]) == want:
            hits += 1
    # provider.lookup with pre-computed query vectors.
    table = {f"query {k}": qvecs[k] for k in range(q)}
    real_encoder = provider._encoder
    provider._encoder = PrecomputedEncoder(real_encoder, table)
    queries = [LookupQuery(request_id=f"q{k}", namespace=NAMESPACE, token_ids=(), text=f"query {k}",
                           max_candidates=5) for k in range(q)]
    lookup_ns = timed_lookups(provider, queries, args.warmup)
    provider._encoder = real_encoder
    gc_ms = full_gc_ms()
    stats = provider.stats()
    provider.close()
    return {
        "provider": "embedding", "variant": variant, "donors": size,
        "vectors": "synthetic random unit vectors (no embedding)",
        "insert_donors_per_s": size / insert_s, "insert_s": insert_s,
        "insert_note": "index-only (EmbeddingProvider._insert, batches of batch_size); no model",
        "index_search": percentiles(search_ns),
        "lookup_precomputed_embedding": percentiles(lookup_ns),
        "near_duplicate_top1_found": hits,
        "near_duplicate_queries": sum(e is not None for e in expect),
        "rss_per_donor_bytes": (rss1 - rss0) / size, "rss_growth_bytes": rss1 - rss0,
        "tracemalloc_per_donor_bytes": None,
        "full_gc_ms": gc_ms, "provider_stats": stats,
    }


def embedding_real_worker(size: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from semkv_embedding import EmbeddingProvider

    from semkv.provider import DonorRecord, LookupQuery, ProviderContext
    from semkv.testing.synthetic import synthetic_detokenize

    torch.set_num_threads(1)
    ctx = ProviderContext(block_size=BLOCK_SIZE, detokenize=synthetic_detokenize)
    provider = EmbeddingProvider.from_config({"index": "flat"}, ctx)
    docs = Docs(args.seed)
    provider.register_donor(DonorRecord(donor_id="warm", namespace="warm",
                                        token_ids=docs.batch(1)[0]))
    provider.flush()  # model warm, first batch paid
    provider.evict("warm")
    donors = docs.batch(size)
    records = [DonorRecord(donor_id=f"d{i}", namespace=NAMESPACE, token_ids=t)
               for i, t in enumerate(donors)]
    gc.collect()
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    for r in records:
        provider.register_donor(r)
    enqueue_s = time.perf_counter() - t0
    provider.flush()
    insert_s = time.perf_counter() - t0
    gc.collect()
    rss1 = rss_bytes()
    n = args.e2e_lookups
    fresh = docs.batch(n)
    queries = [LookupQuery(request_id=f"q{k}", namespace=NAMESPACE,
                           token_ids=donors[k * 7 % size] if k % 2 == 0 else fresh[k],
                           max_candidates=5) for k in range(n)]
    e2e_ns = timed_lookups(provider, queries, 3)
    correct = sum(
        bool(c) and c[0].donor_id == f"d{k * 7 % size}"
        for k, c in ((k, provider.lookup(queries[k])) for k in range(0, n, 2))
    )
    # Same queries with their (real) vectors pre-computed: lookup without the model.
    texts = [synthetic_detokenize(q.token_ids) for q in queries]
    vecs = provider._encoder.encode(texts)
    real_encoder = provider._encoder
    provider._encoder = PrecomputedEncoder(real_encoder, dict(zip(texts, vecs, strict=True)))
    pre_ns = timed_lookups(provider, queries * max(1, args.embedding_lookups // n), 3)
    provider._encoder = real_encoder
    space = provider._spaces[NAMESPACE]
    search_ns = []
    for v in list(vecs) * max(1, args.embedding_lookups // n):
        t = time.perf_counter_ns()
        space.search(v, 5)
        search_ns.append(time.perf_counter_ns() - t)
    gc_ms = full_gc_ms()
    stats = provider.stats()
    provider.close()
    return {
        "provider": "embedding", "variant": "embedding-real", "donors": size,
        "vectors": "real MiniLM embeddings of synthetic pseudo-word documents",
        "insert_donors_per_s": size / insert_s, "insert_s": insert_s, "enqueue_s": enqueue_s,
        "insert_note": "register_donor + flush: background detokenize + MiniLM + index (1 thread)",
        "end_to_end_lookup": percentiles(e2e_ns),
        "end_to_end_top1_correct": correct, "end_to_end_hit_queries": (n + 1) // 2,
        "lookup_precomputed_embedding": percentiles(pre_ns),
        "index_search": percentiles(search_ns),
        "rss_per_donor_bytes": (rss1 - rss0) / size, "rss_growth_bytes": rss1 - rss0,
        "tracemalloc_per_donor_bytes": None, "full_gc_ms": gc_ms, "provider_stats": stats,
    }


# -- driver ---------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    variant, size = args.worker[0], int(args.worker[1])
    if variant in ("chunks", "minhash"):
        out = token_worker(variant, size, args)
    elif variant == "embedding-real":
        out = embedding_real_worker(size, args)
    else:
        out = embedding_worker(variant, size, args)
    out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print("RESULT " + json.dumps(out))


def machine() -> dict[str, Any]:
    up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {"uptime": up, "loadavg": [round(x, 2) for x in os.getloadavg()],
            "affinity": sorted(os.sched_getaffinity(0)), "nice": os.nice(0),
            "cpus": os.cpu_count()}


def row_cells(r: dict[str, Any]) -> list[tuple[str, dict[str, Any] | None, float | None]]:
    """(metric label, percentiles, target ms or None) rows of one result."""
    v, size = r["variant"], r["donors"]
    target = TARGETS_MS.get(v) if size == TARGET_SIZE else None
    if v in ("chunks", "minhash"):
        return [("lookup", r["lookup"], target)]
    if v == "embedding-real":
        return [("end-to-end lookup (MiniLM query embedding)", r["end_to_end_lookup"], None),
                ("lookup, pre-computed embedding", r["lookup_precomputed_embedding"], None),
                ("index search", r["index_search"], None)]
    return [("index search", r["index_search"], target),
            ("lookup, pre-computed embedding", r["lookup_precomputed_embedding"], None)]


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| provider | donors | vectors | metric | p50 ms | p99 ms | max ms | target p99 | result | "
        "insert donors/s | RSS B/donor | tracemalloc B/donor | full GC ms | load (1-min) |",
        "|" + "---|" * 14,
    ]
    for r in results:
        vec = "–" if r["vectors"] is None else ("real" if "real" in r["vectors"] else "synthetic")
        for label, p, target in row_cells(r):
            verdict = "–" if target is None else ("PASS" if p["p99_ms"] < target else "MISS")
            tm = r.get("tracemalloc_per_donor_bytes")
            gcm = r.get("full_gc_ms")
            lines.append(
                f"| {r['variant']} | {r['donors']:,} | {vec} | {label} | {p['p50_ms']:.3f} | "
                f"{p['p99_ms']:.3f} | {p['max_ms']:.2f} | "
                f"{'–' if target is None else f'< {target:g} ms'} | {verdict} | "
                f"{r['insert_donors_per_s']:,.0f} | {r['rss_per_donor_bytes']:,.0f} | "
                f"{'–' if tm is None else f'{tm:,.0f}'} | "
                f"{'–' if gcm is None else f'{gcm:.0f}'} | {r['loadavg_end'][0]:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000, 100_000])
    parser.add_argument("--providers", nargs="+", default=list(VARIANTS),
                        help=f"any of {', '.join(VARIANTS)}")
    parser.add_argument("--lookups", type=int, default=3000,
                        help="timed lookups per chunks/minhash run (after --warmup)")
    parser.add_argument("--embedding-lookups", type=int, default=600)
    parser.add_argument("--e2e-lookups", type=int, default=40,
                        help="real end-to-end embedding lookups (each embeds its query)")
    parser.add_argument("--embed-real", type=int, default=1000,
                        help="largest size also run with real MiniLM embeddings (0: never)")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-results/discovery_latency.json"))
    parser.add_argument("--worker", nargs=2, metavar=("VARIANT", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    command = shlex.join([sys.executable, *sys.argv])
    print(f"command: {command}", flush=True)
    start = machine()
    print(f"machine: {start}", flush=True)
    jobs = [(v, s) for v in args.providers for s in sorted(args.sizes)]
    if "embedding-flat" in args.providers or "embedding-hnsw" in args.providers:
        jobs += [("embedding-real", s) for s in sorted(args.sizes) if s <= args.embed_real]
    passthrough = ["--lookups", str(args.lookups), "--embedding-lookups",
                   str(args.embedding_lookups), "--e2e-lookups", str(args.e2e_lookups),
                   "--warmup", str(args.warmup), "--seed", str(args.seed)]
    results = []
    for variant, size in jobs:
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", variant, str(size), *passthrough],
            capture_output=True, text=True,
        )
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            print(f"{variant} @ {size}: FAILED (rc {proc.returncode})\n{proc.stderr[-3000:]}",
                  flush=True)
            continue
        res = json.loads(line[len("RESULT "):])
        res["wall_s"] = time.perf_counter() - t0
        results.append(res)
        main_p = row_cells(res)[0][1]
        print(f"{variant} @ {size:,}: {res['wall_s']:.0f} s; p50 {main_p['p50_ms']:.3f} ms, "
              f"p99 {main_p['p99_ms']:.3f} ms; load {res['loadavg_end']}", flush=True)
    end = machine()
    md = table(results)
    print()
    print(md)
    out = {
        "command": command,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine_start": start, "machine_end": end,
        "params": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
        "doc_tokens": DOC_TOKENS, "block_size": BLOCK_SIZE, "targets_ms_p99_at_100k": TARGETS_MS,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"\nraw JSON: {args.out}")


if __name__ == "__main__":
    main()
