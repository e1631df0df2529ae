"""Real vLLM CPU engines for the tests, on the bundled SmolLM2 model, or with
``model=str(tiny_model_dir())`` (tests/tiny_engine_model.py) on a tiny random-weight Llama for
tests of mechanisms.

``engine(extra_config, in_process=True)`` builds one whose engine core runs in this process:
it starts in ~3 s, against ~18 s for an engine core in a process of its own (spawned, vLLM
imported into it). Engines of tests about processes (replicas, tensor-parallel ranks, a server,
the engine core's own log) keep their own process.

NOTE: engines run with ``enforce_eager=True`` (no torch.compile warm-up: ~1 minute to start
instead of ~4 on a fresh machine) and ``block_size=32``; every comparison in a module is made
on the same engine, so these settings never mix into a result.
NOTE: an engine starting in this process unregisters every ``vllm:`` Prometheus collector of
the process (vLLM's stat logger does, ``unregister_vllm_metrics``): the counters of an engine
that stays alive meanwhile vanish from its ``get_metrics()``. One engine at a time, then; an
engine shared across modules would need them to run one after another with no other engine
between (tried and reverted on 2026-12-06, docs/notes.md).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CONNECTOR = {
    "kv_connector": "SemanticKVConnector",
    "kv_connector_module_path": "semkv_vllm.connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
BLOCK = 32
# The model of a child process's engines (tests/lmcache_*child.py), set by its parent test:
# the tiny model's folder (tests/tiny_engine_model.py) where the test is about mechanisms.
MODEL_ENV = "TESTS_ENGINE_MODEL"  # not SEMKV_*: semkv refuses unknown SEMKV_ variables
RESIDENT_SEQS = 3
IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"
# Packages whose module objects break vLLM's start-up scan of sys.modules (its kernel dispatcher
# reads vars() of every module attribute; llvmlite's ffi wrappers return no dict). lmcache
# imports them into this process (MultiConnector's stats classes, tests/test_engine_lmcache.py).
SCAN_BREAKERS = ("llvmlite", "numba")


@contextlib.contextmanager
def in_process() -> Iterator[None]:
    """Engines built inside this block run in this process (tests that look inside them).

    NOTE: the environment, vLLM's cached environment reads and torch's thread count are restored
    afterwards, even when the engine fails to start, so later engines start multiprocess again.
    NOTE: an engine that fails after its worker built the KV connector (a start-up ConfigError
    raised by the scheduler-side connector) leaves vLLM's process-global connector agent set;
    a later in-process engine without a connector would then assert on missing connector
    metadata. It is shut down here.
    """
    import torch
    import vllm.envs

    before, threads = os.environ.get(IN_PROCESS), torch.get_num_threads()
    os.environ[IN_PROCESS] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(IN_PROCESS, None)
        else:
            os.environ[IN_PROCESS] = before
        vllm.envs.disable_envs_cache()
        torch.set_num_threads(threads)
        with contextlib.suppress(Exception):
            from vllm.distributed.kv_transfer import kv_transfer_state

            kv_transfer_state.ensure_kv_transfer_shutdown()


@contextlib.contextmanager
def _scan_safe() -> Iterator[None]:
    """Hide ``SCAN_BREAKERS`` from sys.modules while an in-process engine starts."""
    if os.environ.get(IN_PROCESS) != "0":
        yield  # the engine core starts in a fresh process: nothing to hide
        return
    hidden = {n: m for n, m in sys.modules.items() if n.split(".")[0] in SCAN_BREAKERS}
    for name in hidden:
        del sys.modules[name]
    try:
        yield
    finally:
        sys.modules.update(hidden)


_in_process = in_process  # ``engine``'s keyword of the same name hides it there


@contextlib.contextmanager
def engine(extra_config: dict[str, Any] | None, *, in_process: bool = False,
           **overrides: Any) -> Iterator[Any]:
    """An engine for the block; ``in_process``: inside ``in_process()`` (its engine core runs
    in this process: ~3 s to start instead of ~18 s)."""
    with contextlib.ExitStack() as stack:
        if in_process:
            stack.enter_context(_in_process())
        yield stack.enter_context(_engine(extra_config, **overrides))


@contextlib.contextmanager
def _engine(extra_config: dict[str, Any] | None, **overrides: Any) -> Iterator[Any]:
    from vllm import LLM

    from semkv.bundled_model import ensure_model
    from semkv.kv_sizing import kv_cache_bytes

    args: dict[str, Any] = dict(
        model=os.environ.get(MODEL_ENV) or str(ensure_model()), dtype="float32",
        max_model_len=4096, block_size=BLOCK,
        enable_prefix_caching=True, enforce_eager=True, max_num_batched_tokens=1024,
        disable_log_stats=False, seed=0,
    )
    if extra_config is not None:
        # The tests read each request's summary from its output: they are their own operator
        # (a config that names summary_to_client keeps its own value).
        extra_config = {"summary_to_client": True, **extra_config}
        args["kv_transfer_config"] = dict(CONNECTOR, kv_connector_extra_config=extra_config)
    args.update(overrides)
    # NOTE: sized from the run, never a host fraction; three full-length requests resident
    # keeps the tests' earlier prompts in vLLM's prefix cache where a test expects a local hit.
    args.setdefault("kv_cache_memory_bytes", kv_cache_bytes(
        args["model"], max_model_len=args["max_model_len"], max_num_seqs=RESIDENT_SEQS,
        block_size=args["block_size"]))
    with _scan_safe():
        llm = LLM(**args)
    try:
        yield llm
    finally:
        core = getattr(llm.llm_engine, "engine_core", None)
        with contextlib.suppress(Exception):
            core.shutdown()  # type: ignore[union-attr]
        del llm
        gc.collect()


def settle(llm: Any, *, seconds: float = 60.0) -> Any:
    """Step an engine core in this process until no finished request still holds blocks (a
    request whose KV a connector still saves keeps them until a later step sees the save
    done); returns that core, or None for an engine core in its own process (it steps by
    itself)."""
    import time

    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # in-process only
    deadline = time.monotonic() + seconds
    while core is not None and core.scheduler.has_finished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError("finished requests still hold KV blocks")
        core.step()
        time.sleep(0.01)
    return core


def settled_reset(llm: Any, *, reset_connector: bool = False, seconds: float = 60.0) -> None:
    """vLLM's prefix-cache reset, once no finished request still holds blocks.

    NOTE: a finished request whose KV a connector still saves (LMCache's and semkv's delayed
    frees) keeps its blocks until a later engine step sees the save done; vLLM's reset refuses
    while any block is held. An engine core in its own process steps by itself: its reset is
    asked again until it is accepted. One in this process steps only when asked, so it is
    stepped here until nothing waits, and then its reset must be accepted at once.
    """
    import time

    core = settle(llm, seconds=seconds)
    deadline = time.monotonic() + seconds
    while not llm.reset_prefix_cache(reset_connector=reset_connector):
        if core is not None or time.monotonic() > deadline:
            raise RuntimeError("vLLM refused to reset its prefix cache")
        time.sleep(0.1)


def greedy(llm: Any, prompts: list[str], max_tokens: int = 16) -> list[Any]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompts, sp, use_tqdm=False)


def one_by_one(llm: Any, prompts: list[str], max_tokens: int = 16) -> list[Any]:
    """Each prompt alone, so every run of a prompt sees the same batch shape."""
    return [greedy(llm, [p], max_tokens)[0] for p in prompts]


def generate_ids(llm: Any, ids: list[int] | str, max_tokens: int = 16,
                 params: dict[str, Any] | None = None, cache_salt: str | None = None,
                 logprobs: int | None = None) -> Any:
    """One greedy request of token ids (or of a text prompt); ``params``: its
    ``kv_transfer_params``; ``cache_salt``: its tenant's salt (vLLM's own, which semkv's
    namespace includes); ``logprobs``: vLLM's, per generated token."""
    from vllm import SamplingParams

    extra = None if params is None else {"kv_transfer_params": params}
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                        extra_args=extra, logprobs=logprobs)
    prompt: dict[str, Any] = ({"prompt": ids} if isinstance(ids, str)
                              else {"prompt_token_ids": ids})
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return llm.generate([prompt], sp, use_tqdm=False)[0]


def semkv_summary(out: Any) -> dict[str, Any]:
    """The request's reuse summary (``kv_transfer_params["semkv"]``)."""
    return dict((out.kv_transfer_params or {}).get("semkv", {}))


def output_tokens(out: Any) -> list[int]:
    return list(out.outputs[0].token_ids)


def token_logprobs(out: Any) -> list[float]:
    """The log-probability of each generated token (requested with ``logprobs``)."""
    c = out.outputs[0]
    return [lp[token].logprob for token, lp in zip(c.token_ids, c.logprobs, strict=True)]


def worker_side() -> Any:
    """The in-process engine's worker connector (its KV caches and donor store)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker


def scheduler_side(llm: Any) -> Any:
    """The connector's scheduler side of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler


def semkv_metrics(llm: Any) -> dict[str, float]:
    """The engine's ``vllm:semkv_*`` counters, summed over label values (tier, reason...)."""
    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:semkv_") and hasattr(metric, "value"):
            label = next((v for k, v in metric.labels.items()
                          if k not in ("model_name", "engine")), None)
            name = metric.name if label is None else f"{metric.name}:{label}"
            totals[name] = totals.get(name, 0.0) + float(metric.value)
    return totals


def semkv_metrics_by_label(llm: Any) -> dict[str, float]:
    """``vllm:semkv_*`` counters by name and by each label value (``name:key=value``), so
    ``vllm:semkv_realize_refused{reason="kv_groups"}`` reads as ``...:reason=kv_groups``."""
    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:semkv_") and hasattr(metric, "value"):
            labels = [f"{k}={v}" for k, v in sorted(metric.labels.items())
                      if k not in ("model_name", "engine")]
            for name in (metric.name, *(f"{metric.name}:{label}" for label in labels)):
                totals[name] = totals.get(name, 0.0) + float(metric.value)
    return totals


def token_texts(llm: Any, seed: int, *sizes: int) -> list[list[int]]:
    """One token list per size, of bundled essays (read at run time) joined and cut to that many
    tokens, no special tokens; the lists' seeds are 10 apart."""
    tok = llm.get_tokenizer()
    out = []
    for i, size in enumerate(sizes):
        text = "\n\n".join(essay_prompts(1 + size // 300, chars=2400, seed=seed + 10 * i))
        out.append(tok(text, add_special_tokens=False)["input_ids"][:size])
    return out


def linked_copy(src: Path, dst: Path) -> Path:
    """A model folder's copy, its files hard-linked where the file system allows (else copied):
    a test changing a file replaces it (``flip_weights``), never writes into a shared inode."""
    import shutil

    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=link)
    return dst


def flip_weights(weights: Path) -> None:
    """New weights of the same shapes in the old file's place, as a rollout writes them: every
    tensor moves (one bit every 4 KiB past the safetensors header), the header stays."""
    data = bytearray(weights.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    for i in range(start, len(data), 4096):
        data[i] ^= 0x01
    weights.unlink()
    weights.write_bytes(bytes(data))


def essay_prompts(count: int, *, chars: int = 2400, seed: int = 0) -> list[str]:
    """Distinct long documents read at run time from the bundled essays (never committed)."""
    import random

    from semkv.assets import essays_dir

    texts = [p.read_text(errors="ignore") for p in sorted(essays_dir().glob("*.txt"))]
    rng = random.Random(seed)
    out = []
    for i in range(count):
        text = texts[i % len(texts)]
        start = rng.randrange(0, max(1, len(text) - chars))
        out.append(text[start : start + chars])
    return out


def runner_prefill_logprob_error(llm: Any, ids: list[int], *,
                                 without: str | None = None) -> tuple[float, bool]:
    """The layer runner for the engine's own model (``semkv_vllm.models.runner_for``, in this
    process) prefills ``ids``; against the engine's own next-token top-5 log-probabilities:
    (largest absolute difference, same greedy token). ``without="windows"`` (or
    ``"soft_caps"``) runs it with that per-layer setting dropped in every layer (the check that
    a test of it can fail)."""
    import torch
    from semkv_vllm.engine_setup import forward_context
    from semkv_vllm.models import runner_for
    from vllm import SamplingParams

    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(max_tokens=1, logprobs=5, temperature=0.0),
                       use_tqdm=False)[0].outputs[0]
    runner = runner_for(llm.apply_model(lambda model: model)[0],
                        forward_context(llm.llm_engine.vllm_config))
    if without is not None:
        assert any(getattr(runner, without)), f"no layer has {without}"
        setattr(runner, without, [None] * runner.num_layers)
    _, logits = runner.full_prefill(ids, all_logits=False)
    mine = torch.log_softmax(logits[-1], dim=-1)
    error = max(abs(float(mine[token]) - lp.logprob) for token, lp in out.logprobs[0].items())
    return error, int(logits[-1].argmax()) == out.token_ids[0]
