"""Tables, targets and the plot of a frontier run (``semkv.bench.frontier`` rows).

Per cluster kind and arm, and again per plan class (``summarize_by_class``: the engine's own
label of each realized plan's shape, ``semkv.plan_class``): targets served, tokens from donors,
recomputed tokens (share of the prompt), TTFT speedup vs cold, ROUGE-L and exact match vs cold,
greedy divergences (and how many fell at a near-tie of the cold answer), mean per-token KL from
cold and the cold answer's log-likelihood change, all beside the fp8 floor and the response
cache. The cost gate (``cost_gate``): per strategy and plan class, the TTFT gain it predicted for
each served plan against the one measured (``semkv.bench.gain``: median and p90 error).

The targets (issue #17), checked per arm for the kinds that must meet them:
``kl_mean <= fp8 floor's``; every divergence at a near-tie (cold margin < ``NEAR_TIE``);
median ROUGE-L >= 0.9; median ROUGE-L >= response cache + 0.2; >= 50 % of the prompt from
donors; TTFT >= 2.5x cold (judged only where prompts have 2K+ tokens); no false positive on
the negatives; no realized block in the prefix cache afterwards.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from semkv.bench.config import COLD, FLOOR, STRATEGIES
from semkv.bench.frontier import NEAR_TIE
from semkv.bench.gain import gain_errors
from semkv.bench.report import model_label

GATED_KINDS = ("cross_instruction", "cross_instruction_task_first", "multi_passage_rag")
ROUGE_MIN, RC_MARGIN, DONOR_MIN, SPEEDUP_MIN, LONG_PROMPT = 0.9, 0.2, 0.5, 2.5, 2048


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """kind -> arm -> summary (reuse kinds: every arm; served rows only for the strategies)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for kind in sorted({r["kind"] for r in rows if not r["negative"]}):
        out[kind] = _by_arm([r for r in rows if r["kind"] == kind])
    return out


def summarize_by_class(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """plan class -> arm -> summary, whatever the workload's labels (``semkv.plan_class``).

    A class holds the targets whose realized request was planned in it: their strategy rows
    of that class, and their cold and fp8-floor rows (which have no plan), so that each class
    is read against the floor of its own targets. Negatives that were served count too.
    """
    classes: dict[str, set[str]] = {}
    for r in rows:
        if r.get("plan_class") and r["served"]:
            classes.setdefault(r["plan_class"], set()).add(r["target"])
    return {c: _by_arm([r for r in rows if r["target"] in targets
                        and (r["arm"] not in STRATEGIES or r.get("plan_class") == c)])
            for c, targets in sorted(classes.items())}


def cost_gate(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """strategy arm -> plan class (and ``all``) -> predicted vs measured gain of served plans."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for arm in [a for a in STRATEGIES if any(r["arm"] == a for r in rows)]:
        rs = [r for r in rows if r["arm"] == arm and r["served"] and r.get("plan_class")]
        groups = {"all": rs, **{c: [r for r in rs if r["plan_class"] == c]
                                for c in sorted({r["plan_class"] for r in rs})}}
        out[arm] = {c: gain_errors((r.get("predicted_gain"), r["speedup"]) for r in g)
                    for c, g in groups.items()}
    return out


def _by_arm(group: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for arm in sorted({r["arm"] for r in group}, key=_arm_order):
        rs = [r for r in group if r["arm"] == arm]
        served = [r for r in rs if r["served"] or arm == COLD]
        divs = [r for r in served if r["first_divergence"] is not None]
        near = [r for r in divs if (r["cold_margin_at_divergence"] or 0.0) < NEAR_TIE]
        out[arm] = {
            "targets": len(rs), "served": len(served),
            "prompt_tokens_median": _median([r["prompt_tokens"] for r in rs]),
            "donor_fraction_median": _median([r["donor_fraction"] for r in served]),
            "recomputed_fraction_mean": _mean([r["recomputed"] / r["prompt_tokens"]
                                               for r in served]),
            "computed_fraction_mean": _mean([
                (r["recomputed"] + r["computed_in_span"]) / r["prompt_tokens"]
                for r in served]),
            "speedup_median": _median([r["speedup"] for r in served]),
            "rouge_l_median": _median([r["rouge_l"] for r in served]),
            "rouge_l_mean": _mean([r["rouge_l"] for r in served]),
            "exact_match_rate": (sum(r["exact_match"] for r in served) / len(served)
                                 if served else None),
            "divergences": len(divs), "divergences_near_tie": len(near),
            "divergence_margins": sorted(round(r["cold_margin_at_divergence"], 3)
                                         for r in divs
                                         if r["cold_margin_at_divergence"] is not None),
            "kl_mean": _mean([r["kl_mean"] for r in served]),
            "kl_median": _median([r["kl_mean"] for r in served]),
            "logprob_delta_mean": _mean([r["logprob_delta"] for r in served]),
            "response_cache_rouge_l_median": _median(
                [r["response_cache_rouge_l"] for r in served]),
        }
    return out


def _arm_order(arm: str) -> tuple[int, str]:
    order = [COLD, FLOOR, *STRATEGIES]
    return (order.index(arm) if arm in order else len(order), arm)


def negatives(rows: list[dict[str, Any]]) -> dict[str, Any]:
    rs = [r for r in rows if r["negative"]]
    fp = [r for r in rs if r["served"]]
    return {"targets": len(rs), "false_positives": len(fp),
            "false_positive_rate": len(fp) / len(rs) if rs else None}


def check(summary: dict[str, dict[str, dict[str, Any]]], rows: list[dict[str, Any]],
          request_only_violations: int) -> dict[str, Any]:
    """Per strategy arm: met or the reasons it is not (over the gated kinds)."""
    neg = negatives(rows)
    out: dict[str, Any] = {}
    for arm in STRATEGIES:
        reasons: list[str] = []
        seen = False
        for kind in GATED_KINDS:
            s = summary.get(kind, {}).get(arm)
            floor = summary.get(kind, {}).get(FLOOR)
            if s is None:
                continue
            seen = True
            if not s["served"]:
                reasons.append(f"{kind}: nothing served")
                continue
            if floor and floor["kl_mean"] is not None and (s["kl_mean"] or 0) > floor["kl_mean"]:
                reasons.append(f"{kind}: mean KL {s['kl_mean']:.4f} > fp8 floor "
                               f"{floor['kl_mean']:.4f}")
            if s["divergences"] > s["divergences_near_tie"]:
                reasons.append(f"{kind}: {s['divergences'] - s['divergences_near_tie']} "
                               f"divergence(s) at a cold margin >= {NEAR_TIE}")
            if (s["rouge_l_median"] or 0) < ROUGE_MIN:
                reasons.append(f"{kind}: median ROUGE-L {s['rouge_l_median']:.2f} < {ROUGE_MIN}")
            rc = s["response_cache_rouge_l_median"]
            if rc is not None and (s["rouge_l_median"] or 0) < rc + RC_MARGIN:
                reasons.append(f"{kind}: median ROUGE-L {s['rouge_l_median']:.2f} < response "
                               f"cache {rc:.2f} + {RC_MARGIN}")
            if (s["donor_fraction_median"] or 0) < DONOR_MIN:
                reasons.append(f"{kind}: {s['donor_fraction_median']:.0%} from donors")
            if (s["prompt_tokens_median"] or 0) >= LONG_PROMPT and (
                    s["speedup_median"] or 0) < SPEEDUP_MIN:
                reasons.append(f"{kind}: TTFT {s['speedup_median']:.2f}x < {SPEEDUP_MIN}x")
        if neg["false_positives"]:
            reasons.append(f"{neg['false_positives']} false positive(s) on negatives")
        if request_only_violations:
            reasons.append(f"{request_only_violations} realized block(s) became prefix cache")
        if seen:
            out[arm] = {"met": not reasons, "reasons_off": reasons}
    return out


def _f(v: Any, fmt: str = ".2f") -> str:
    return "–" if v is None else f"{v:{fmt}}"


def markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"Preset `{cfg['preset']}` on {model_label(cfg)}: ~{cfg['target_tokens']} "
             f"prompt tokens, {cfg['max_tokens']} greedy tokens, "
             f"{cfg['clusters_per_type']} clusters per kind, cores `{cfg['cores']}`; "
             f"{result['machine']}; wall {result['wall_s'] / 60:.1f} min.", ""]
    lines += _summary_table("kind", result["summary"])
    by_class = summarize_by_class(result["rows"])
    if by_class:
        lines += ["", "Per plan class (`semkv.plan_class`, the engine's label of each realized "
                      "plan's shape; cold and fp8-floor rows of the class's targets):", "",
                  *_summary_table("plan class", by_class)]
    gate = cost_gate(result["rows"])
    if any(g["all"]["priced"] for g in gate.values()):
        lines += ["", "Cost gate: TTFT gain predicted for each served plan (rates the engine "
                      "measured) against the one measured (cold TTFT / TTFT); error = "
                      "predicted / measured - 1:", "", *_gate_table(gate)]
    neg = result["negatives"]
    lines += ["", f"Negative controls: {neg['false_positives']} false positive(s) on "
                  f"{neg['targets']} targets; realized blocks found in the prefix cache "
                  f"afterwards: {result['request_only_violations']}.", "", "Targets:", ""]
    for arm, c in result["targets"].items():
        lines.append(f"- `{arm}`: " + ("met" if c["met"] else
                                       "not met: " + "; ".join(c["reasons_off"])))
    return "\n".join(lines) + "\n"


def _gate_table(gate: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    header = ["arm", "plan class", "priced", "predicted med", "measured med", "error med",
              "|error| med", "|error| p90", "slower than cold"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arm, classes in gate.items():
        for cls, g in classes.items():
            if not g["priced"]:
                continue
            lines.append("| " + " | ".join([
                arm, cls, str(g["priced"]), _f(g["predicted_median"]) + "x",
                _f(g["measured_median"]) + "x", _f(g["error_median"], "+.0%"),
                _f(g["abs_error_median"], ".0%"), _f(g["abs_error_p90"], ".0%"),
                str(g["slower"])]) + " |")
    return lines


def _summary_table(first: str, groups: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    header = [first, "arm", "served", "prompt", "from donors", "recomputed", "TTFT vs cold",
              "ROUGE-L med", "exact", "divergences (near-tie)", "KL mean", "KL med",
              "Δ log-lik", "resp. cache"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for group, arms in groups.items():
        for arm, s in arms.items():
            lines.append("| " + " | ".join([
                group, arm, f"{s['served']}/{s['targets']}",
                _f(s["prompt_tokens_median"], ".0f"), _f(s["donor_fraction_median"], ".0%"),
                _f(s["recomputed_fraction_mean"], ".0%"), _f(s["speedup_median"], ".2f") + "x",
                _f(s["rouge_l_median"]), _f(s["exact_match_rate"], ".0%"),
                f"{s['divergences']} ({s['divergences_near_tie']})", _f(s["kl_mean"], ".4f"),
                _f(s["kl_median"], ".4f"), _f(s["logprob_delta_mean"], ".3f"),
                _f(s["response_cache_rouge_l_median"])]) + " |")
    return lines


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """KL from cold and median ROUGE-L against the share of the prompt semkv computed in the
    span, per kind (colour) and strategy (marker); dashed: the kind's fp8 floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    shapes_ = "osv^Dx<>pP*hH"
    markers = {a: shapes_[i % len(shapes_)] for i, a in enumerate(STRATEGIES)}
    fig, (ax_kl, ax_rouge) = plt.subplots(1, 2, figsize=(11, 4.4))
    for i, arms in enumerate(result["summary"].values()):
        color = f"C{i}"
        pts = sorted((s["computed_fraction_mean"] or 0.0, s["kl_mean"], s["rouge_l_median"], a)
                     for a, s in arms.items() if a in STRATEGIES and s["served"])
        for ax, k in ((ax_kl, 1), (ax_rouge, 2)):
            ax.plot([p[0] for p in pts], [p[k] for p in pts], "-", color=color, lw=0.8)
            for p in pts:
                ax.plot(p[0], p[k], markers[p[3]], color=color, ms=6, mfc="none")
        floor = arms.get(FLOOR)
        if floor and floor["kl_mean"]:
            ax_kl.axhline(floor["kl_mean"], color=color, ls="--", lw=0.8)
            ax_rouge.axhline(floor["rouge_l_median"], color=color, ls="--", lw=0.8)
    ax_kl.set_yscale("log")
    for ax in (ax_kl, ax_rouge):
        ax.set_xlabel("share of the prompt computed by semkv in the span (gaps + recomputed)")
    ax_kl.set_ylabel("mean per-token KL from cold (nats)")
    ax_rouge.set_ylabel("median ROUGE-L vs cold")
    model = model_label(result.get("config") or {})
    ax_kl.set_title(f"{model}; dashed: fp8 KV floor (same colour)", fontsize=9)
    kinds = [Line2D([], [], color=f"C{i}", label=k) for i, k in enumerate(result["summary"])]
    shapes = [Line2D([], [], color="k", marker=m, ls="", mfc="none", label=a.split(":")[1])
              for a, m in markers.items() if any(a in arms for arms in result["summary"].values())]
    ax_rouge.legend(handles=kinds + shapes, fontsize=7, loc="center right")
    fig.tight_layout()
    path = out_dir / "frontier.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
