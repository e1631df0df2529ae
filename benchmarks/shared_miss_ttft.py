"""A miss's TTFT with the shared lookup on (Redis discovery, LMCache KV) against cold, over HTTP
(issue #51: the miss path stays in the noise, target <= 1.02x).

Three services on loopback, started here: a Redis-protocol server, ``lmcache server`` (chunk =
vLLM's block size, 32; KV through shared memory, as docs/lmcache.md starts it) and a semkv
server with docs/lmcache.md's configuration plus shared discovery (``provider: chunks``,
``materialize_exact``, ``donor_store: lmcache``, ``provider_config.discovery_store`` = the Redis
URL) on the README's flags (``--block-size 32``). Every prompt is new (consecutive,
non-overlapping windows of the bundled essays, never written or logged), so ``miss`` pays the
provider's lookup in Redis, the prefix index, the donor's registration and save, and finds
nothing; ``cold`` is another new prompt of the same length opting out of semkv
(``semkv_options``: lookup and save off). One server for both: two servers differ by more than
the 2 % measured (their build order alone moved TTFT 8-10 % in earlier runs; ``--plain`` adds a
plain vLLM server's cold beside them to show it). Pairs alternate their order; TTFT is measured
at the client (streamed completion of two tokens: the second token's step pays a store held past
the first, reported as the whole answer), and semkv's own time on the critical path is read from
``/metrics`` around each request (``vllm:semkv_scheduler_seconds`` +
``vllm:semkv_save_wait_seconds``).

NOTE: the opted-out request still passes through the embedded LMCache connector (vLLM asks it
about every request): ``cold`` includes LMCache's own lookup, so ``miss / cold`` is semkv's
cost over LMCache's, and ``semkv share`` its own time whatever the reference.

    .venv/bin/python benchmarks/shared_miss_ttft.py --out bench-results/shared_miss_ttft.json
    .venv/bin/python benchmarks/shared_miss_ttft.py --store host --chars 4000 --pairs 12 \
        --out bench-results/shared_miss_ttft_redis_only.json   # one shared part at a time
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

BLOCK = 32


class Texts:
    """Consecutive non-overlapping windows of the bundled essays, one after the other across
    every length asked for: no two prompts of a run share text, so none finds another."""

    def __init__(self) -> None:
        from semkv.eval.corpus import load_essays

        self._text = "\n\n".join(essay.text for essay in load_essays())
        self._at = 0

    def take(self, chars: int) -> str:
        if self._at + chars > len(self._text):
            raise SystemExit(f"the essays hold no more new {chars}-character prompts: "
                             "ask for fewer pairs or shorter prompts")
        self._at += chars
        return self._text[self._at - chars:self._at]


def _ttft(client: Any, model: str, prompt: str, extra: dict[str, Any] | None) -> float:
    return _timed(client, model, prompt, extra)[0]


def _timed(client: Any, model: str, prompt: str,
           extra: dict[str, Any] | None) -> tuple[float, float]:
    """(time to the first token, time to the whole two-token answer), at the client: the
    second token's step is where a store held past the first token is paid."""
    started = time.perf_counter()
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=2,
                                       temperature=0, stream=True,
                                       extra_body={**(extra or {}), "ignore_eos": True})
    first = None
    for _ in stream:
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - started, end - started


CRITICAL = ("vllm:semkv_scheduler_seconds_sum", "vllm:semkv_save_wait_seconds_sum")


def _semkv_seconds(base: str) -> float:
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{", 1)[0].split(" ", 1)[0] in CRITICAL)


def _pairs(client: Any, base: str, model: str, texts: Texts, args: argparse.Namespace,
           chars: int, pairs: int, plain: Any) -> list[dict[str, Any]]:
    from semkv.request_options import request_params

    optout = {"kv_transfer_params": request_params(lookup=False, save=False)}
    rows = []
    for k in range(pairs):
        order = ("miss", "cold") if k % 2 == 0 else ("cold", "miss")
        row: dict[str, Any] = {"chars": chars, "pair": k, "first": order[0]}
        for name in order:
            time.sleep(args.pause_s)  # the last donor save settles first
            spent = _semkv_seconds(base)
            row[f"{name}_s"], row[f"{name}_end_s"] = _timed(
                client, model, texts.take(chars), optout if name == "cold" else None)
            time.sleep(args.pause_s)  # metrics are exported on the engine's steps
            row[f"{name}_semkv_s"] = _semkv_seconds(base) - spent
        if plain is not None:
            time.sleep(args.pause_s)
            row["plain_cold_s"] = _ttft(plain, model, texts.take(chars), None)
        rows.append(row)
    return rows


def measure(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    import contextlib

    import openai
    from semkv_vllm.bench.serve import (
        lmcache_server,
        redis_server,
        served,
        served_records,
        server_args,
    )

    with contextlib.ExitStack() as stack:
        config: dict[str, Any] = {"provider": "chunks", "semantic_mode": "materialize_exact"}
        if args.discovery == "redis":
            redis_url = stack.enter_context(redis_server(logs / "redis.log"))
            config["provider_config"] = {"discovery_store": redis_url}
        if args.store == "lmcache":
            lmcache_url = stack.enter_context(
                lmcache_server(logs / "lmcache.log", chunk_size=BLOCK,
                               shm_name=None if args.lmcache_shm else ""))
            config.update(donor_store="lmcache", lmcache_server_url=lmcache_url)
        plain = None
        if args.plain:
            base = stack.enter_context(served(server_args(None, block_size=BLOCK),
                                              log=logs / "plain.log"))
            plain = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        base = stack.enter_context(served(server_args(config, block_size=BLOCK),
                                          log=logs / "semkv.log"))
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        rows = []
        texts = Texts()
        for chars, pairs in zip(args.chars, args.pairs, strict=True):
            for warm in (client, plain):  # a server's first requests are slow: not counted
                if warm is not None:
                    _ttft(warm, model, texts.take(chars), None)
            rows += _pairs(client, base, model, texts, args, chars, pairs, plain)
        records = served_records(logs / "semkv.log")
    return {"rows": rows, "records": [{k: r.get(k) for k in (
        "provenance", "fallback_reason", "external_tokens")} for r in records]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chars", type=int, nargs="+", default=[4000, 12000],
                    help="prompt lengths in characters (about 1K and 3K tokens)")
    ap.add_argument("--pairs", type=int, nargs="+", default=[24, 18],
                    help="pairs per length (the essays hold ~640K characters in all)")
    ap.add_argument("--pause-s", type=float, default=0.5)
    ap.add_argument("--discovery", choices=["redis", "memory"], default="redis",
                    help="the provider's index: shared in Redis (default) or in the process")
    ap.add_argument("--store", choices=["lmcache", "host"], default="lmcache",
                    help="donor KV: the shared LMCache server (default) or semkv's host store")
    ap.add_argument("--lmcache-shm", action=argparse.BooleanOptionalAction, default=True,
                    help="the lmcache server moves KV through shared memory (--shm-name), "
                         "as docs/lmcache.md starts it; --no-lmcache-shm: pickled messages")
    ap.add_argument("--plain", action="store_true",
                    help="also a plain vLLM server's cold per pair (another server: biased)")
    ap.add_argument("--out", type=Path, default=Path("bench-results/shared_miss_ttft.json"))
    ap.add_argument("--logs", type=Path, default=None,
                    help="keep the servers' logs in this folder (default: a temporary one)")
    args = ap.parse_args()
    if len(args.pairs) != len(args.chars):
        ap.error("--pairs takes one count per --chars length")
    if args.logs is not None:
        args.logs.mkdir(parents=True, exist_ok=True)
        result = measure(args, args.logs)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            result = measure(args, Path(tmp))
    summary = {}
    med = statistics.median
    boot = random.Random(0)
    for chars in args.chars:
        rows = [r for r in result["rows"] if r["chars"] == chars]
        ratios = [r["miss_s"] / r["cold_s"] for r in rows]
        resampled = sorted(med(boot.choices(ratios, k=len(ratios))) for _ in range(2000))
        summary[str(chars)] = {
            "pairs": len(rows), "miss_over_cold_paired_median": med(ratios),
            "interval_95": [resampled[50], resampled[1949]],
            "miss_first": med(x for x, r in zip(ratios, rows, strict=True)
                              if r["first"] == "miss"),
            "cold_first": med(x for x, r in zip(ratios, rows, strict=True)
                              if r["first"] == "cold"),
            "cold_median_s": med(r["cold_s"] for r in rows),
            "miss_median_s": med(r["miss_s"] for r in rows),
            "semkv_share_of_miss": med(r["miss_semkv_s"] / r["miss_s"] for r in rows),
            # the whole two-token answer: what a store held past the first token costs
            "miss_over_cold_answer_paired_median": med(r["miss_end_s"] / r["cold_end_s"]
                                                       for r in rows)}
        if args.plain:
            summary[str(chars)]["plain_cold_median_s"] = med(r["plain_cold_s"] for r in rows)
    kinds: dict[str, int] = {}
    for r in result["records"]:
        key = f"{r['provenance']}:{r['fallback_reason']}"
        kinds[key] = kinds.get(key, 0) + 1
    result.update(summary=summary, semkv_records=kinds, discovery=args.discovery,
                  store=args.store, lmcache_shm=args.lmcache_shm,
                  started_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({"summary": summary, "semkv_records": kinds}, indent=2))


if __name__ == "__main__":
    main()
