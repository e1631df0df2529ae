"""TTFT of plain requests while the shared discovery store is healthy, slow or stalled
(issue #53).

One engine on the bundled model (vLLM CPU), the README's connector config with its provider's
index in Redis (``discovery_store``), reached through a loopback proxy (``tests/tcp_proxy.py``)
that passes the traffic, delays every reply (``--delay``, under the write timeout: no write
ever fails, the queue would grow), or swallows it. In each mode, ``--pairs`` never-seen prompts
(plain requests: nothing to reuse, every one is looked up and saved as a donor) against the
same prompt opted out of semkv (``lookup: false, save: false``), order alternating per pair.
Reported per mode: median TTFT of each arm, the paired ratio (the target: unchanged, ~1.0x),
and what the store's failures cost in donors (registrations dropped or failed). TTFT = wall
time of a 1-token generation, one request at a time. Raw JSON.

    .venv/bin/python benchmarks/slow_store_ttft.py --out bench-results/slow_store_ttft.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from exact_ttft import build, prompts_of_length, readme_extra_config, ttft  # noqa: E402

from tests.tcp_proxy import TcpProxy  # noqa: E402

OPTED_OUT = {"lookup": False, "save": False}


def provider_counts(llm: Any) -> dict[str, float]:
    """The lookup errors and the guarded provider's write counters, from the engine's metrics."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if "lookup_errors" in m.name or "donor_registrations" in m.name:
            labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items())
                              if k not in ("engine", "model_name"))
            out[f"{m.name}{{{labels}}}"] = float(getattr(m, "value", 0.0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=8, help="prompt pairs per mode")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--delay", type=float, default=0.7, help="seconds each reply is held")
    ap.add_argument("--modes", nargs="+", default=["healthy", "slow", "stalled", "healthy"])
    ap.add_argument("--out", type=Path, default=Path("bench-results/slow_store_ttft.json"))
    args = ap.parse_args()

    from semkv_vllm.bench.serve import redis_server
    from transformers import AutoTokenizer

    from semkv.bundled_model import ensure_model

    tok = AutoTokenizer.from_pretrained(str(ensure_model()))
    proxy_mode = {"healthy": "pass", "slow": "delay", "stalled": "stall"}
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "modes": []}
    with tempfile.TemporaryDirectory() as folder, \
            redis_server(Path(folder) / "redis.log") as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        proxy = TcpProxy(port, delay_s=args.delay)
        extra = readme_extra_config()
        config = {**extra, "request_options": True,
                  "provider_config": {**extra.get("provider_config", {}),
                                      "discovery_store": proxy.url}}
        results["config"] = config
        llm = build(config, args.tokens + 256)
        # documents of their own per mode: nothing any request could reuse
        everything = prompts_of_length(tok, args.tokens, args.pairs * len(args.modes), "store")
        ttft(llm, "warm-up prompt: the engine's first forward is always cold")
        for m, mode in enumerate(args.modes):
            proxy.mode = proxy_mode[mode]
            prompts = everything[m * args.pairs : (m + 1) * args.pairs]  # never seen before
            rows = []
            before = provider_counts(llm)
            for i, prompt in enumerate(prompts):
                arms = [("cold", OPTED_OUT), ("plain", {})]
                if i % 2:
                    arms.reverse()
                row: dict[str, Any] = {"pair": i, "first": arms[0][0]}
                for name, options in arms:
                    row[name], row[f"{name}_summary"] = ttft(llm, prompt, options, fresh=True)
                row["ratio"] = row["plain"] / row["cold"]
                rows.append(row)
            after = provider_counts(llm)
            med = statistics.median
            summary = {"mode": mode, "pairs": len(rows),
                       "cold_median_s": med(r["cold"] for r in rows),
                       "plain_median_s": med(r["plain"] for r in rows),
                       "ratio_median": med(r["ratio"] for r in rows),
                       "ratio_range": [min(r["ratio"] for r in rows),
                                       max(r["ratio"] for r in rows)],
                       "outcomes": sorted({f"{r['plain_summary'].get('provenance')}/"
                                           f"{r['plain_summary'].get('fallback_reason')}"
                                           for r in rows}),
                       "counters_moved": {k: v - before.get(k, 0.0) for k, v in after.items()
                                          if v != before.get(k, 0.0)}}
            results["modes"].append({**summary, "rows": rows})
            print(f"{mode:>8}: plain/cold {summary['ratio_median']:.3f} "
                  f"({summary['ratio_range'][0]:.3f}-{summary['ratio_range'][1]:.3f}), cold "
                  f"{summary['cold_median_s']:.3f} s, plain {summary['plain_median_s']:.3f} s; "
                  f"{summary['outcomes']}; {summary['counters_moved']}")
        proxy.mode = "pass"
        results["counters"] = provider_counts(llm)
        proxy.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str))
    print(f"raw JSON: {args.out}")


if __name__ == "__main__":
    main()
