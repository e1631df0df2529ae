"""Real vLLM CPU engines for the tests, on the bundled SmolLM2 model.

Modules take an engine from the session's ``EnginePool`` (the ``engines`` fixture,
tests/conftest.py): one engine per configuration, shared by every module that asks for the
same one (an engine start costs ~30 s), reset (vLLM's prefix cache and the connector: donors,
provider, store) each time it is handed out. ``engine()`` builds a private one, for a test about
start-up or one that needs a configuration of its own for a moment.

NOTE: engines run with ``enforce_eager=True`` (no torch.compile warm-up: ~1 minute to start
instead of ~4 on a fresh machine) and ``block_size=32``; every comparison in a module is made
on the same engine, so these settings never mix into a result.
NOTE: counters (``semkv_metrics``) of a shared engine carry earlier modules' requests: a test
reads deltas, never absolute values.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

CONNECTOR = {
    "kv_connector": "SemanticKVConnector",
    "kv_connector_module_path": "semkv_vllm.connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
BLOCK = 32
RESIDENT_SEQS = 3
COMMIT_POLICY = "semkv_vllm.commit_policy.CommitPolicyScheduler"
# Realized spans' mechanics (tests/test_engine_realization.py, _lifecycle.py,
# _long_realization.py share this in-process engine): every plan class served and unpriced,
# every hit a realization (the exact tier's smallest span is above any prompt), copies kept
# as they are unless a request's options choose a recompute strategy, a realization's working
# set bounded at 512 MiB, prompts up to 8K tokens with two such requests resident.
MECHANICS = {"provider": "minhash", "semantic_mode": "materialize_semantic",
             "semantic_tiers": ["verified"], "realize_spans": True,
             "gate_policy": "ungated", "realize_min_gain": 0.0,
             "min_reuse_tokens": 100_000, "verified_min_reuse_tokens": 64,
             "lookup_timeout_ms": 10_000, "provider_config": {"threshold": 0.1},
             "request_options": True, "recompute_strategy": "none",
             "realize_memory_bytes": 512 << 20}
MECHANICS_MAX_MODEL_LEN = 8192
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

    POOL.release_in_process()  # vLLM's connector agent is process-global: one such engine
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


def _build_llm(extra_config: dict[str, Any] | None, overrides: dict[str, Any]) -> Any:
    from vllm import LLM

    from semkv.bundled_model import ensure_model
    from semkv.kv_sizing import bundled_kv_cache_bytes

    args: dict[str, Any] = dict(
        model=str(ensure_model()), dtype="float32", max_model_len=4096, block_size=BLOCK,
        enable_prefix_caching=True, enforce_eager=True, max_num_batched_tokens=1024,
        disable_log_stats=False, seed=0,
    )
    if extra_config is not None:
        args["kv_transfer_config"] = dict(CONNECTOR, kv_connector_extra_config=extra_config)
    args.update(overrides)
    # NOTE: sized from the run, never a host fraction; three full-length requests resident
    # keeps the tests' earlier prompts in vLLM's prefix cache where a test expects a local hit.
    args.setdefault("kv_cache_memory_bytes", bundled_kv_cache_bytes(
        max_model_len=args["max_model_len"], max_num_seqs=RESIDENT_SEQS,
        block_size=args["block_size"]))
    return LLM(**args)


def _shutdown(llm: Any) -> None:
    core = getattr(llm.llm_engine, "engine_core", None)
    with contextlib.suppress(Exception):
        core.shutdown()  # type: ignore[union-attr]


def _start(extra_config: dict[str, Any] | None, in_process: bool,
           overrides: dict[str, Any]) -> tuple[Any, int]:
    """(the engine, torch's thread count before it). ``in_process``: built with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which vLLM reads only while it builds an engine, so
    the variable is restored right after (a later engine starts as its caller asks)."""
    import torch
    import vllm.envs

    threads = torch.get_num_threads()
    before = os.environ.get(IN_PROCESS)
    if in_process:
        POOL.release_in_process()  # vLLM's connector agent is process-global: one such engine
        os.environ[IN_PROCESS] = "0"
    try:
        with _scan_safe():
            return _build_llm(extra_config, overrides), threads
    finally:
        if in_process:
            if before is None:
                os.environ.pop(IN_PROCESS, None)
            else:
                os.environ[IN_PROCESS] = before
            vllm.envs.disable_envs_cache()


def _stop(llm: Any, in_process: bool, threads: int) -> None:
    import torch

    _shutdown(llm)
    del llm
    gc.collect()
    if in_process:
        torch.set_num_threads(threads)
        with contextlib.suppress(Exception):
            from vllm.distributed.kv_transfer import kv_transfer_state

            kv_transfer_state.ensure_kv_transfer_shutdown()


@contextlib.contextmanager
def engine(extra_config: dict[str, Any] | None, *, in_process: bool = False,
           **overrides: Any) -> Iterator[Any]:
    """A private engine for the block (``EnginePool`` shares one across modules).

    ``in_process``: the engine core runs in this process: it starts in ~3 s instead of ~18 s
    (no engine-core process to spawn and import vLLM into). Engines of tests about processes
    (replicas, tensor-parallel ranks, a server) stay in their own.
    """
    llm, threads = _start(extra_config, in_process, overrides)
    try:
        yield llm
    finally:
        _stop(llm, in_process, threads)


class EnginePool:
    """Engines shared across test modules: one per configuration, at most ``keep`` alive.

    ``get`` hands out the engine built for the same arguments (building it if needed, after
    shutting down the least recently used one past ``keep``), with vLLM's prefix cache and the
    connector reset, so a module starts from an empty engine whichever module used it before.

    NOTE: at most one in-process engine lives at a time (vLLM keeps the KV connector agent
    in a process global): a private in-process engine shuts the pool's down before it starts.
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._live: OrderedDict[str, tuple[Any, bool, int]] = OrderedDict()

    def get(self, extra_config: dict[str, Any] | None, *, in_process: bool = False,
            **overrides: Any) -> Any:
        key = json.dumps([extra_config, in_process, overrides], sort_keys=True, default=str)
        if key in self._live:
            self._live.move_to_end(key)
            llm = self._live[key][0]
            assert llm.reset_prefix_cache(reset_connector=True), "a shared engine was busy"
            return llm
        if in_process:
            self.release_in_process()
        while len(self._live) >= self.keep:
            self._close(next(iter(self._live)))
        llm, threads = _start(extra_config, in_process, overrides)
        self._live[key] = (llm, in_process, threads)
        return llm

    def release_in_process(self) -> None:
        for key in [k for k, (_, inproc, _) in self._live.items() if inproc]:
            self._close(key)

    def close(self) -> None:
        while self._live:
            self._close(next(iter(self._live)))

    def _close(self, key: str) -> None:
        _stop(*self._live.pop(key))

POOL = EnginePool()


def mechanics_engine(pool: EnginePool) -> Any:
    """The shared in-process engine of ``MECHANICS``."""
    from semkv.kv_sizing import bundled_kv_cache_bytes

    return pool.get(MECHANICS, in_process=True, scheduler_cls=COMMIT_POLICY,
                    max_model_len=MECHANICS_MAX_MODEL_LEN, max_num_batched_tokens=1024,
                    kv_cache_memory_bytes=bundled_kv_cache_bytes(
                        max_model_len=MECHANICS_MAX_MODEL_LEN, max_num_seqs=2,
                        block_size=BLOCK))


def greedy(llm: Any, prompts: list[str], max_tokens: int = 16) -> list[Any]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompts, sp, use_tqdm=False)


def one_by_one(llm: Any, prompts: list[str], max_tokens: int = 16) -> list[Any]:
    """Each prompt alone, so every run of a prompt sees the same batch shape."""
    return [greedy(llm, [p], max_tokens)[0] for p in prompts]


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
