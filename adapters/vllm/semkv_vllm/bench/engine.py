"""The vLLM side of ``semkv bench``: one in-process engine per arm, one request at a time.

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): vLLM is imported once, so an
engine starts in ~15-25 s instead of ~60-120 s, which is what makes a multi-arm run fit in
minutes on two cores. Arms run one after another, never two engines at once, all bound to the
same cores (``VLLM_CPU_OMP_THREADS_BIND``).

Per request the engine-confirmed facts come from the connector itself: the per-request summary
(``kv_transfer_params["semkv"]``) and deltas of the ``vllm:semkv_*`` series around the request
(loaded tokens are counted by the worker: a hit is never inferred from latency).

The records it fills (``Run``, ``Snapshot``) are engine-free (``semkv.bench.results``).

NOTE: token ids and text never leave this module in a result; only counts, times and scores.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from semkv.bench.config import Arm, BenchConfig
from semkv.bench.results import Run, Snapshot

CONNECTOR = {"kv_connector": "SemanticKVConnector",
             "kv_connector_module_path": "semkv_vllm.connector",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def configure_process(cores: str) -> None:
    """Before vLLM is imported: in-process engines, pinned cores, quiet logs."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cores)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("SEMKV_LOG_LEVEL", "WARNING")
    # semkv's logger may be configured already (building the CLI loads every plugin)
    logging.getLogger("semkv").setLevel(os.environ["SEMKV_LOG_LEVEL"])


def engine_connector(llm: Any) -> Any:
    """The scheduler's semkv connector of an in-process engine (``configure_process``)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError("the engine runs in another process: VLLM_ENABLE_V1_MULTIPROCESSING "
                           "must be 0 before vLLM is imported (configure_process)")
    return core.scheduler.connector


def snapshot(llm: Any) -> Snapshot:
    values: dict[str, float] = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith("vllm:semkv_"):
            continue
        label = next((v for k, v in metric.labels.items() if k not in ("model_name", "engine")),
                     None)
        name = metric.name if label is None else f"{metric.name}:{label}"
        if hasattr(metric, "sum"):  # histogram
            values[f"{name}:sum"] = values.get(f"{name}:sum", 0.0) + float(metric.sum)
            values[f"{name}:count"] = values.get(f"{name}:count", 0.0) + float(metric.count)
        elif hasattr(metric, "value"):
            values[name] = values.get(name, 0.0) + float(metric.value)
    return Snapshot(values)


def kv_bytes_for(config: BenchConfig, max_num_seqs: int) -> int:
    """KV bytes for ``max_num_seqs`` requests of ``config.max_model_len`` on ``config``'s model
    (its ``config.json``; the KV dtype the engine will use)."""
    from semkv.bundled_model import served_as
    from semkv.kv_sizing import kv_cache_bytes, kv_dtype_of

    folder, dtype = served_as(config.model, config.dtype)
    return kv_cache_bytes(folder, max_model_len=config.max_model_len, max_num_seqs=max_num_seqs,
                          block_size=config.block_size, dtype=kv_dtype_of(dtype, "auto", folder))


@contextlib.contextmanager
def open_engine(arm: Arm, config: BenchConfig, *, max_num_seqs: int,
                engine_args: Mapping[str, Any] | None = None) -> Iterator[Any]:
    """One in-process engine for ``arm``: ``config``'s model (default: the bundled SmolLM2), or
    ``engine_args`` (``LLM()`` keyword arguments laid over the bench's; a None value drops the
    bench's own)."""
    from vllm import LLM

    args = dict(engine_args or {})
    if "model" not in args:
        from semkv.bundled_model import served_as

        args["model"], dtype = served_as(config.model, config.dtype)
        args.setdefault("dtype", dtype)
    if "kv_cache_memory_bytes" not in args:
        # NOTE: at least 4 sequences' worth, so the anchor arm's repeated prompt stays cached.
        args["kv_cache_memory_bytes"] = config.kv_cache_bytes or kv_bytes_for(
            config, max(max_num_seqs, 4))
    kwargs: dict[str, Any] = dict(
        dtype="float32", max_model_len=config.max_model_len, block_size=config.block_size,
        enable_prefix_caching=True, enforce_eager=True, disable_log_stats=False, seed=0,
        max_num_seqs=max_num_seqs,
        # the bench reads each request's summary: it is its own operator
        kv_transfer_config=dict(CONNECTOR, kv_connector_extra_config={
            "summary_to_client": True, **arm.extra}))
    kwargs = {k: v for k, v in {**kwargs, **args}.items() if v is not None}
    if arm.commit_policy:
        kwargs["scheduler_cls"] = "semkv_vllm.commit_policy.CommitPolicyScheduler"
    llm = LLM(**kwargs)
    try:
        yield llm
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _params(max_tokens: int, options: dict[str, Any] | None = None, **kw: Any) -> Any:
    """Greedy sampling params; ``options``: semkv request options (overrides need the
    engine's ``request_overrides``)."""
    from vllm import SamplingParams

    from semkv.request_options import request_params

    extra = {"kv_transfer_params": request_params(**options)} if options else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          detokenize=False, extra_args=extra, **kw)


def generate(llm: Any, token_ids: Sequence[int], max_tokens: int,
             options: dict[str, Any] | None = None) -> Run:
    """One greedy request alone (fixed output length): TTFT from vLLM's own request stats."""
    from vllm.inputs import TokensPrompt

    params = _params(max_tokens, options)
    before = snapshot(llm)
    start = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=list(token_ids))], params,
                       use_tqdm=False)[0]
    e2e = time.perf_counter() - start
    ttft = getattr(out.metrics, "first_token_latency", None) or e2e
    return Run(ttft_s=float(ttft), e2e_s=e2e, output=list(out.outputs[0].token_ids),
               summary=dict((out.kv_transfer_params or {}).get("semkv", {})),
               delta=snapshot(llm) - before, prompt_tokens=len(out.prompt_token_ids))


def generate_batch(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int,
                   ) -> tuple[float, list[Run]]:
    """All prompts submitted at once (the engine's ``max_num_seqs`` caps concurrency)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                        use_tqdm=False)
    wall = time.perf_counter() - start
    runs = []
    for out in outs:
        m = out.metrics
        ttft = float(getattr(m, "first_token_latency", 0.0) or 0.0)
        # queued -> last token, on the engine's monotonic clock
        e2e = float(m.last_token_ts - m.queued_ts) if m is not None else wall
        runs.append(Run(ttft_s=ttft, e2e_s=e2e, output=list(out.outputs[0].token_ids),
                        summary=dict((out.kv_transfer_params or {}).get("semkv", {})),
                        delta=Snapshot(), prompt_tokens=len(out.prompt_token_ids)))
    return wall, runs


def answer_logprobs(llm: Any, prompt: Sequence[int], answer: Sequence[int],
                    options: dict[str, Any] | None = None,
                    ) -> tuple[dict[int, float], dict[str, Any]]:
    """Log-probability of each ``answer`` token after ``prompt`` on this engine, by position.

    vLLM skips its prefix cache AND the connector for prompt-logprob requests unless
    ``skip_reading_prefix_cache=False``: with it, the reused prefix is loaded as for any other
    request and the positions computed in this forward carry their log-probabilities. Positions
    served from reused KV (a stored copy of this very answer, a long wrong donor) have none and
    are left out: callers compare runs on the positions both scored.
    """
    dists, summary = answer_distributions(llm, prompt, answer, top=0, options=options)
    scored = {i: d[tok] for i, (tok, d) in enumerate(zip(answer, dists, strict=False))
              if d is not None and tok in d}
    return scored, summary


def answer_distributions(llm: Any, prompt: Sequence[int], answer: Sequence[int], *,
                         top: int, options: dict[str, Any] | None = None,
                         ) -> tuple[list[dict[int, float] | None], dict[str, Any]]:
    """Per ``answer`` position: the engine's top-``top`` log-probabilities there (plus the
    answer token's), teacher forced after ``prompt``; None where reused KV served the position.

    With ``options`` (request options), ``reuse_until`` keeps semkv's KV off the answer.
    """
    from vllm.inputs import TokensPrompt

    params = _params(1, options, prompt_logprobs=top, skip_reading_prefix_cache=False)
    ids = [*prompt, *answer]
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
    tail = (out.prompt_logprobs or [])[len(prompt):]
    dists: list[dict[int, float] | None] = [
        None if lp is None else {int(t): float(v.logprob) for t, v in lp.items()}
        for lp in tail]
    dists += [None] * (len(answer) - len(dists))
    return dists, dict((out.kv_transfer_params or {}).get("semkv", {}))
