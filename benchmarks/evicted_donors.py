"""TTFT of a target whose donor was evicted, against the same target's cold prefill (issue #53).

One engine on the bundled model (vLLM CPU) with the README's connector config (MinHash,
realized spans: a document behind another instruction is the verified tier), its donor store
sized for ``--store-donors`` donors. ``--donors`` documents are served behind instruction A:
the store keeps the last few, the first ones' KV is evicted. Then each document is asked again
behind instruction B, as a pair on the same engine, vLLM's own prefix cache emptied before
each run, the order alternating per pair (counterbalanced):
- ``cold``: semkv opted out (``lookup: false``);
- ``semkv``: looked up as any request (``save: false``: it never becomes a donor itself).
For the evicted documents semkv can serve nothing: ``semkv / cold`` is what a found-but-gone
donor costs (the target: <= 1.02x). For the kept ones it is the realized span's speed-up
(the control: the workload does reuse). TTFT = wall time of a 1-token generation. Prints a
table and writes raw JSON.

    .venv/bin/python benchmarks/evicted_donors.py --out bench-results/evicted_donors.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exact_ttft import build, prompts_of_length, readme_extra_config, ttft  # noqa: E402

INSTRUCTIONS = (
    "You are a careful reader. Read the passage below and answer the question that follows "
    "in one short sentence, quoting nothing.",
    "Summarise for a busy colleague: read the text that follows, then reply to the question "
    "at its end as briefly as you can.",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--donors", type=int, default=12)
    ap.add_argument("--store-donors", type=int, default=4, help="donors the store holds")
    ap.add_argument("--evicted", type=int, default=6, help="targets of evicted donors")
    ap.add_argument("--kept", type=int, default=2, help="targets of kept donors (control)")
    ap.add_argument("--tokens", type=int, default=1024, help="document length")
    ap.add_argument("--reps", type=int, default=3, help="pairs per target")
    ap.add_argument("--out", type=Path, default=Path("bench-results/evicted_donors.json"))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from semkv.bundled_model import ensure_model
    from semkv.kv_sizing import kv_bytes_per_token

    model = ensure_model()
    tok = AutoTokenizer.from_pretrained(str(model))
    docs = prompts_of_length(tok, args.tokens, args.donors, "evicted")
    per_donor = kv_bytes_per_token(str(model), dtype="float32") * (args.tokens + 64)
    config = {**readme_extra_config(), "request_options": True,
              "donor_store_bytes": int(per_donor * args.store_donors)}
    llm = build(config, args.tokens + 256)
    ttft(llm, "warm-up prompt: the engine's first forward is always cold", {}, fresh=True)
    donors = [f"{INSTRUCTIONS[0]}\n\n{d}" for d in docs]
    for prompt in donors:
        ttft(llm, prompt, {}, fresh=True)
    evicted = list(range(args.evicted))
    kept = list(range(args.donors - args.kept, args.donors))
    rows: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for i in evicted + kept:
            target = f"{INSTRUCTIONS[1]}\n\n{docs[i]}"
            arms = [("cold", {"lookup": False, "save": False}), ("semkv", {"save": False})]
            if (rep + i) % 2:
                arms.reverse()
            row: dict[str, Any] = {"doc": i, "rep": rep, "evicted": i in evicted,
                                   "first": arms[0][0]}
            for name, options in arms:
                row[name], row[f"{name}_summary"] = ttft(llm, target, options, fresh=True)
            row["ratio"] = row["semkv"] / row["cold"]
            rows.append(row)
            print(f"doc {i:>2} rep {rep} {'evicted' if i in evicted else 'kept   '} "
                  f"cold {row['cold']:.3f} s semkv {row['semkv']:.3f} s "
                  f"ratio {row['ratio']:.3f} {row['semkv_summary'].get('provenance')} "
                  f"{row['semkv_summary'].get('fallback_reason')}")
    med = statistics.median
    summary: dict[str, Any] = {}
    for label, group in (("evicted", [r for r in rows if r["evicted"]]),
                         ("kept", [r for r in rows if not r["evicted"]])):
        per_doc = {}
        for i in sorted({r["doc"] for r in group}):
            per_doc[i] = med(r["ratio"] for r in group if r["doc"] == i)
        summary[label] = {
            "pairs": len(group), "median_ratio": med(r["ratio"] for r in group),
            "per_doc_median_ratio": per_doc,
            "cold_median_s": med(r["cold"] for r in group),
            "semkv_median_s": med(r["semkv"] for r in group),
            "outcomes": sorted({f"{r['semkv_summary'].get('provenance')}/"
                                f"{r['semkv_summary'].get('fallback_reason')}" for r in group})}
        print(f"{label}: {len(group)} pairs, semkv/cold median {summary[label]['median_ratio']:.3f}"
              f" (per document {', '.join(f'{v:.3f}' for v in per_doc.values())}); "
              f"{summary[label]['outcomes']}")
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
               if "donor_evictions" in m.name or m.name == "vllm:semkv_donors"}
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "config": config,
               "rows": rows, "summary": summary, "metrics": metrics}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str))
    print(f"raw JSON: {args.out}")


if __name__ == "__main__":
    main()
