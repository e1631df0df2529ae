"""Research use without an engine: how much KV could be reused, and at what quality cost?

Runs ``semkv.research.study`` on the bundled SmolLM2-135M-Instruct model (transformers, fp32,
CPU) over a small labelled workload: per cluster type and recompute strategy, the fraction of
prompt tokens reused, the estimated prefill FLOPs saved and the quality against a full prefill,
with donors picked by ground truth and, per ``--providers``, discovered by a semkv provider.
Writes ``research-study.json`` and ``frontier-<cluster type>.png`` (counts and scores only) and
prints the summary table. A few minutes on a laptop CPU with the defaults:

    .venv/bin/python examples/research_study.py                      # bench-results/research
    .venv/bin/python examples/research_study.py --clusters-per-type 1 --target-tokens 256
    .venv/bin/python examples/research_study.py --providers minhash embedding --strategies none

Needs ``pip install 'semkv[research]'`` (torch, transformers, matplotlib).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clusters-per-type", type=int, default=2)
    parser.add_argument("--target-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--kinds", nargs="*", default=None, help="cluster kinds (default: all)")
    parser.add_argument("--no-controls", action="store_true", help="skip wrong-donor controls")
    parser.add_argument("--stop-at-eos", action="store_true",
                        help="end continuations at end-of-sequence (default: never generate it)")
    parser.add_argument("--providers", nargs="*", default=["chunks", "minhash"],
                        help="semkv providers that discover each target's donor (none: only "
                             "the ground-truth donor choices)")
    parser.add_argument("--strategies", nargs="+", default=None,
                        help="recompute strategies, e.g. none first16 blend15 blend50 "
                             "(default: those four)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/research"))
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (1 is faster when other jobs busy the cores)")
    args = parser.parse_args()

    import torch
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from semkv.bundled_model import ensure_model
    from semkv.research import LayerwiseModel
    from semkv.research.study import (
        DEFAULT_STRATEGIES,
        StudyConfig,
        run_study,
        strategy_from_name,
        write_results,
    )

    if args.threads:
        torch.set_num_threads(args.threads)
    path = ensure_model()
    lm = LayerwiseModel.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    config = StudyConfig(
        seed=args.seed, clusters_per_type=args.clusters_per_type,
        target_tokens=args.target_tokens, max_new_tokens=args.new_tokens,
        kinds=tuple(args.kinds) if args.kinds else None, controls=not args.no_controls,
        stop_at_eos=args.stop_at_eos,
        strategies=(tuple(strategy_from_name(s) for s in args.strategies) if args.strategies
                    else DEFAULT_STRATEGIES),
    )
    started = time.perf_counter()
    result = run_study(lm, tokenizer, config, providers=args.providers,
                       progress=lambda targets: tqdm(list(targets), desc="targets", unit="target"))
    written = write_results(result, args.out)
    print(f"{len(result.runs)} runs in {time.perf_counter() - started:.0f} s; "
          f"wrote {', '.join(str(p) for p in written)}")
    # found: the discovered donor is the true one (positives), or any donor was proposed, a
    # false positive (negatives); "-" for the ground-truth donor choices.
    header = (f"{'cluster type':<20} {'donor':<20} {'strategy':<8} {'found':>5} {'reused':>6} "
              f"{'FLOPs saved':>11} {'exact':>5} {'1st div':>7} {'ROUGE-L':>7} {'dlogp':>6}")
    print(header)
    for kind, by_mode in result.summary().items():
        for mode, by_strategy in by_mode.items():
            for strategy, m in by_strategy.items():
                rate = m.get("discovered_correct", m.get("false_positive"))
                found = "-" if rate is None else f"{rate:.2f}"
                print(f"{kind:<20} {mode:<20} {strategy:<8} {found:>5} "
                      f"{m['reused_fraction']:>6.2f} {m['flops_saved']:>11.2f} "
                      f"{m['exact_match']:>5.2f} {m['first_divergence']:>7.1f} "
                      f"{m['rouge_l']:>7.2f} {m['logprob_delta']:>6.2f}")


if __name__ == "__main__":
    main()
