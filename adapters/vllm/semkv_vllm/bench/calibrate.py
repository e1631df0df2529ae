"""``semkv calibrate``: the frontier on the operator's own engine, written as a gate policy.

Protocol::

    from semkv_vllm.bench.calibrate import Options, calibrate

    result = calibrate(Options(model="/models/my-llm", dtype="bfloat16",
                               prompts=Path("prompts.jsonl"), out=Path("policy.json")))
    result["policy"].served_classes()

The engine is the one the operator serves with: ``--model``, ``--dtype``, ``--kv-cache-dtype``,
``--block-size``, ``--max-model-len``, ``--kv-cache-memory-bytes`` as ``vllm serve`` takes them,
anything else ``LLM()`` accepts as ``engine_args``. It runs in this process, one request at a
time, with semkv's connector in ``materialize_semantic`` (verified tier, realized spans, MinHash
discovery at LSH threshold 0.1), the recompute and kv_floor overrides allowed,
``gate_policy: ungated`` (every plan class is realized, so every class is measured) and
``realize_min_gain`` 0 (the cost gate off: every plan is measured; the TTFT the policy reads is
the one measured). The frontier runner
(``semkv_vllm.bench.frontier``, lean: only KL and TTFT, every arm but cold generating two
tokens) measures, per target, cold, the fp8-KV floor and each strategy; ``semkv.calibrate``
turns its rows into the policy, keyed by the identity the engine itself
reports (``class_gate.engine_identity``: the same digest the connector checks at start-up).

Prompts: the operator's JSONL file (``semkv.calibrate_prompts``) or the bundled labelled
workloads (``semkv.eval``, the frontier's reuse kinds), tokenized with the served model's
tokenizer. Writes the policy (``out``) and, beside it, ``<out stem>.rows.json``: the run's
measurements and raw rows (counts, times and scores; never text or token ids).
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from semkv.bench.config import COLD, FLOOR, STRATEGIES, BenchConfig
from semkv.calibrate import MIN_GAIN, MIN_SAMPLES
from semkv.calibrate_prompts import DONORS
from semkv.eval.model import ClusterKind

DEFAULT_STRATEGIES = ("realized:first_k16", "realized:first_k16+blend15")
DEFAULT_KINDS = ("cross_instruction", "cross_instruction_task_first", "paraphrased_lead_in",
                 "multi_passage_rag", "reordered_chunks")
SIZING_BLOCK = 128  # vLLM-CPU's default block size, for sizing when --block-size is not given


class CalibrateError(ValueError):
    """Input ``semkv calibrate`` cannot use (exit 2; the message says what to change)."""


@dataclass(frozen=True)
class Options:
    model: str | None = None  # a folder or a Hugging Face id; None: the bundled model
    dtype: str | None = None  # None: float32 for the bundled model, else "auto"
    kv_cache_dtype: str = "auto"
    block_size: int | None = None  # None: vLLM's default
    max_model_len: int | None = None  # None: the longest prompt + the answer, in blocks
    kv_cache_memory_bytes: int | None = None  # None: 4 requests of max_model_len
    engine_args: dict[str, Any] = field(default_factory=dict)
    prompts: Path | None = None  # None: the bundled workloads
    donors: int = DONORS
    kinds: tuple[str, ...] = DEFAULT_KINDS
    target_tokens: int = 1024
    targets_per_kind: int = 8
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    max_tokens: int = 32
    min_samples: int = MIN_SAMPLES
    min_gain: float = MIN_GAIN
    seed: int = 0
    cores: str | None = None  # VLLM_CPU_OMP_THREADS_BIND; None: every core
    out: Path = Path("semkv-gate-policy.json")
    show_progress: bool = True

    def validate(self) -> None:
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown or not self.strategies:
            raise CalibrateError(f"unknown strategy(ies) {unknown}; known: {list(STRATEGIES)}")
        reuse = [k.value for k in ClusterKind if not k.is_negative]
        bad = [k for k in self.kinds if k not in reuse]
        if self.prompts is None and (bad or not self.kinds):
            raise CalibrateError(f"unknown or negative kind(s) {bad}; reuse kinds: {reuse}")
        for name in ("target_tokens", "targets_per_kind", "max_tokens", "min_samples",
                     "donors"):
            if getattr(self, name) < 1:
                raise CalibrateError(f"--{name.replace('_', '-')} must be at least 1")
        if self.min_gain < 1.0:
            raise CalibrateError("--min-gain must be at least 1.0 (never slower than cold)")
        if self.prompts is not None and not self.prompts.is_file():
            raise CalibrateError(f"prompts file {str(self.prompts)!r} does not exist")
        clash = sorted(set(self.engine_args) & _OWN_ARGS)
        if clash:
            raise CalibrateError(f"--engine-arg {clash}: set by semkv calibrate itself "
                                 "(use the named option, e.g. --max-model-len)")


# LLM() arguments calibrate sets itself (a measurement needs them as they are)
_OWN_ARGS = frozenset({"model", "dtype", "kv_cache_dtype", "block_size", "max_model_len",
                       "kv_cache_memory_bytes", "kv_transfer_config", "max_num_seqs",
                       "enable_prefix_caching", "scheduler_cls"})


def parse_engine_arg(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` (``--engine-arg``): the value as JSON where it parses, else the string."""
    key, sep, value = text.partition("=")
    key = key.strip().removeprefix("--").replace("-", "_")
    if not sep or not key.isidentifier():
        raise CalibrateError(f"--engine-arg {text!r}: expected KEY=VALUE (an LLM() argument, "
                             "e.g. enforce_eager=true or max_num_batched_tokens=4096)")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def rows_path(out: Path) -> Path:
    return out.with_name(f"{out.stem}.rows.json")


def _read_prompts(opts: Options) -> list[Any] | None:
    """The prompts file's lines, read before any engine or tokenizer (None: bundled)."""
    if opts.prompts is None:
        return None
    from semkv.calibrate_prompts import PromptsError, read_prompts, require_targets

    try:
        prompts = read_prompts(opts.prompts)
    except PromptsError as exc:
        raise CalibrateError(str(exc)) from None
    try:
        require_targets(prompts, where=str(opts.prompts), donors=opts.donors,
                        min_targets=opts.min_samples)
    except PromptsError as exc:  # fewer targets than --min-samples certify no class
        raise CalibrateError(f"{exc}: --min-samples {opts.min_samples}") from None
    return prompts


def _workload(opts: Options, config: BenchConfig, folder: Path, prompts: list[Any] | None,
              ) -> tuple[Any, str, dict[str, int]]:
    """(workload, the policy's source, prompt id -> JSONL line)."""
    if prompts is None or opts.prompts is None:
        from semkv.bench.workload import load_workload
        from semkv.eval import WorkloadSizeError

        try:
            wl = load_workload(config, tokenizer=folder)
        except WorkloadSizeError as exc:
            raise CalibrateError(str(exc)) from None
        return wl, (f"bundled workloads: {', '.join(opts.kinds)}; ~{opts.target_tokens} "
                    f"tokens, {opts.targets_per_kind} targets per kind, seed {opts.seed}"), {}
    from transformers import AutoTokenizer

    from semkv.calibrate_prompts import line_of, prompts_workload

    tok = AutoTokenizer.from_pretrained(str(folder))
    wl = prompts_workload(prompts, tok.encode, where=str(opts.prompts), donors=opts.donors)
    return wl, (f"prompts file {opts.prompts.name}: {len(prompts)} prompts, "
                f"{len(wl.targets)} targets"), line_of(prompts)


def _max_model_len(opts: Options, config: BenchConfig, wl: Any, lines: dict[str, int]) -> int:
    """What the run needs: the longest prompt, its answer teacher forced, one more token."""
    longest = max(wl.ids, key=lambda p: len(wl.ids[p]))
    need = len(wl.ids[longest]) + opts.max_tokens + 1
    if opts.max_model_len is None:
        bs = opts.block_size or SIZING_BLOCK
        need = -(-need // bs) * bs
        return max(need, config.max_model_len) if opts.prompts is None else need
    if need > opts.max_model_len:
        what = (f"line {lines[longest]} of the prompts file" if longest in lines
                else "the longest bundled prompt (lower --target-tokens)")
        raise CalibrateError(f"{what} has {len(wl.ids[longest])} tokens: with its "
                             f"{opts.max_tokens}-token answer it needs --max-model-len >= "
                             f"{need} (given {opts.max_model_len})")
    return opts.max_model_len


def calibrate(opts: Options, *, command: str = "semkv calibrate") -> dict[str, Any]:
    """Measure, decide, write the policy and the rows; the result holds both and the table."""
    started = time.time()
    opts.validate()
    prompts = _read_prompts(opts)
    from semkv_vllm.bench.engine import configure_process, engine_connector

    configure_process(opts.cores or f"0-{max(1, os.cpu_count() or 1) - 1}")
    from semkv.atomic_file import write_text_atomic
    from semkv.bundled_model import served_as
    from semkv.calibrate import build_policy, measure, summary_table, write_policy
    from semkv.kv_sizing import kv_cache_bytes, kv_dtype_of
    from semkv.model_identity import model_folder
    from semkv_vllm.bench.frontier import most_donors, run_frontier
    from semkv_vllm.class_gate import engine_facts, engine_identity

    model, dtype = served_as(opts.model, opts.dtype)
    folder = model_folder(model, opts.engine_args.get("revision"))
    if folder is None:
        raise CalibrateError(f"--model {model!r}: neither a folder nor a Hugging Face model in "
                             "the local cache (download it first: its files are measured)")
    config = BenchConfig(
        preset="calibrate", arms=(COLD, FLOOR, *opts.strategies), kinds=opts.kinds,
        clusters_per_type=opts.targets_per_kind, target_tokens=opts.target_tokens,
        max_tokens=opts.max_tokens, concurrency=1, seed=opts.seed,
        block_size=opts.block_size or SIZING_BLOCK, runner="frontier",
        cores=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ""))
    config.validate()
    wl, source, lines = _workload(opts, config, folder, prompts)
    max_len = _max_model_len(opts, config, wl, lines)
    width = kv_dtype_of(dtype, opts.kv_cache_dtype, folder)
    bs = opts.block_size or SIZING_BLOCK
    engine_args: dict[str, Any] = {
        **opts.engine_args, "model": model, "dtype": dtype,
        "kv_cache_dtype": opts.kv_cache_dtype, "block_size": opts.block_size,
        "max_model_len": max_len,
        "kv_cache_memory_bytes": opts.kv_cache_memory_bytes or kv_cache_bytes(
            folder, max_model_len=max_len, max_num_seqs=4, block_size=bs, dtype=width)}
    overrides = {"donor_store_bytes": kv_cache_bytes(
        folder, max_model_len=max_len, max_num_seqs=most_donors(wl) + 2, block_size=bs,
        dtype=width), "realize_min_gain": 0.0}
    found: list[Any] = []
    facts: list[Any] = []  # the engine measured on, recorded in the policy

    def identify(llm: Any) -> None:
        identity = engine_identity(llm.llm_engine.vllm_config)
        if identity is None:
            raise CalibrateError(f"--model {model!r}: the engine's model folder cannot be read "
                                 "for its identity, so no policy could apply to it")
        why = engine_connector(llm).realized_spans_refusal()  # short: the engine's own words
        if why is not None:  # every plan would be refused: nothing to measure, say why now
            raise CalibrateError(f"--model {model!r}: this engine cannot realize spans: {why}; "
                                 "a policy calibrated on it would serve nothing")
        found.append(identity)
        facts.append(engine_facts(llm.llm_engine.vllm_config))

    raw = run_frontier(config, wl, show_progress=opts.show_progress, engine_args=engine_args,
                       overrides=overrides, on_open=identify, lean=True)
    rows = raw["rows"]
    measurements = measure(rows)
    policy = build_policy(rows, found[0], source=source, min_samples=opts.min_samples,
                          min_gain=opts.min_gain, engine=facts[0],
                          label=f"semkv calibrate: {opts.model or 'bundled SmolLM2-135M'}, "
                                f"vLLM on {platform.machine()}")
    write_policy(policy, opts.out)
    wall = time.time() - started
    table = summary_table(policy, measurements)
    record = {
        "command": command, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                         time.gmtime(started)),
        "wall_s": wall, "machine": f"{os.cpu_count()} CPUs, {platform.platform()}",
        "options": {**asdict(replace(opts, engine_args={})), "prompts": str(opts.prompts),
                    "out": str(opts.out)},
        "engine_args": {k: v for k, v in engine_args.items() if v is not None},
        "connector": raw["engine"], "identity": asdict(found[0]), "source": source,
        "workload": {"targets": len(wl.targets), "donors": len(wl.donors)},
        "request_only_violations": raw["request_only_violations"],
        "measurements": [m.as_dict() for m in measurements],
        "policy": policy.model_dump(mode="json", exclude_none=True), "rows": rows}
    write_text_atomic(rows_path(opts.out), json.dumps(record, indent=2, default=str) + "\n")
    return {"policy": policy, "measurements": measurements, "table": table, "wall_s": wall,
            "out": opts.out, "rows_out": rows_path(opts.out), "rows": rows,
            "request_only_violations": raw["request_only_violations"]}
