"""The window measurement: how far copied K/V is from cold, per layer, against the distance from
the seam before it, on a model with sliding-window layers (Gemma 3 270M by default).

No engine: ``semkv.research`` (transformers' modules, fp32, each layer's own window as its
mask). Per target of each ``--kinds`` (``semkv.eval`` clusters at ``--target-tokens``; the
store holds the target's labelled donors only), the plan is ``plan_reuse``'s, and the target's
KV is assembled with nothing recomputed (copies re-rotated, every other position computed:
``Strategy.none()``). For every copied position p and layer l it records the relative deviation
``|K_l(p) - K_cold_l(p)| / |K_cold_l(p)|`` (over heads and dimensions; V likewise) and the
distance of p from its seam: the start of the copied run that holds it (attention is causal:
what p attends to ends there). The fp8 floor of each layer is the same ratio for the cold K/V
rounded through fp8 (``semkv.realize.fp8.round_fp8``, the engine's ``kv_floor``); the final
logits' deviation is the full-vocabulary KL(cold || assembled) at the last prompt position,
beside the floor's (the cold KV of every prompt token but the last rounded through fp8).

The claim it tests (issue #50): in a window layer below the first full-attention layer, a
copied token further than the window from its seam attends only to copied tokens, so its error
there is zero; above the first full layer every layer carries the whole context.

    nice -n 5 .venv/bin/python benchmarks/window_deviation.py --clusters 3

Prints per class (one donor, several donors) and layer the median deviation near and far from
the seam against the floor; writes raw JSON (numbers only) to ``--out`` and a plot (median K
deviation against distance, one line per layer, the floor dashed) to ``--plot``.
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

from semkv.research.floor import fp8_floor_logits as floor_logits
from semkv.research.floor import logits_kl as kl

KINDS = ("cross_instruction", "reordered_chunks", "multi_passage_rag")
# distance bins (tokens from the seam), the last one open
EDGES = (0, 32, 64, 128, 256, 512, 768, 1024, 1536)


def relative(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per position: ``|got - want| / |want|`` over heads and dimensions ([1, H, T, D])."""
    diff = (got - want)[0].transpose(0, 1).flatten(1).norm(dim=1)
    return diff / want[0].transpose(0, 1).flatten(1).norm(dim=1).clamp_min(1e-12)


def bin_of(distance: int) -> int:
    return max(i for i, edge in enumerate(EDGES) if distance >= edge)


def seam_distances(plan: Any) -> dict[int, int]:
    """Copied position -> its distance from the start of its copied run."""
    return {seg.target_start + i: i for seg in plan.segments for i in range(seg.length)}


def measure_target(lm: Any, ids: list[int], plan: Any, store: Any) -> dict[str, Any]:
    from semkv.realize.fp8 import round_fp8
    from semkv.research import Strategy, prefill

    cold, cold_logits = lm.full_prefill(ids, all_logits=False)
    warm = prefill(lm, ids, plan, store, Strategy.none())
    distance = seam_distances(plan)
    at = torch.tensor(sorted(distance))
    bins = torch.tensor([bin_of(distance[int(p)]) for p in at])
    layers = []
    for layer in range(lm.num_layers):
        row: dict[str, Any] = {}
        for name, got, want in (("k", warm.cache.keys[layer], cold.keys[layer]),
                                ("v", warm.cache.values[layer], cold.values[layer])):
            n = want.shape[2]
            dev = relative(got[:, :, :n], want)[at]
            floor = relative(round_fp8(want), want)[at]
            row[name] = [float(dev[bins == b].median()) if bool((bins == b).any()) else None
                         for b in range(len(EDGES))]
            row[name + "_floor"] = float(floor.median())
        row["count"] = [int((bins == b).sum()) for b in range(len(EDGES))]
        layers.append(row)
    return {"prompt_tokens": len(ids), "copied": plan.reused_tokens,
            "segments": len(plan.segments), "donors": len(plan.donors_used()),
            "plan_class": plan.plan_class.value, "layers": layers,
            "kl": kl(cold_logits[-1], warm.logits), "floor_kl": kl(cold_logits[-1],
                                                                   floor_logits(lm, ids))}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from semkv.bundled_model import ensure_model
    from semkv.eval import build_workload
    from semkv.research import LayerwiseModel
    from semkv.research.targets import planned_targets

    torch.set_num_threads(args.threads)
    folder = ensure_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(folder))
    lm = LayerwiseModel.from_pretrained(folder)
    wl = build_workload(args.seed, clusters_per_type=args.clusters,
                        target_tokens=args.target_tokens, tokenizer=tok.encode, kinds=args.kinds)
    rows = []
    for p in planned_targets(lm, tok.encode, wl):
        if not p.plan.segments:
            continue
        row = measure_target(lm, p.ids, p.plan, p.store) | {"kind": p.target.kind.value}
        row["seconds"] = time.perf_counter() - p.started
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("kind", "plan_class", "prompt_tokens", "copied",
                                              "segments", "kl", "floor_kl")}
                         | {"s": round(row["seconds"], 1)}), flush=True)
    return {"model": args.model, "windows": lm.windows, "edges": list(EDGES),
            "kinds": list(args.kinds), "clusters": args.clusters,
            "target_tokens": args.target_tokens, "seed": args.seed, "rows": rows}


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """class ("one_donor" / "multi_donor") -> per layer: the median over targets of each bin's
    median deviation (K, V), the median floor; and the classes' median KL against the floor."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in raw["rows"]:
        groups["one_donor" if r["donors"] == 1 else "multi_donor"].append(r)
    med = statistics.median
    out: dict[str, Any] = {}
    for cls, rows in groups.items():
        layers = []
        for layer in range(len(raw["windows"])):
            entry: dict[str, Any] = {"window": raw["windows"][layer]}
            for part in ("k", "v"):
                values = [[r["layers"][layer][part][b] for r in rows
                           if r["layers"][layer][part][b] is not None]
                          for b in range(len(raw["edges"]))]
                entry[part] = [med(v) if v else None for v in values]
                entry[part + "_floor"] = med(r["layers"][layer][part + "_floor"] for r in rows)
            entry["count"] = [sum(r["layers"][layer]["count"][b] for r in rows)
                              for b in range(len(raw["edges"]))]
            layers.append(entry)
        out[cls] = {"targets": len(rows), "layers": layers,
                    "kl": med(r["kl"] for r in rows), "floor_kl": med(r["floor_kl"] for r in rows)}
    return out


def plot(summary: dict[str, Any], edges: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = list(summary)
    fig, axes = plt.subplots(1, len(classes), figsize=(6 * len(classes), 4.2), squeeze=False)
    cmap = plt.get_cmap("viridis")
    for ax, cls in zip(axes[0], classes, strict=True):
        layers = summary[cls]["layers"]
        for i, entry in enumerate(layers):
            pts = [(edges[b], v) for b, v in enumerate(entry["k"]) if v is not None]
            style = "-" if entry["window"] else "--"
            ax.plot([p[0] + 1 for p in pts], [max(p[1], 1e-9) for p in pts], style,
                    color=cmap(i / max(1, len(layers) - 1)), marker=".",
                    label=f"layer {i}" + ("" if entry["window"] else " (full)"))
        floor = statistics.median(e["k_floor"] for e in layers)
        ax.axhline(floor, color="grey", linestyle=":", label="fp8 floor (median)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tokens from the seam before (bin start + 1)")
        ax.set_title(f"{cls} (n={summary[cls]['targets']}): copied K, nothing recomputed",
                     fontsize=9)
    axes[0][0].set_ylabel("median |K - K_cold| / |K_cold|")
    axes[0][-1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gemma3-270m", help="a semkv.bundled_model name")
    p.add_argument("--kinds", nargs="+", default=list(KINDS))
    p.add_argument("--clusters", type=int, default=3)
    p.add_argument("--target-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench-results/window_deviation.json"))
    p.add_argument("--plot", type=Path, default=Path("docs/img/bench/window-deviation.png"))
    args = p.parse_args()
    raw = measure(args)
    raw["summary"] = summarize(raw)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(raw, indent=1))
    plot(raw["summary"], raw["edges"], args.plot)
    for cls, s in raw["summary"].items():
        print(f"\n{cls} (n={s['targets']}): last-position KL {s['kl']:.5f}, "
              f"fp8 floor {s['floor_kl']:.5f}")
        for i, e in enumerate(s["layers"]):
            near = e["k"][0]
            far = next((v for v in reversed(e["k"]) if v is not None), None)
            print(f"  layer {i:2d} {'window' if e['window'] else 'full  '} K near "
                  f"{near if near is None else f'{near:.2e}'} far "
                  f"{far if far is None else f'{far:.2e}'} floor {e['k_floor']:.2e}")


if __name__ == "__main__":
    main()
