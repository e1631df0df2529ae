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
                max_num_seqs: int = 4) -> list[str]:
    """The README's server flags on the bundled model; with the connector when configured."""
    from semkv.bundled_model import ensure_model
    from semkv.kv_sizing import bundled_kv_cache_bytes

    args = ["--model", str(ensure_model()), "--dtype", "float32", "--enforce-eager",
            "--enable-prefix-caching", "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(max_num_seqs), "--kv-cache-memory-bytes",
            str(bundled_kv_cache_bytes(max_model_len=max_model_len, max_num_seqs=max_num_seqs))]
    if extra_config is not None:
        args += ["--scheduler-cls", "semkv_vllm.commit_policy.CommitPolicyScheduler",
                 "--kv-transfer-config",
                 json.dumps(dict(CONNECTOR, kv_connector_extra_config=extra_config))]
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        out: dict[str, Any] = json.loads(response.read())
        return out


@contextmanager
def served(args: list[str], *, log: Path, timeout_s: float = 900.0) -> Iterator[str]:
    """A running server with ``args``; yields its base URL, stops it (and its children)."""
    if "--kv-cache-memory-bytes" not in args:  # else vLLM sizes it from a fraction of the host
        raise ValueError("served(): args must give --kv-cache-memory-bytes (server_args does)")
    port = _free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args,
           "--host", "127.0.0.1", "--port", str(port)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1")
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
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def served_records(log: Path) -> list[dict[str, Any]]:
    """The connector's record of each request, in order (its ``provenance`` log lines)."""
    return [json.loads(line[line.index("{"):]) for line in log.read_text().splitlines()
            if '"event": "provenance"' in line and "{" in line]
