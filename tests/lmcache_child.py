"""One vLLM process of the LMCache tests
(``python -m tests.lmcache_child ROLE URL IN OUT [REDIS_URL]``).

Each engine runs in its own process so that the donor store really is shared across processes
(and each process's first forward pass is a fresh one). Prompts come in and greedy token ids,
semkv summaries and counters go out through JSON files; nothing is printed.

Roles:
- ``donor``: computes the prompt once (LMCache stores its chunks; semkv registers the donor).
- ``reuse``: runs the prompt (served from the shared store, exact tier), then runs it again:
  the second run is vLLM's own prefix hit, the reference for the first. Without a discovery
  server it then empties vLLM's cache and runs a longer prompt that starts with the stored one
  (LMCache's own prefix lookup serves its chunks), then that again (vLLM's own hit).

- ``swapped``: runs the prompt, then again from nothing (semkv's lookup off, vLLM's cache
  emptied: cold); started on weights swapped under the donor's path.

Each process also reports its semkv namespace's digest.

With ``REDIS_URL`` both roles also share discovery through that server (instance id = role);
``reuse`` runs the longer prompt as above, then once more from nothing (semkv's lookup off,
vLLM's cache emptied: cold), and pauses: it writes ``OUT.ready`` and waits for
``OUT.go`` (the test kills the server in between), then serves the prompt again, and the
counters it reports cover the outage.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

LONGER = ("\n\nNow a second question, with more context: the reader has read the essay twice "
          "and disagrees with its conclusion. What would the author answer to that reader, "
          "and which passage of the essay supports the answer best?\nAnswer:")


def semkv_config(url: str, redis_url: str | None = None, role: str = "") -> dict[str, object]:
    config: dict[str, object] = {
        "provider": "chunks", "semantic_mode": "materialize_exact", "min_reuse_tokens": 64,
        "donor_store": "lmcache", "lmcache_server_url": url}
    if redis_url:
        config["lookup_timeout_ms"] = 2000
        from tests.redis_utils import store_auth

        config["provider_config"] = {"discovery_store": redis_url, "instance_id": role,
                                     "store_timeout_ms": 300.0,
                                     "store_write_timeout_ms": 300.0, **store_auth()}
    return config


def _wait_for(path: Path, seconds: float = 300.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} never appeared")
        time.sleep(0.1)


def _run(llm: object, prompt: str, max_tokens: int = 16,
         params: dict[str, object] | None = None) -> dict[str, object]:
    """One greedy request; ``params``: its ``kv_transfer_params`` (semkv's request options)."""
    from tests.engine_utils import generate_ids

    out = generate_ids(llm, prompt, max_tokens, params=params)
    return {"tokens": list(out.outputs[0].token_ids),
            "semkv": (out.kv_transfer_params or {}).get("semkv")}


def main(role: str, url: str, prompt_file: str, out_file: str,
         redis_url: str | None = None) -> None:
    from tests.engine_utils import engine, scheduler_side, semkv_metrics, settled_reset

    prompt = Path(prompt_file).read_text()
    result: dict[str, object] = {"role": role}
    started = time.perf_counter()
    with engine(semkv_config(url, redis_url, role)) as llm:
        result["start_seconds"] = time.perf_counter() - started
        result["namespace"] = scheduler_side(llm).namespace.digest
        if role == "swapped":
            result["shared"] = _run(llm, prompt)
            settled_reset(llm)
            result["cold"] = _run(llm, prompt, params={"semkv_options": {"lookup": False}})
        elif role == "donor":
            result["donor"] = _run(llm, prompt, max_tokens=1)
            time.sleep(1.0)  # LMCache stores after the forward; let the store land
        else:
            result["shared"] = _run(llm, prompt)
            if redis_url:
                # a longer prompt that starts with the stored one, discovery still shared
                settled_reset(llm)  # vLLM forgets: only LMCache holds the prompt's chunks
                result["longer"] = _run(llm, prompt + LONGER)
                result["longer_local"] = _run(llm, prompt + LONGER)  # vLLM's own hit
                settled_reset(llm)
                # the prompt computed from nothing: semkv's lookup (and so its load) off
                result["longer_cold"] = _run(llm, prompt + LONGER,
                                             params={"semkv_options": {"lookup": False}})
                # the test kills the discovery server now
                result["before_outage"] = semkv_metrics(llm)
                Path(out_file + ".ready").write_text("1")
                _wait_for(Path(out_file + ".go"))
                settled_reset(llm)  # vLLM forgets: the next run asks semkv again
                result["outage"] = _run(llm, prompt)
            result["local"] = _run(llm, prompt)
            if not redis_url:  # a longer prompt that starts with the stored one
                settled_reset(llm)  # vLLM forgets: only LMCache holds the prompt's chunks
                result["longer"] = _run(llm, prompt + LONGER)
                result["longer_local"] = _run(llm, prompt + LONGER)  # vLLM's own hit
        result["metrics"] = semkv_metrics(llm)
    Path(out_file).write_text(json.dumps(result))


if __name__ == "__main__":
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # this process is the replica
    main(*sys.argv[1:6])
