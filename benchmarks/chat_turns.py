"""A 20-turn chat through the OpenAI-compatible server: TTFT per turn, cold, vLLM's own prefix
hit, and semkv serving the history after vLLM's own cache was emptied (issue #51).

Two servers, one after the other, the README's flags on the bundled SmolLM2 (its chat
template): plain vLLM, twice over the chat (first every turn cold, its prefix cache reset
before each; then, from an emptied cache, every turn as is: vLLM's own hit on the turn
before, its answer's blocks included) and the README's semkv server (per turn: vLLM's
prefix cache reset, then the turn: only semkv's store can serve the history). The semkv server
replays the plain server's cold answers as the conversation, so both see the same messages.
Then, on the semkv server, the chat twice more with every request opted out of semkv: vLLM's
cache kept (vLLM's own hit on the same server), then emptied before every turn (the same
server's cold): the cross-server comparison above is biased by the servers' own difference.
Per turn: prompt tokens, the five TTFTs, whether semkv's answer equals cold's, and what the
connector served (its own log's record). Raw JSON to ``--out``; medians printed.

    .venv/bin/python benchmarks/chat_turns.py --out bench-results/chat_turns.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def measure(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    from semkv_vllm.bench.chat import questions, run_chat
    from semkv_vllm.bench.serve import post, served, served_records, server_args

    from semkv.request_options import request_params

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from exact_ttft import readme_extra_config  # the README's serve command's own config

    users = questions(args.turns, seed=args.seed)
    with served(server_args(None), log=logs / "plain.log") as base:
        plain = run_chat(base, users, arms=("cold",), max_tokens=args.max_tokens)
        reference = [t.answers["cold"] for t in plain]
        # vLLM's own hit in a pass of its own: no turn follows a long cold prefill, as none
        # does on the semkv server (the machine's state after one skewed the first tries)
        post(base + "/reset_prefix_cache")
        hits = run_chat(base, users, arms=("hit",), max_tokens=args.max_tokens,
                        answers=reference)
    for p, h in zip(plain, hits, strict=True):
        p.ttft_s["hit"], p.answers["hit"] = h.ttft_s["hit"], h.answers["hit"]
    with served(server_args(readme_extra_config()), log=logs / "semkv.log") as base:
        ours = run_chat(base, users, arms=("cold",), max_tokens=args.max_tokens,
                        answers=reference)
        # the same server's own hit: every request opted out of semkv (its store, full of
        # this chat by now, serves none), vLLM's cache emptied first and then kept
        post(base + "/reset_prefix_cache")
        optout = request_params(lookup=False, save=False)
        same = run_chat(base, users, arms=("hit",), max_tokens=args.max_tokens,
                        answers=reference, params=optout)
        # and its own cold: opted out, vLLM's cache emptied before every turn
        same_cold = run_chat(base, users, arms=("cold",), max_tokens=args.max_tokens,
                             answers=reference, params=optout)
    records = served_records(logs / "semkv.log")[:len(users)]  # the pass semkv served
    rows = []
    for p, s, h, c, rec in zip(plain, ours, same, same_cold, records, strict=True):
        rows.append({
            "turn": p.index, "prompt_tokens": p.prompt_tokens,
            "ttft_cold_s": p.ttft_s["cold"], "ttft_vllm_hit_s": p.ttft_s["hit"],
            "ttft_semkv_s": s.ttft_s["cold"], "ttft_same_server_hit_s": h.ttft_s["hit"],
            "ttft_same_server_cold_s": c.ttft_s["cold"],
            "semkv_equals_cold": s.answers["cold"] == p.answers["cold"],
            "vllm_hit_equals_cold": p.answers["hit"] == p.answers["cold"],
            "provenance": rec["provenance"], "semkv_tokens": rec["external_tokens"],
            "vllm_local_tokens": rec["local_prefix_tokens"]})
    later = rows[1:]
    return {"turns": args.turns, "max_tokens": args.max_tokens, "rows": rows, "summary": {
        "semkv_vs_cold_median": statistics.median(r["ttft_semkv_s"] / r["ttft_cold_s"]
                                                  for r in later),
        "semkv_vs_vllm_hit_median": statistics.median(r["ttft_semkv_s"] / r["ttft_vllm_hit_s"]
                                                      for r in later),
        "vllm_hit_vs_cold_median": statistics.median(r["ttft_vllm_hit_s"] / r["ttft_cold_s"]
                                                     for r in later),
        # both on the semkv server: no cross-server bias
        "semkv_vs_same_server_hit_median": statistics.median(
            r["ttft_semkv_s"] / r["ttft_same_server_hit_s"] for r in later),
        "semkv_vs_same_server_cold_median": statistics.median(
            r["ttft_semkv_s"] / r["ttft_same_server_cold_s"] for r in later),
        "same_server_hit_vs_cold_median": statistics.median(
            r["ttft_same_server_hit_s"] / r["ttft_same_server_cold_s"] for r in later),
        "answers_equal_cold": sum(r["semkv_equals_cold"] for r in rows),
        "served_history": sum(r["semkv_tokens"] > 0 for r in later)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench-results/chat_turns.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args, Path(tmp))
    result["started_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("turn tokens cold_s vllm_hit_s same_cold_s same_hit_s semkv_s semkv_tokens equal")
    for r in result["rows"]:
        print(f"{r['turn']:4d} {r['prompt_tokens']:6d} {r['ttft_cold_s']:6.3f} "
              f"{r['ttft_vllm_hit_s']:6.3f} {r['ttft_same_server_cold_s']:6.3f} "
              f"{r['ttft_same_server_hit_s']:6.3f} "
              f"{r['ttft_semkv_s']:6.3f} {r['semkv_tokens']:6d} "
              f"{r['semkv_equals_cold']}")
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
