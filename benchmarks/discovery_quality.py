"""Discovery quality of each installed provider on the labelled workloads of ``semkv.eval``.

For every provider (default: chunks, minhash, embedding, and SemBlend's own discovery as the
``semblend`` provider, shown as "peer"): build the labelled workload (fixed seed), tokenize it
with the bundled model's tokenizer, register every donor (namespace ``bench``), ``flush``, then
look up every target with ``max_candidates=5``. Per provider and cluster kind it reports:

- positives: recall of the true donor at rank 1 and within the top 5 (raw provider output, and
  at rank 1 once the candidate's similarity must reach 0.5 / 0.8 / 0.9);
- negative controls (``negative_unrelated``, ``negative_same_topic``): false-positive rate, a
  target counting as a false positive when the provider returns any candidate at all (raw), or
  any candidate with similarity >= 0.5 / 0.8 / 0.9;
- reusable tokens found: ``semkv.verify`` of the top candidate against the target gives the
  exact-prefix tokens (whole blocks) and the longest identical block-aligned run; the same for
  the true donor ("oracle": what a perfect discovery would have handed to the verifier).

Providers get ``ProviderContext(block_size=32, detokenize=tokenizer.decode)`` and their default
``provider_config``; donors and queries carry token ids only (as the vLLM adapter sends them),
so text-based providers detokenize. Prints markdown tables and writes raw JSON (counts, prompt
ids, donor ids and scores only: never text, token ids or embeddings) to
``bench-results/discovery_quality.json``.

    .venv/bin/python benchmarks/discovery_quality.py --clusters-per-type 8 --target-tokens 2048
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

NAMESPACE = "bench"
THRESHOLDS = (0.5, 0.8, 0.9)
DEFAULT_PROVIDERS = ("chunks", "minhash", "embedding", "semblend")
PEER = {"semblend"}  # SemBlend's own discovery: shown side by side as the peer


def label(name: str) -> str:
    return f"{name} (peer)" if name in PEER else name


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def build(args: argparse.Namespace) -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    from semkv.bundled_model import ensure_model
    from semkv.eval import build_workload

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model()))

    def tokenize(text: str) -> list[int]:
        return tokenizer(text)["input_ids"]  # what the engine's tokenizer gives a prompt

    wl = build_workload(
        args.seed,
        clusters_per_type=args.clusters_per_type,
        target_tokens=args.target_tokens,
        tokenizer=tokenize,
    )
    return tokenizer, wl


def candidate_row(c: Any) -> dict[str, Any]:
    return {
        "donor_id": c.donor_id,
        "similarity": round(c.similarity, 6),
        "target_start": c.target_start,
        "donor_start": c.donor_start,
        "num_tokens": c.num_tokens,
        "signals": {k: round(v, 6) for k, v in c.signals.items()},
    }


def verification_row(v: Any) -> dict[str, Any]:
    return {
        "exact_prefix_tokens": v.exact_prefix_tokens,
        "common_prefix_tokens": v.common_prefix_tokens,
        "run_tokens": v.run_tokens,
        "run_target_start": v.run_target_start,
        "run_donor_start": v.run_donor_start,
        "judged_tokens": v.num_tokens,
        "judged_source": v.span_source,
        "judged_token_differences": v.token_differences,
        "judged_similarity": round(v.similarity, 6),
        "tier": v.tier.value,
    }


def run_provider(name: str, tokenizer: Any, wl: Any, args: argparse.Namespace) -> dict[str, Any]:
    from semkv.plugins import get_provider_class
    from semkv.provider import DonorRecord, LookupQuery, ProviderContext
    from semkv.verify import verify

    ids = {p.prompt_id: p.token_ids for p in (*wl.donors, *wl.targets)}
    ctx = ProviderContext(block_size=args.block_size, detokenize=tokenizer.decode)
    t0 = time.perf_counter()
    provider = get_provider_class(name).from_config(None, ctx)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for donor in wl.donors:
        provider.register_donor(
            DonorRecord(donor_id=donor.prompt_id, namespace=NAMESPACE, token_ids=donor.token_ids)
        )
    register_s = time.perf_counter() - t0
    provider.flush()
    flush_s = time.perf_counter() - t0
    rows = []
    for target in wl.targets:
        query = LookupQuery(
            request_id=target.prompt_id, namespace=NAMESPACE, token_ids=target.token_ids,
            max_candidates=args.max_candidates,
        )
        t0 = time.perf_counter()
        cands = provider.lookup(query)
        lookup_ms = (time.perf_counter() - t0) * 1000
        ranked = [c.donor_id for c in cands]
        true = target.true_donor_id
        row: dict[str, Any] = {
            "target_id": target.prompt_id,
            "kind": target.kind.value,
            "true_donor_id": true,
            "decoy_donor_id": target.metadata.get("decoy_donor_id"),
            "change": target.metadata.get("change"),  # cross_instruction: system/wrapper/both
            "target_tokens": len(target.token_ids),
            "lookup_ms": round(lookup_ms, 3),
            "candidates": [candidate_row(c) for c in cands],
            "true_rank": ranked.index(true) + 1 if true in ranked else None,
            "top": None,
            "oracle": None,
        }
        if cands:
            top = cands[0]
            row["top"] = verification_row(
                verify(target.token_ids, ids[top.donor_id], args.block_size, top)
            )
        if true is not None:
            row["oracle"] = verification_row(verify(target.token_ids, ids[true], args.block_size))
        rows.append(row)
    stats = provider.stats()
    provider.close()
    return {
        "provider": name,
        "peer": name in PEER,
        "capabilities": get_provider_class(name).capabilities.model_dump(),
        "build_s": round(build_s, 3),
        "register_s": round(register_s, 3),
        "register_and_flush_s": round(flush_s, 3),
        "stats": stats,
        "targets": rows,
    }


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts and rates of one group of targets (one kind, or all positives/negatives)."""
    out: dict[str, Any] = {"n": len(rows)}
    pos = [r for r in rows if r["true_donor_id"] is not None]
    neg = [r for r in rows if r["true_donor_id"] is None]

    def top_sim(r: dict[str, Any]) -> float:
        return r["candidates"][0]["similarity"] if r["candidates"] else -1.0

    if pos:
        out["recall_at_1"] = sum(r["true_rank"] == 1 for r in pos) / len(pos)
        out["recall_at_5"] = sum(
            r["true_rank"] is not None and r["true_rank"] <= 5 for r in pos
        ) / len(pos)
        for t in THRESHOLDS:
            out[f"recall_at_1_sim_ge_{t}"] = sum(
                r["true_rank"] == 1 and top_sim(r) >= t for r in pos
            ) / len(pos)
        out["wrong_top1"] = sum(bool(r["candidates"]) and r["true_rank"] != 1 for r in pos)
        out["no_candidate"] = sum(not r["candidates"] for r in pos)
        out["true_donor_similarity_mean"] = _mean(
            [r["candidates"][r["true_rank"] - 1]["similarity"] for r in pos if r["true_rank"]]
        )
        out["oracle_exact_prefix_tokens_mean"] = _mean(
            [r["oracle"]["exact_prefix_tokens"] for r in pos]
        )
        out["oracle_run_tokens_mean"] = _mean([r["oracle"]["run_tokens"] for r in pos])
    if neg:
        out["fpr_raw"] = sum(bool(r["candidates"]) for r in neg) / len(neg)
        for t in THRESHOLDS:
            out[f"fpr_sim_ge_{t}"] = sum(
                any(c["similarity"] >= t for c in r["candidates"]) for r in neg
            ) / len(neg)
        sims = [top_sim(r) for r in neg if r["candidates"]]
        out["max_negative_similarity"] = max(sims, default=None)  # None: no candidate at all
        out["decoy_returned"] = sum(
            r["decoy_donor_id"] is not None
            and any(c["donor_id"] == r["decoy_donor_id"] for c in r["candidates"])
            for r in neg
        )
    # Reusable tokens the top candidate offers (0 where there is no candidate).
    out["target_tokens_mean"] = _mean([r["target_tokens"] for r in rows])
    out["top_exact_prefix_tokens_mean"] = _mean(
        [r["top"]["exact_prefix_tokens"] if r["top"] else 0 for r in rows]
    )
    out["top_run_tokens_mean"] = _mean([r["top"]["run_tokens"] if r["top"] else 0 for r in rows])
    # The top candidate's own span (providers that report spans), where it is token-identical.
    out["top_candidate_span_identical_tokens_mean"] = _mean([
        r["top"]["judged_tokens"]
        if r["top"] and r["top"]["judged_source"] == "candidate"
        and r["top"]["judged_token_differences"] == 0 else 0
        for r in rows
    ])
    out["lookup_ms_p50"] = statistics.median([r["lookup_ms"] for r in rows]) if rows else None
    return out


def fmt(x: Any, pct: bool = False, tok: bool = False) -> str:
    if x is None:
        return "–"
    if pct:
        return f"{100 * x:.0f}%"
    if tok:
        return f"{x:.0f}"
    if isinstance(x, float):
        return f"{x:.0f}" if abs(x) >= 10 else f"{x:.2f}"
    return str(x)


def tables(results: dict[str, Any]) -> str:
    lines = []
    summ = results["summary"]
    kinds = results["workload"]["kinds"]
    pos_kinds = [k for k in kinds if not k.startswith("negative_")]
    neg_kinds = [k for k in kinds if k.startswith("negative_")]
    lines.append("### Overview (all positive kinds / both negative kinds)\n")
    lines.append(
        "| provider | R@1 | R@5 | R@1 sim≥0.5 | R@1 sim≥0.8 | R@1 sim≥0.9 | FPR raw | FPR ≥0.5 | "
        "FPR ≥0.8 | FPR ≥0.9 | top-1 exact-prefix tok | top-1 longest run tok | lookup p50 ms |"
    )
    lines.append("|" + "---|" * 13)
    for name, s in summ.items():
        p, n, a = s["positives"], s["negatives"], s["all"]
        lines.append(
            f"| {label(name)} | {fmt(p.get('recall_at_1'), True)} "
            f"| {fmt(p.get('recall_at_5'), True)} "
            + "".join(f"| {fmt(p.get(f'recall_at_1_sim_ge_{t}'), True)} " for t in THRESHOLDS)
            + f"| {fmt(n.get('fpr_raw'), True)} "
            + "".join(f"| {fmt(n.get(f'fpr_sim_ge_{t}'), True)} " for t in THRESHOLDS)
            + f"| {fmt(p.get('top_exact_prefix_tokens_mean'), tok=True)} "
            f"| {fmt(p.get('top_run_tokens_mean'), tok=True)} "
            f"| {fmt(a.get('lookup_ms_p50'))} |"
        )
    lines.append("\n### Positives per cluster kind\n")
    lines.append(
        "R@k: true donor at rank 1 / within the top 5. Tokens: means over the kind's targets "
        "(0 where no candidate); own span = the span the provider itself reported, where "
        "token-identical (chunks, semblend report spans; any alignment); oracle = verifier on "
        "the true donor.\n"
    )
    lines.append(
        "| kind | provider | n | R@1 | R@5 | true-donor sim | wrong top-1 | no cand. | "
        "top-1 exact-prefix tok | top-1 longest run tok | top-1 own span tok | "
        "oracle prefix / run tok | target tok |"
    )
    lines.append("|" + "---|" * 13)
    for kind in pos_kinds:
        for name, s in summ.items():
            k = s["by_kind"][kind]
            lines.append(
                f"| {kind} | {label(name)} | {k['n']} | {fmt(k['recall_at_1'], True)} | "
                f"{fmt(k['recall_at_5'], True)} | {fmt(k['true_donor_similarity_mean'])} | "
                f"{k['wrong_top1']} | {k['no_candidate']} | "
                f"{fmt(k['top_exact_prefix_tokens_mean'], tok=True)} | "
                f"{fmt(k['top_run_tokens_mean'], tok=True)} | "
                f"{fmt(k['top_candidate_span_identical_tokens_mean'], tok=True)} | "
                f"{fmt(k['oracle_exact_prefix_tokens_mean'], tok=True)} / "
                f"{fmt(k['oracle_run_tokens_mean'], tok=True)} | "
                f"{fmt(k['target_tokens_mean'], tok=True)} |"
            )
    lines.append("\n### Negative controls per kind\n")
    lines.append(
        "FPR: share of negative targets with any candidate (raw) / any candidate with "
        "similarity ≥ t. Decoy: the same-topic decoy donor was returned.\n"
    )
    lines.append(
        "| kind | provider | n | FPR raw | FPR ≥0.5 | FPR ≥0.8 | FPR ≥0.9 | max top sim | "
        "decoy returned | top-1 exact-prefix tok | top-1 longest run tok |"
    )
    lines.append("|" + "---|" * 11)
    for kind in neg_kinds:
        for name, s in summ.items():
            k = s["by_kind"][kind]
            lines.append(
                f"| {kind} | {label(name)} | {k['n']} | {fmt(k['fpr_raw'], True)} "
                + "".join(f"| {fmt(k[f'fpr_sim_ge_{t}'], True)} " for t in THRESHOLDS)
                + f"| {fmt(k['max_negative_similarity'])} | {k['decoy_returned']} | "
                f"{fmt(k['top_exact_prefix_tokens_mean'], tok=True)} | "
                f"{fmt(k['top_run_tokens_mean'], tok=True)} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--providers", nargs="+", default=list(DEFAULT_PROVIDERS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clusters-per-type", type=int, default=8)
    parser.add_argument(
        "--target-tokens", type=int, default=2048,
        help="approximate prompt size (build_workload's target_tokens); 0: whole documents",
    )
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-candidates", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench-results/discovery_quality.json"))
    args = parser.parse_args()
    command = shlex.join([sys.executable, *sys.argv])
    print(f"command: {command}", flush=True)
    if args.target_tokens == 0:
        args.target_tokens = None

    t0 = time.perf_counter()
    tokenizer, wl = build(args)
    print(f"workload: {json.dumps(wl.summary())} ({time.perf_counter() - t0:.1f} s)", flush=True)
    results: dict[str, Any] = {
        "command": command,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(),
                 "loadavg_start": loadavg()},
        "params": {"seed": args.seed, "clusters_per_type": args.clusters_per_type,
                   "target_tokens": args.target_tokens, "block_size": args.block_size,
                   "max_candidates": args.max_candidates, "namespace": NAMESPACE,
                   "thresholds": list(THRESHOLDS), "provider_config": "defaults"},
        "workload": {**wl.summary(), "kinds": [k.value for k in wl.kinds]},
        "providers": {},
        "summary": {},
    }
    for name in args.providers:
        t0 = time.perf_counter()
        res = run_provider(name, tokenizer, wl, args)
        res["loadavg_after"] = loadavg()
        results["providers"][name] = res
        rows = res["targets"]
        results["summary"][name] = {
            "all": summarize(rows),
            "positives": summarize([r for r in rows if r["true_donor_id"] is not None]),
            "negatives": summarize([r for r in rows if r["true_donor_id"] is None]),
            "by_kind": {k: summarize([r for r in rows if r["kind"] == k])
                        for k in results["workload"]["kinds"]},
        }
        print(f"{label(name)}: done in {time.perf_counter() - t0:.1f} s "
              f"(register+flush {res['register_and_flush_s']:.1f} s; load {loadavg()})", flush=True)
    results["host"]["loadavg_end"] = loadavg()
    md = tables(results)
    print()
    print(md)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"\nraw JSON: {args.out}")


if __name__ == "__main__":
    main()
