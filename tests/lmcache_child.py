"""One vLLM process of the LMCache tests (``python -m tests.lmcache_child ROLE URL IN OUT``).

Each engine runs in its own process so that the donor store really is shared across processes
(and each process's first forward pass is a fresh one). Prompts come in and greedy token ids,
semkv summaries and counters go out through JSON files; nothing is printed.

Roles:
- ``donor``: computes the prompt once (LMCache stores its chunks; semkv registers the donor).
- ``reuse``: runs the prompt (served from the shared store, exact tier), then runs it again:
  the second run is vLLM's own prefix hit, the reference for the first.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def semkv_config(url: str) -> dict[str, object]:
    return {"provider": "chunks", "semantic_mode": "materialize_exact", "min_reuse_tokens": 64,
            "donor_store": "lmcache", "lmcache_server_url": url}


def _run(llm: object, prompt: str, max_tokens: int = 16) -> dict[str, object]:
    from tests.engine_utils import greedy

    out = greedy(llm, [prompt], max_tokens=max_tokens)[0]
    return {"tokens": list(out.outputs[0].token_ids),
            "semkv": (out.kv_transfer_params or {}).get("semkv")}


def main(role: str, url: str, prompt_file: str, out_file: str) -> None:
    from tests.engine_utils import engine, semkv_metrics

    prompt = Path(prompt_file).read_text()
    result: dict[str, object] = {"role": role}
    started = time.perf_counter()
    with engine(semkv_config(url)) as llm:
        result["start_seconds"] = time.perf_counter() - started
        if role == "donor":
            result["donor"] = _run(llm, prompt, max_tokens=1)
            time.sleep(1.0)  # LMCache stores after the forward; let the store land
        else:
            result["shared"] = _run(llm, prompt)
            result["local"] = _run(llm, prompt)
        result["metrics"] = semkv_metrics(llm)
    Path(out_file).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:5])
