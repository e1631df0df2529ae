"""Soak: the real ``vllm serve`` with semkv behind a fault-injecting provider, under load.

Two servers on the bundled model (vLLM CPU), one after the other (never both at once):
1. ``cold``: no connector. Every distinct prompt once, at the same concurrency: the reference
   greedy output of each prompt.
2. ``soak``: semkv ``materialize_exact`` behind ``provider: faulty`` wrapping ``chunks``, which
   misbehaves on a seeded fraction (``--fault-rate``) of lookups, every fault kind in turn.
   ``--requests`` requests at fixed ``--concurrency``, drawn Zipf-like from the labelled
   workload of ``semkv.eval`` (donors and targets of every cluster kind), so popular prompts
   come back and are served from semkv's store (vLLM's own prefix cache is off unless
   ``--prefix-caching``: every reused token is semkv's) while the tail evicts donors.

Checked and reported: failed requests (HTTP error or finish_reason ``error``); outputs of
exact-tier hits against the cold reference (and, as the noise floor, of every other request);
faults injected by kind (``fault_injected`` events in the server log); fallbacks by reason and
provider errors by kind (``/metrics``); live donor leases once the server is idle (the
``vllm:semkv_live_leases`` gauge); the donor store's bytes against ``donor_store_bytes`` (gauge,
sampled); RSS of the server's process tree (sampled); prompt text in the server log or
``/metrics`` (32-character pieces of every prompt). Writes raw JSON, prints a summary, and exits
non-zero when a check fails.

    .venv/bin/python benchmarks/soak.py --requests 1000 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

CONNECTOR = {"kv_connector": "SemanticKVConnector",
             "kv_connector_module_path": "semkv_vllm.connector",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
FAULTS = ["raise", "hang", "garbage", "foreign", "out_of_range", "unknown_donor", "negative",
          "unaligned", "nan_similarity"]
console = Console()


# -- servers ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``vllm serve`` in its own process group (the engine core is a child: kill them all)."""

    def __init__(self, name: str, extra: dict[str, Any] | None, args: argparse.Namespace,
                 log_dir: Path) -> None:
        from semkv.bundled_model import ensure_model
        from semkv.kv_sizing import bundled_kv_cache_bytes

        self.name, self.port = name, _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(ensure_model()), "--served-model-name", "smollm2",
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
               "--max-model-len", "4096", "--block-size", "32", "--enforce-eager",
               "--kv-cache-memory-bytes", str(bundled_kv_cache_bytes(
                   max_model_len=4096, max_num_seqs=args.concurrency, block_size=32)),
               "--max-num-seqs", str(args.concurrency),
               "--enable-prefix-caching" if args.prefix_caching else "--no-enable-prefix-caching"]
        if extra is not None:
            # the soak reads each request's summary from its response: its own operator
            cmd += ["--kv-transfer-config", json.dumps(dict(CONNECTOR, kv_connector_extra_config={
                "summary_to_client": True, **extra}))]
        # the soak selects the fault injector on purpose (refused without this opt-in)
        env = dict(os.environ, HF_HUB_OFFLINE="1", SEMKV_LOG_LEVEL="INFO",
                   SEMKV_ALLOW_FAULT_INJECTION="1")
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def wait_healthy(self, timeout: float = 900.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited:\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.base + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise RuntimeError(f"{self.name} server did not become healthy")

    def rss_by_process(self) -> dict[str, float]:
        """RSS of each process of the server's tree, by process name (API server, engine core,
        worker), so growth can be attributed."""
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return {}
        out: Counter[str] = Counter()
        for p in procs:
            try:
                name = "api_server" if p.pid == root.pid else p.name()
                out[name] += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return dict(out)

    def metrics(self) -> str:
        return httpx.get(self.base + "/metrics", timeout=30).text

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)


# -- workload --------------------------------------------------------------------------------
def build_prompts(seed: int, clusters: int, target_tokens: int) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    from semkv.bundled_model import ensure_model
    from semkv.eval.workload import build_workload

    tok = AutoTokenizer.from_pretrained(str(ensure_model()))
    workload = build_workload(seed, clusters_per_type=clusters, target_tokens=target_tokens,
                              tokenizer=tok.encode)
    return [{"id": p.prompt_id, "kind": str(p.kind), "role": p.role, "text": p.text,
             "tokens": len(tok.encode(p.text))} for p in (*workload.donors, *workload.targets)]


def zipf_sequence(count: int, n: int, seed: int, s: float = 1.1) -> list[int]:
    """``n`` prompt indices, popular ones often (ranks shuffled so every kind can be popular)."""
    rng = random.Random(seed)
    ranks = list(range(count))
    rng.shuffle(ranks)
    weights = [1.0 / (ranks[i] + 1) ** s for i in range(count)]
    return rng.choices(range(count), weights=weights, k=n)


# -- load ------------------------------------------------------------------------------------
async def drive(server: Server, prompts: list[dict[str, Any]], order: list[int],
                concurrency: int, max_tokens: int, label: str) -> list[dict[str, Any]]:
    gate = asyncio.Semaphore(concurrency)
    results: list[dict[str, Any]] = [{} for _ in order]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=server.base, timeout=600, limits=limits) as client:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(label, total=len(order))

            async def one(slot: int, index: int) -> None:
                body = {"model": "smollm2", "prompt": prompts[index]["text"],
                        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
                rec: dict[str, Any] = {"prompt": index}
                async with gate:
                    started = time.perf_counter()
                    try:
                        resp = await client.post("/v1/completions", json=body)
                        rec["status"] = resp.status_code
                        if resp.status_code == 200:
                            data = resp.json()
                            choice = data["choices"][0]
                            rec["text"] = choice["text"]
                            rec["finish_reason"] = choice.get("finish_reason")
                            rec["semkv"] = (data.get("kv_transfer_params") or {}).get("semkv")
                    except httpx.HTTPError as exc:
                        rec["status"], rec["error"] = -1, type(exc).__name__
                    rec["seconds"] = time.perf_counter() - started
                results[slot] = rec
                progress.advance(task)

            await asyncio.gather(*(one(i, idx) for i, idx in enumerate(order)))
    return results


class Sampler(threading.Thread):
    """RSS of the server's process tree and the semkv gauges, every ``period`` seconds."""

    def __init__(self, server: Server, period: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.server, self.period = server, period
        self.samples: list[dict[str, float]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        started = time.time()
        while not self.stop_event.wait(self.period):
            by_process = self.server.rss_by_process()
            sample = {"t": time.time() - started, "rss": float(sum(by_process.values()))}
            sample.update({f"rss:{name}": float(v) for name, v in by_process.items()})
            try:
                text = self.server.metrics()
                for gauge in ("donor_store_bytes", "live_leases", "donors"):
                    sample[gauge] = metric(text, f"vllm:semkv_{gauge}")
                sample["finished"] = metric(text, "vllm:semkv_provenance_total")
            except httpx.HTTPError:
                pass
            self.samples.append(sample)


# -- reading the results ---------------------------------------------------------------------
_LINE = re.compile(r'^(vllm:semkv_[a-z_]+)(?:\{([^}]*)\})? ([0-9.eE+-]+)$')


def metric(text: str, name: str) -> float:
    return sum(v for n, _, v in parse_metrics(text) if n == name)


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    rows = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            rows.append((m.group(1), labels, float(m.group(3))))
    return rows


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    out: Counter[str] = Counter()
    for n, labels, v in parse_metrics(text):
        if n == name and v:
            out[labels.get(label, "")] += v
    return dict(out)


def leaked_pieces(haystack: str, prompts: list[dict[str, Any]], width: int = 32) -> int:
    """How many ``width``-character pieces of any prompt occur in ``haystack``."""
    found = 0
    for p in prompts:
        text = p["text"]
        for start in range(0, max(len(text) - width, 1), width):
            piece = text[start : start + width]
            if len(piece.strip()) >= width // 2 and piece in haystack:
                found += 1
    return found


def wait_idle(server: Server, expected: int, timeout: float = 60.0) -> str:
    """/metrics once every request's provenance was exported (metrics lag the responses)."""
    deadline, text = time.time() + timeout, ""
    while time.time() < deadline:
        text = server.metrics()
        if metric(text, "vllm:semkv_provenance_total") >= expected:
            break
        time.sleep(1)
    return text


def semkv_lines(log: str) -> str:
    return "\n".join(line for line in log.splitlines() if line.startswith("semkv"))


def faults_by_kind(log: str) -> dict[str, int]:
    kinds: Counter[str] = Counter()
    for line in log.splitlines():
        if '"fault_injected"' in line:
            m = re.search(r'"kind": "(\w+)"', line)
            if m:
                kinds[m.group(1)] += 1
    return dict(kinds)


def summarize(args: argparse.Namespace, prompts: list[dict[str, Any]],
              cold: dict[int, str], soak: list[dict[str, Any]], seconds: float,
              sampler: Sampler, metrics_text: str, log: str) -> dict[str, Any]:
    failed = [r for r in soak if r.get("status") != 200 or r.get("finish_reason") == "error"]
    provenance = Counter((r.get("semkv") or {}).get("provenance", "none") for r in soak)
    reasons = Counter((r.get("semkv") or {}).get("fallback_reason") for r in soak
                      if (r.get("semkv") or {}).get("fallback_reason"))
    hits = [r for r in soak if (r.get("semkv") or {}).get("tier") == "exact"]
    hit_ids = {id(r) for r in hits}
    others = [r for r in soak if id(r) not in hit_ids and "text" in r]
    rss = [s["rss"] for s in sampler.samples if s.get("rss")]
    # The donor store's pages are touched as it fills, so RSS rises early by design; growth is
    # judged over the second half of the run, when the store has long been at its budget.
    half = rss[len(rss) // 2] if rss else 0.0
    store = [s["donor_store_bytes"] for s in sampler.samples if "donor_store_bytes" in s]
    budget = float(psutil_bytes(args.donor_store_bytes))
    return {
        "config": vars(args),
        "distinct_prompts": len(prompts),
        "prompt_tokens": {"min": min(p["tokens"] for p in prompts),
                          "max": max(p["tokens"] for p in prompts)},
        "requests": len(soak), "failed_requests": len(failed), "seconds": round(seconds, 1),
        "requests_per_second": round(len(soak) / seconds, 2),
        "provenance": dict(provenance), "fallbacks_by_reason": dict(reasons),
        "exact_hits": len(hits),
        "exact_hit_tokens_loaded": sum((r["semkv"] or {}).get("external_tokens", 0)
                                       for r in hits),
        "exact_hit_mismatches": sum(r.get("text") != cold[r["prompt"]] for r in hits),
        "other_mismatches": sum(r.get("text") != cold[r["prompt"]] for r in others),
        "other_compared": len(others),
        "faults_injected": faults_by_kind(log),
        "metrics": {
            "fallbacks": by_label(metrics_text, "vllm:semkv_fallbacks_total", "reason"),
            "lookup_errors": by_label(metrics_text, "vllm:semkv_lookup_errors_total", "kind"),
            "materialize_success": metric(metrics_text, "vllm:semkv_materialize_success_total"),
            "materialize_failed": metric(metrics_text, "vllm:semkv_materialize_failed_total"),
            "loaded_tokens": metric(metrics_text, "vllm:semkv_loaded_tokens_total"),
            "donor_registrations": metric(metrics_text,
                                          "vllm:semkv_donor_registrations_total"),
            "donor_evictions": metric(metrics_text, "vllm:semkv_donor_evictions_total"),
        },
        "live_leases_idle": metric(metrics_text, "vllm:semkv_live_leases"),
        "donor_store_bytes_max": max(store, default=0.0), "donor_store_budget": budget,
        "rss_growth_second_half_by_process": _growth_by_process(sampler.samples),
        "rss_bytes": {"first": rss[0] if rss else 0, "half_way": half,
                      "last": rss[-1] if rss else 0, "max": max(rss, default=0),
                      "growth_second_half": (rss[-1] - half) if rss else 0,
                      "growth_total": (rss[-1] - rss[0]) if rss else 0},
        "prompt_pieces_in_semkv_log": leaked_pieces(semkv_lines(log), prompts),
        "prompt_pieces_in_metrics": leaked_pieces(metrics_text, prompts),
        "samples": sampler.samples,
    }


def _growth_by_process(samples: list[dict[str, float]]) -> dict[str, float]:
    with_rss = [s for s in samples if s.get("rss")]
    if not with_rss:
        return {}
    half, last = with_rss[len(with_rss) // 2], with_rss[-1]
    return {k[4:]: last.get(k, 0.0) - half.get(k, 0.0) for k in last if k.startswith("rss:")}


def psutil_bytes(value: str) -> int:
    from pydantic import ByteSize, TypeAdapter

    return int(TypeAdapter(ByteSize).validate_python(value))


def verdicts(s: dict[str, Any], rss_bound: float) -> dict[str, bool]:
    return {
        "zero failed requests": s["failed_requests"] == 0,
        "exact-tier hits happened": s["exact_hits"] > 0,
        "exact-tier outputs identical to cold": s["exact_hit_mismatches"] == 0,
        "every fault kind injected": set(s["faults_injected"]) == set(FAULTS),
        "zero live leases when idle": s["live_leases_idle"] == 0,
        "donor store within its budget": s["donor_store_bytes_max"] <= s["donor_store_budget"],
        f"RSS growth over the second half <= {rss_bound / 2**20:.0f} MiB":
            s["rss_bytes"]["growth_second_half"] <= rss_bound,
        "no prompt text in semkv logs or metrics":
            s["prompt_pieces_in_semkv_log"] == 0 and s["prompt_pieces_in_metrics"] == 0,
    }


def print_summary(s: dict[str, Any], checks: dict[str, bool]) -> None:
    table = Table(title=f"semkv soak: {s['requests']} requests in {s['seconds']} s")
    table.add_column("figure")
    table.add_column("value")
    mib = 2**20
    rows = [
        ("failed requests", s["failed_requests"]),
        ("provenance", s["provenance"]),
        ("exact hits / mismatches vs cold", f"{s['exact_hits']} / {s['exact_hit_mismatches']}"),
        ("other requests / mismatches vs cold",
         f"{s['other_compared']} / {s['other_mismatches']}"),
        ("faults injected", s["faults_injected"]),
        ("fallbacks by reason", s["metrics"]["fallbacks"]),
        ("lookup errors by kind", s["metrics"]["lookup_errors"]),
        ("live leases when idle", s["live_leases_idle"]),
        ("donor store max / budget (MiB)",
         f"{s['donor_store_bytes_max'] / mib:.1f} / {s['donor_store_budget'] / mib:.1f}"),
        ("RSS first / half-way / last / max (MiB)", " / ".join(
            f"{s['rss_bytes'][k] / mib:.0f}" for k in ("first", "half_way", "last", "max"))),
    ]
    for name, value in rows:
        table.add_row(name, str(value))
    console.print(table)
    for name, ok in checks.items():
        console.print(f"[{'green' if ok else 'red'}]{'PASS' if ok else 'FAIL'}[/] {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--target-tokens", type=int, default=256)
    parser.add_argument("--zipf", type=float, default=1.3, help="popularity skew of prompts")
    parser.add_argument("--clusters", type=int, default=4, help="clusters per kind")
    parser.add_argument("--fault-rate", type=float, default=0.3)
    parser.add_argument("--donor-store-bytes", default="256MiB")
    parser.add_argument("--rss-bound-mib", type=float, default=128.0,
                        help="most RSS growth allowed over the second half of the soak")
    parser.add_argument("--prefix-caching", action="store_true")
    parser.add_argument("--semantic-mode", default="materialize_exact",
                        help="disabled: the same run with semkv idle, to attribute memory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-results/soak.json"))
    args = parser.parse_args()
    # SIGTERM ends the run through the finally blocks, which stop the servers' process groups.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = args.out.parent / "soak-logs"
    log_dir.mkdir(exist_ok=True)

    prompts = build_prompts(args.seed, args.clusters, args.target_tokens)
    order = zipf_sequence(len(prompts), args.requests, args.seed, args.zipf)
    console.print(f"{len(prompts)} distinct prompts, {len(set(order))} of them used")

    cold_server = Server("cold", None, args, log_dir)
    try:
        cold_server.wait_healthy()
        cold_runs = asyncio.run(drive(cold_server, prompts, sorted(set(order)),
                                      args.concurrency, args.max_tokens, "cold reference"))
    finally:
        cold_server.stop()
    cold = {r["prompt"]: r.get("text") for r in cold_runs}

    extra = {"provider": "faulty", "semantic_mode": args.semantic_mode,
             "min_reuse_tokens": 64, "lookup_timeout_ms": 50,
             "donor_store_bytes": args.donor_store_bytes,
             "provider_config": {"inner": "chunks", "faults": FAULTS, "rate": args.fault_rate,
                                 "hang_seconds": 0.2, "seed": args.seed}}
    server = Server("soak", extra, args, log_dir)
    sampler = Sampler(server)
    try:
        server.wait_healthy()
        sampler.start()
        started = time.perf_counter()
        soak = asyncio.run(drive(server, prompts, order, args.concurrency, args.max_tokens,
                                 "soak"))
        seconds = time.perf_counter() - started
        metrics_text = wait_idle(server, len(order))
        time.sleep(3)  # one more sample of the idle server
        sampler.stop_event.set()
        sampler.join()
    finally:
        sampler.stop_event.set()
        server.stop()
    summary = summarize(args, prompts, cold, soak, seconds, sampler, metrics_text, server.log())
    checks = verdicts(summary, args.rss_bound_mib * 2**20)
    summary["checks"] = checks
    summary["per_request"] = [{k: v for k, v in r.items() if k != "text"} for r in soak]
    args.out.write_text(json.dumps(summary, indent=1, default=str))
    print_summary(summary, checks)
    console.print(f"raw results: {args.out}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
