"""One vLLM process for the fetch test (``python -m tests.lmcache_fetch_child URL OUT``).

Serves a donor (LMCache stores its chunks), then fetches the donor's chunks from the server into
a host store of vLLM's page shape through ``semkv_vllm.lmcache_fetch`` (the scheduler's lookup,
a second LMCache worker connector's retrieve) and compares them with the blocks vLLM's own
prefix cache holds for the same tokens. Counts and flags go out as JSON.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

SLOTS = 24


def main(url: str, out_file: str) -> None:
    import torch
    from semkv_vllm.block_copy import allocate_store
    from semkv_vllm.engine_setup import namespace_from_vllm_config
    from semkv_vllm.lmcache_fetch import FetchLookups, HostFetcher
    from semkv_vllm.metadata import FetchOp

    from tests.engine_utils import engine, essay_prompts
    from tests.lmcache_child import _run, semkv_config

    result: dict[str, object] = {}
    with engine(semkv_config(url)) as llm:
        tok = llm.get_tokenizer()
        prompt = tok.decode(list(tok(essay_prompts(1, chars=4000)[0])["input_ids"])[:640])
        ids = list(tok(prompt)["input_ids"])
        _run(llm, prompt, max_tokens=1)
        time.sleep(1.5)  # LMCache stores after the forward
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        from vllm.v1.request import Request

        worker = get_kv_transfer_group()
        core = llm.llm_engine.engine_core.engine_core
        kv = worker._shared.worker_adapter.kv_caches
        store = {name: allocate_store(t, SLOTS) for name, t in kv.items()}
        fetcher = HostFetcher(worker._vllm_config, worker.config, worker._kv_cache_config,
                              namespace_from_vllm_config(worker._vllm_config).digest)
        fetcher.register(store)
        lookups = FetchLookups(core.scheduler.connector._shared.scheduler_adapter)
        bs = fetcher.block_size
        end = len(ids) - len(ids) % bs
        slots = list(range(SLOTS - end // bs, SLOTS))  # not slot 0: ids are not positions
        fetch = FetchOp("semkv-fetch-0", ids[:end], end, slots, [1] * len(slots))
        lookups.start([fetch])
        ready = None
        for _ in range(400):
            ready = lookups.ready([fetch])
            if ready is not None:
                break
            time.sleep(0.05)
        result["ready"], result["tokens"] = ready, len(ids)
        fetcher.submit(fetch)
        done: list[str] = []
        errors: set[int] = set()
        for _ in range(400):
            finished, errors = fetcher.poll(wait=True)
            done += [f.fetch_id for f in finished]
            if done:
                break
        lookups.end([fetch], retrieved=True)
        blocks = len(slots)
        result["finished"], result["error_slots"] = sorted(done), sorted(errors)
        probe = Request("semkv-fetch-probe", ids, SamplingParams(max_tokens=1), None,
                        block_hasher=core.request_block_hasher)
        computed, local, *_ = core.scheduler.kv_cache_manager.get_computed_blocks(probe)
        engine_blocks = computed.get_block_ids()[0][:blocks]
        result["compared_blocks"] = len(engine_blocks)
        result["identical"] = bool(engine_blocks) and all(
            torch.equal(store[n][torch.tensor(slots[: len(engine_blocks)])],
                        kv[n][torch.tensor(engine_blocks)]) for n in kv)
    Path(out_file).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
