"""Frontier plots: quality against recompute fraction, one PNG per cluster type.

Protocol: ``plot_frontiers(summary, out_dir)`` takes ``semkv.research.study.summarize`` output
and writes ``frontier-<cluster type>.png``: per donor choice, one line through its strategies
(x: token-layers recomputed over a full prefill's; y: ROUGE-L of the greedy continuation
against the full-prefill reference, solid, and greedy exact-match rate, dotted), plus the full
prefill itself at (1, 1). matplotlib is imported here only (``pip install 'semkv[research]'``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from semkv.research._deps import require

Summary = Mapping[str, Mapping[str, Mapping[str, Mapping[str, float]]]]
COLORS = {"true_donor": "tab:blue", "wrong_donor": "tab:red", "nearest_unrelated": "tab:orange"}


def plot_frontiers(summary: Summary, out_dir: str | Path) -> list[Path]:
    require("matplotlib")
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for kind, by_mode in sorted(summary.items()):
        fig, ax = plt.subplots(figsize=(6.0, 4.2))
        for mode, by_strategy in sorted(by_mode.items()):
            if mode == "reference":
                continue
            points = sorted(by_strategy.items(), key=lambda item: item[1]["recompute_fraction"])
            xs = [m["recompute_fraction"] for _, m in points]
            color = COLORS.get(mode, "tab:gray")
            ax.plot(xs, [m["rouge_l"] for _, m in points], "o-", color=color,
                    label=f"{mode} ROUGE-L")
            ax.plot(xs, [m["exact_match"] for _, m in points], "s:", color=color, alpha=0.6,
                    label=f"{mode} exact match")
            for name, m in points:
                ax.annotate(name, (m["recompute_fraction"], m["rouge_l"]), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
        ax.plot([1.0], [1.0], "k*", markersize=10, label="full prefill")
        ax.set_xlim(-0.02, 1.05)
        ax.set_ylim(-0.02, 1.05)
        ax.set_xlabel("recompute fraction (token-layers vs full prefill)")
        ax.set_ylabel("quality vs full prefill")
        ax.set_title(f"{kind}: reuse quality frontier")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        path = folder / f"frontier-{kind}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
