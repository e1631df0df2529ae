"""Markdown tables and PNG plots of a ``semkv bench`` result (the JSON written next to them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _f(value: Any, fmt: str = ".3f", suffix: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:{fmt}}{suffix}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]


def _speed_rows(arms: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, s in arms.items():
        miss = s.get("miss", {})
        rows.append([
            name, _f(s["ttft_s"]["p50"]), _f(s["ttft_s"]["p95"]), _f(s["ttft_s"]["p99"]),
            _f(s["e2e_s"]["p50"]), _f(s["throughput_tok_s"], ".1f"),
            _f(s["speedup_overall"], ".2f", "x"), _f(s["speedup_hit_only"], ".2f", "x"),
            _f(s["speedup_vs_own_miss"], ".2f", "x"),
            _f(s["speedup_vs_own_miss_hit_only"], ".2f", "x"),
            _f(miss.get("over_cold_median")), _f(miss.get("semkv_share_median"), ".4f"),
            _f(s["lookup_ms"]["p50"], ".2f"), _f(s["semkv_ms_per_request"], ".2f"),
            _f(s["donor_store_bytes"] / 2**20, ".1f")])
    return rows


def model_label(cfg: dict[str, Any]) -> str:
    """The served model as a run's config names it (None: the bundled default) and its dtype."""
    from semkv.bundled_model import BUNDLED_DTYPE, DEFAULT, MODELS

    model = cfg.get("model") or DEFAULT
    dtype = cfg.get("dtype") or (BUNDLED_DTYPE if model in MODELS else "auto")
    return f"{model} ({dtype})"


def markdown(result: dict[str, Any]) -> str:
    arms, cfg = result["arms"], result["config"]
    lines = [
        f"Preset `{cfg['preset']}` on {model_label(cfg)}: {result['workload']['targets']} "
        f"targets, {result['workload']['donors']} donors, ~{cfg['target_tokens']} prompt tokens, "
        f"{cfg['max_tokens']} greedy output tokens, concurrency {cfg['concurrency']}, "
        f"cores `{cfg['cores']}`; {result['machine']}.",
        "",
        "### Speed (reuse phase, one request at a time; speedups paired per prompt vs disabled)",
        "",
        *_table(["arm", "TTFT p50", "p95", "p99", "e2e p50", "tok/s", "speedup", "hit-only",
                 "vs own miss", "hit-only", "miss/cold", "semkv share of miss",
                 "lookup p50 ms", "semkv ms/req", "store MiB"], _speed_rows(arms)),
    ]
    base = arms["disabled"].get("vllm_prefix_hit")
    if base:
        lines += ["", f"Anchor, vLLM's own prefix cache (same prompt again on the disabled "
                      f"engine): TTFT p50 {_f(base['ttft_s']['p50'])} s, speedup "
                      f"{_f(base['speedup'], '.2f', 'x')}, output = cold on "
                      f"{_pct(base['same_as_cold_rate'])}."]
    conc = [(n, s["concurrent"]) for n, s in arms.items() if "concurrent" in s]
    if conc:
        lines += ["", f"### Throughput at concurrency {cfg['concurrency']}", "", *_table(
            ["arm", "requests", "wall s", "tok/s", "req/s", "TTFT p50", "p95", "p99"],
            [[n, str(c["requests"]), _f(c["wall_s"], ".1f"), _f(c["throughput_tok_s"], ".1f"),
              _f(c["requests_per_s"], ".2f"), _f(c["ttft_s"]["p50"]), _f(c["ttft_s"]["p95"]),
              _f(c["ttft_s"]["p99"])] for n, c in conc])]
    lines += ["", "### Reuse (engine-confirmed) and fallbacks", "", *_table(
        ["arm", "hits", "hit rate (positives)", "reported ext. tokens", "loaded tokens",
         "would reuse", "tiers", "fallback reasons", "FP rate (negatives, non-exact)"],
        [[name, f"{s['hits']}/{s['targets']}", _pct(s["hit_rate_positives"]),
          str(s["external_tokens"]), str(s["loaded_tokens"]), str(s["would_reuse_tokens"]),
          ", ".join(f"{k}: {v}" for k, v in s["tiers"].items()) or "–",
          ", ".join(f"{k}: {v}" for k, v in sorted(s["fallback_reasons"].items())),
          _pct(s["false_positive_rate"])] for name, s in arms.items()])]
    lines += ["", "### Quality against the cold run of the same prompt, per cluster type", "",
              *_table(["arm", "cluster type", "targets", "hits", "exact match", "ROUGE-L med",
                       "token F1 med", "first div. med", "logprob Δ med",
                       "response cache ROUGE-L"],
                      [[name, kind, str(q["targets"]), str(q["hits"]),
                        _pct(q["exact_match_rate"]), _f(q["rouge_l_median"], ".2f"),
                        _f(q["token_f1_median"], ".2f"), _f(q["first_divergence_median"], ".0f"),
                        _f(q["logprob_delta_median"], ".4f"),
                        _f(q["response_cache_rouge_l_median"], ".2f")]
                       for name, s in arms.items() for kind, q in s["quality_by_kind"].items()])]
    lines += ["", "### Where the prompt's KV came from, per cluster type (realized spans)", "",
              "Tokens summed over the cluster type's targets (share of their prompt tokens): "
              "served from donors (of which shifted to new positions), computed by the worker "
              "inside the external span, computed by vLLM after it (the rest: vLLM's own local "
              "prefix hit, in bench.json); plan classes: realized requests per class of their "
              "plan's shape (`semkv.plan_class`). TTFT ratios are medians paired per prompt "
              "(> 1: faster than the reference). Response cache: the best cold answer of the "
              "target's labelled donors.", "",
              *_table(["arm", "cluster type", "targets", "hits", "realized", "plan classes",
                       "from donors", "shifted", "computed in span", "computed by vLLM",
                       "TTFT vs own miss", "vs exact arm", "predicted gain med",
                       "gain error med (abs p90)", "realize ms med", "exact match",
                       "ROUGE-L med", "resp. cache EM", "resp. cache ROUGE-L", "FP rate"],
                      _span_rows(arms))]
    lines += ["", "### Targets", ""] + _targets_md(result["targets"])
    return "\n".join(lines) + "\n"


def _share(tokens: int, total: int) -> str:
    return f"{tokens} ({100 * tokens / total:.0f}%)" if total else str(tokens)


def _span_rows(arms: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, s in arms.items():
        if name == "disabled":  # every token computed by vLLM: nothing to split
            continue
        for kind, k in s.get("span_by_kind", {}).items():
            total = k["prompt_tokens"]
            gate = k.get("cost_gate") or {}
            rows.append([
                name, kind, str(k["targets"]), str(k["hits"]), str(k["realized"]),
                ", ".join(f"{c} {n}" for c, n in k.get("plan_classes", {}).items()) or "–",
                _share(k["donor_tokens"], total), _share(k["span_shifted_tokens"], total),
                _share(k["span_computed_tokens"], total), _share(k["vllm_computed_tokens"], total),
                _f(k["speedup_vs_own_miss_median"], ".2f", "x"),
                _f(k["speedup_vs_exact_arm_median"], ".2f", "x"),
                _f(gate.get("predicted_median"), ".2f", "x"),
                (f"{_f(gate.get('error_median'), '+.0%')} ({_f(gate.get('abs_error_p90'), '.0%')})"
                 if gate.get("priced") else "–"),
                _f(k["realize_ms_median"], ".0f"),
                _pct(k["exact_match_rate"]), _f(k["rouge_l_median"], ".2f"),
                _pct(k["response_cache_exact_match_rate"]),
                _f(k["response_cache_rouge_l_median"], ".2f"), _pct(k["false_positive_rate"])])
    return rows


def _targets_md(t: dict[str, Any]) -> list[str]:
    ex = t["exact_tier"]
    out = [f"- Exact tier identical to vLLM's own prefix hit: {ex['identical_to_vllm_hit']}/"
           f"{ex['exact_hits']} exact hits; agreement with cold {_pct(ex['agreement_with_cold'])}"
           f" vs vLLM's own {_pct(ex['vllm_hit_agreement_with_cold'])}: "
           f"**{'met' if ex['met'] else 'NOT met'}**."]
    for name, m in t["miss_cost"].items():
        out.append(f"- Miss cost, {name}: paired TTFT ratio {_f(m['paired_ttft_ratio'])} "
                   f"({'under' if m['met_ratio'] else 'NOT under'} 1.02), semkv's own share "
                   f"{_f(m['semkv_share'], '.4f')} "
                   f"({'under' if m['met_semkv_share'] else 'NOT under'} 2%).")
    for name, s in t["semantic_tier"].items():
        verdict = "may ship ON" if s["default_on"] else "ships OFF: " + "; ".join(s["reasons_off"])
        out.append(f"- Semantic tier, {name}: {s['served_non_exact']} non-exact hits, ROUGE-L "
                   f"median {_f(s['rouge_l_median'], '.2f')} vs response cache "
                   f"{_f(s['response_cache_rouge_l_median'], '.2f')}, FP rate "
                   f"{_pct(s['false_positive_rate'])}: {verdict}.")
    w = t["wrong_donor"]
    if w["targets"]:
        out.append(f"- Wrong-donor control: {w['forced_through']}/{w['targets']} negatives "
                   f"forced through; exact match {_pct(w['exact_match_rate'])}, ROUGE-L median "
                   f"{_f(w['rouge_l_median'], '.2f')}, logprob Δ median "
                   f"{_f(w['logprob_delta_median'], '.3f')} (same span as the target run: "
                   f"{_f(w['logprob_delta_median_same_span'], '.3f')}): damage "
                   f"{'detected' if w['damage_detected'] else 'NOT detected'}.")
    return out


def plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """TTFT by prompt length and arm; quality vs reuse per cluster type."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    arms = list(result["arms"])
    paths = []
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in arms:
        rs = [r for r in rows if r["arm"] == name]
        ax.scatter([r["prompt_tokens"] for r in rs], [r["ttft_s"] for r in rs], label=name, s=18)
    base = [r for r in rows if r["arm"] == "disabled"]
    ax.scatter([r["prompt_tokens"] for r in base], [r["vllm_hit_ttft_s"] for r in base],
               label="vLLM prefix hit (anchor)", marker="x", s=30, color="black")
    ax.set(xlabel="prompt tokens", ylabel="TTFT (s)", yscale="log",
           title="TTFT by prompt length and arm")
    ax.legend(fontsize=7)
    paths.append(out_dir / "ttft_by_length.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    kinds = sorted({r["kind"] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 5))
    markers = "os^vDP*Xh"
    for i, kind in enumerate(kinds):
        rs = [r for r in rows if r["kind"] == kind and r["arm"] != "disabled"]
        # donor tokens: a realized span's computed gaps are loaded but not reused
        ax.scatter([r["donor_tokens"] / max(r["prompt_tokens"], 1) for r in rs],
                   [r["rouge_l"] for r in rs], label=kind, marker=markers[i % len(markers)], s=24)
    ax.set(xlabel="reused fraction of the prompt (engine-confirmed donor tokens)",
           ylabel="ROUGE-L vs cold output", ylim=(-0.05, 1.05),
           title="Quality vs reuse per cluster type (all non-baseline arms)")
    ax.legend(fontsize=7)
    paths.append(out_dir / "quality_vs_reuse.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
