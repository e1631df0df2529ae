"""Research curves: next-token KL against the share of the prompt recomputed, with the oracle.

No engine: ``semkv.research`` on the bundled model (fp32, eager attention, the engine's own
selection code through ``semkv.research.recompute.prefill``). Per target of each ``--kinds``
(``semkv.eval`` clusters at ``--target-tokens``; the store holds the target's labelled donors
only), the plan is ``plan_reuse``'s (the decision the engine's span plans make), and every
strategy's next-token distribution after the prompt is compared with the cold prefill's:
full-vocabulary KL(cold || strategy) in nats, at the last prompt position (one position per
target: noisier than the engine frontier's mean over 32 teacher-forced answer positions).

Arms: ``none``, ``first16``, ``blend<r>``, ``first16+blend<r>``, ``query<r>``,
``first16+query<r>`` (query-aware: ``semkv.realize.query``), ``progressive<r>`` (per-layer
selection, CacheBlend's gradual filtering; research only), ``shift<r>`` (query, then each
copied run's mean K/V deviation added to the tokens it left: ``semkv.research.shift``; research
only), ``queryv<r>`` (query's attention score weighted by each copied token's value error in
the probe layers: ``query_valued`` in ``semkv.realize.query``), ``oracle<r>`` (copied tokens
ranked by their true deviation from the cold KV over every layer: what the best selection of
single tokens reaches at that share), and the fp8 floor (the cold KV of every prompt token but
the last rounded through fp8 with ``semkv.realize.fp8.round_fp8``, the engine's ``kv_floor``
rounding, the last token computed over it).

    nice -n 5 .venv/bin/python benchmarks/recompute_curves.py --clusters 4 --target-tokens 1024

Prints per kind and arm the median KL and share recomputed (tokens computed through every layer
over the prompt's tokens), writes raw JSON (numbers only) to ``--out`` and a plot (KL against
share, one panel per kind, the floor dashed) to ``--plot``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from semkv.research.floor import fp8_floor_logits as fp8_floor
from semkv.research.floor import logits_kl as kl

KINDS = ("multi_passage_rag", "reordered_chunks", "quoted_section", "cross_instruction")
RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5)


def arms(names: list[str] | None = None) -> list[Any]:
    """Every arm (``names``: only those, by ``Strategy.name``)."""
    from semkv.research import Strategy
    from semkv.research.study import strategy_from_name

    if names:
        return [strategy_from_name(n) for n in names]
    out = [Strategy.none(), Strategy.first(16)]
    for r in RATIOS:
        out += [Strategy.blend(r), Strategy.first_k_blend(16, r), Strategy.query(r),
                Strategy.first_k_query(16, r), Strategy.oracle(r), Strategy.progressive(r),
                Strategy.shift(r), Strategy.queryv(r)]
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from semkv.bundled_model import ensure_model
    from semkv.eval import build_workload
    from semkv.research import LayerwiseModel, prefill
    from semkv.research.targets import planned_targets

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(str(ensure_model()))
    lm = LayerwiseModel.from_pretrained(ensure_model())
    wl = build_workload(args.seed, clusters_per_type=args.clusters,
                        target_tokens=args.target_tokens, tokenizer=tok.encode, kinds=args.kinds)
    rows = []
    for p in planned_targets(lm, tok.encode, wl):
        ids = p.ids
        _, cold = lm.full_prefill(ids, all_logits=False)
        n = len(ids)
        row: dict[str, Any] = {"kind": p.target.kind.value, "prompt_tokens": n,
                               "donors": len(p.donors), "copied": p.plan.reused_tokens,
                               "floor_kl": kl(cold[-1], fp8_floor(lm, ids)), "arms": {}}
        for strategy in arms(args.arms):
            result = prefill(lm, ids, p.plan, p.store, strategy)
            row["arms"][strategy.name] = {
                "kl": kl(cold[-1], result.logits),
                "share": result.recomputed_tokens / n,
                "token_layers": result.recompute_fraction}
        row["seconds"] = time.perf_counter() - p.started
        rows.append(row)
        print(json.dumps({"kind": row["kind"], "n": n, "copied": row["copied"],
                          "floor": round(row["floor_kl"], 5),
                          "s": round(row["seconds"], 1)}), flush=True)
    return {"kinds": list(args.kinds), "clusters": args.clusters,
            "target_tokens": args.target_tokens, "seed": args.seed, "rows": rows}


def summarize(raw: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """kind -> arm -> median KL, median share (and the floor's KL as arm ``fp8_floor``)."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in raw["rows"]:
        groups[r["kind"]].append(r)
    med = statistics.median
    out: dict[str, dict[str, dict[str, float]]] = {}
    for kind, rows in groups.items():
        out[kind] = {"fp8_floor": {"kl": med(r["floor_kl"] for r in rows), "share": 0.0,
                                   "token_layers": 0.0, "n": len(rows)}}
        for name in rows[0]["arms"]:
            out[kind][name] = {"kl": med(r["arms"][name]["kl"] for r in rows),
                               "share": med(r["arms"][name]["share"] for r in rows),
                               "token_layers": med(r["arms"][name]["token_layers"]
                                                   for r in rows),
                               "n": len(rows)}
    return out


def plot(summary: dict[str, dict[str, dict[str, float]]], path: Path,
         x_axis: str = "share") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(summary)
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 3.6), squeeze=False)
    families = {"blend": "blend", "first16+blend": "first16+blend", "query": "query",
                "first16+query": "first16+query", "oracle": "oracle",
                "progressive": "progressive", "shift": "shift", "queryv": "queryv"}
    for ax, kind in zip(axes[0], kinds, strict=True):
        arms_ = summary[kind]
        for label, prefix in families.items():
            pts = sorted((v[x_axis], v["kl"]) for k, v in arms_.items()
                         if k.rstrip("0123456789") == prefix)
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        for name, marker in (("none", "x"), ("first16", "s")):
            if name in arms_:
                ax.plot([arms_[name][x_axis]], [arms_[name]["kl"]], marker, label=name)
        ax.axhline(arms_["fp8_floor"]["kl"], linestyle="--", color="grey", label="fp8 floor")
        ax.set_yscale("log")
        ax.set_title(f"{kind} (n={int(arms_['fp8_floor']['n'])})", fontsize=9)
        ax.set_xlabel("share of the prompt recomputed" if x_axis == "share"
                      else "token-layers computed, share of a full prefill")
    axes[0][0].set_ylabel("median next-token KL vs cold (nats)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kinds", nargs="+", default=list(KINDS))
    p.add_argument("--clusters", type=int, default=4)
    p.add_argument("--target-tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench-results/recompute_curves.json"))
    p.add_argument("--plot", type=Path, default=Path("bench-results/recompute_curves.png"))
    p.add_argument("--arms", nargs="+", help="only these arms, by name (e.g. blend15 query30 "
                   "progressive10); default: every arm")
    p.add_argument("--x-axis", choices=("share", "token_layers"), default="share",
                   help="the plot's x: tokens through every layer, or token-layers computed")
    args = p.parse_args()
    raw = measure(args)
    raw["summary"] = summarize(raw)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(raw, indent=1))
    plot(raw["summary"], args.plot, args.x_axis)
    for kind, arms_ in raw["summary"].items():
        print(f"\n{kind}: fp8 floor KL {arms_['fp8_floor']['kl']:.5f}")
        for name, v in arms_.items():
            if name != "fp8_floor":
                print(f"  {name:>16}: KL {v['kl']:.5f}  share {v['share']:.1%}  "
                      f"token-layers {v['token_layers']:.1%}")


if __name__ == "__main__":
    main()
