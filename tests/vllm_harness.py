"""A real vLLM ``Scheduler`` with the semkv connector, driven by synthetic model outputs.

No model runs. A fake forward writes, into every KV slot it computes, a value derived from the
request's tokens up to that position, so a test can check that a loaded block holds exactly
what the request's own forward would have written (the exact-tier property), block by block.
The worker side is the real ``SemanticKVConnector`` in WORKER role over small CPU tensors.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from semkv.bundled_model import ensure_model
from semkv.kv_sizing import bundled_kv_cache_bytes

BLOCK = 32
HEADS, HEAD_SIZE = 1, 64  # one slot = 32 tokens * 1 head * (64+64) * 4 B = 16 KiB: 64 per MiB
EOS = 2
_hash_ready = False


# 0.32 and 0.33 take ModelRunnerOutput's request index; 0.34 derives it from req_ids
_TAKES_INDEX = "req_id_to_index" in {f.name for f in fields(ModelRunnerOutput)}


def _index_of(req_ids: list[str]) -> dict[str, Any]:
    """``ModelRunnerOutput``'s request index where the vLLM has the field."""
    return {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}} if _TAKES_INDEX else {}


def token_value(tokens: list[int], position: int) -> float:
    """What the fake forward writes at ``position``: a function of every token up to it."""
    digest = hashlib.blake2b(repr(tokens[: position + 1]).encode(), digest_size=4).digest()
    return float(int.from_bytes(digest, "little") % (1 << 20))


def make_vllm_config(extra: dict[str, Any], *, num_batched: int = 4096,
                     policy: str = "recompute", scheduler_cls: type | None = None,
                     async_scheduling: bool = False) -> VllmConfig:
    """``async_scheduling``: vLLM's CPU platform turns async scheduling off whatever is asked
    (``CpuPlatform.check_and_update_config``); set after it, as a GPU engine has it by default,
    so that ``scheduler_cls`` resolves as vLLM resolves it there (a stand-in, named so)."""
    model = ModelConfig(model=str(ensure_model()), dtype="float32", seed=0, max_model_len=4096)
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=num_batched, max_model_len=4096,
            enable_chunked_prefill=True, is_encoder_decoder=False, scheduler_cls=scheduler_cls),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True,
                                 kv_cache_memory_bytes=bundled_kv_cache_bytes(
                                     max_model_len=4096, max_num_seqs=1, block_size=BLOCK)),
        kv_transfer_config=KVTransferConfig(
            kv_connector="SemanticKVConnector", kv_connector_module_path="semkv_vllm.connector",
            kv_role="kv_both", kv_load_failure_policy=policy,
            # the harness reads each request's summary: the tests are their own operator
            kv_connector_extra_config={"summary_to_client": True, **extra}),
        device_config=DeviceConfig("cpu"),
    )
    config.scheduler_config.async_scheduling = async_scheduling
    return config


@dataclass
class Harness:
    scheduler: Scheduler
    worker: Any
    kv: torch.Tensor
    outputs: dict[str, Any] = field(default_factory=dict)  # request id -> kv_transfer_params
    tokens: dict[str, list[int]] = field(default_factory=dict)  # request id -> its output
    finished: set[str] = field(default_factory=set)
    corrupt_next_load: bool = False

    @property
    def side(self) -> Any:
        return self.scheduler.connector._scheduler  # type: ignore[union-attr]

    def add(self, request_id: str, tokens: list[int], *, max_tokens: int = 3,
            cache_salt: str | None = None,
            kv_transfer_params: dict[str, Any] | None = None, **sampling: Any) -> Request:
        """``sampling``: more ``SamplingParams`` fields (e.g. ``prompt_logprobs``)."""
        extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra, **sampling)
        sp.update_from_generation_config({}, EOS)
        req = Request(request_id=request_id, prompt_token_ids=list(tokens), sampling_params=sp,
                      pooling_params=None, cache_salt=cache_salt,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
        self.scheduler.add_request(req)
        return req

    def step(self) -> Any:
        out = self.scheduler.schedule()
        self._apply(out, self._forward(out))
        return out

    def _forward(self, out: Any) -> ModelRunnerOutput:
        """The worker's part of one step: the connector's hooks around a fake forward that
        writes each scheduled position's value into its slot; one token sampled per request
        whose prompt is complete."""
        meta = out.kv_connector_metadata
        self.worker.handle_preemptions(meta)  # vLLM's order: first, before any KV is touched
        self.worker.bind_connector_metadata(meta)
        if self.corrupt_next_load and meta.loads:
            for op in meta.loads:  # simulate a slot overwritten behind the scheduler's back
                op.generations = [g + 1000 for g in op.generations]
            self.corrupt_next_load = False
        self.worker.start_load_kv(None)
        self.worker.wait_for_layer_load("layer.0")  # layerwise loads land here
        sampled: dict[str, list[int]] = {}
        for rid, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            start = req.num_computed_tokens - n  # schedule() already advanced it
            blocks = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
            tokens = list(req.all_token_ids)
            for pos in range(start, start + n):
                b, off = blocks[pos // BLOCK], pos % BLOCK
                self.kv[b, :, off, :] = token_value(tokens, pos)
            sampled[rid] = [] if req.is_prefill_chunk else [7]  # set by schedule()
        self.worker.wait_for_save()
        recv = self.worker.get_finished(set())[1]
        invalid = self.worker.get_block_ids_with_load_errors()
        wmeta = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        req_ids = list(sampled)
        return ModelRunnerOutput(
            req_ids=req_ids, **_index_of(req_ids),
            sampled_token_ids=[sampled[r] for r in req_ids],
            kv_connector_output=KVConnectorOutput(finished_recving=recv,
                                                  invalid_block_ids=invalid,
                                                  kv_connector_worker_meta=wmeta),
        )

    def _apply(self, out: Any, mro: ModelRunnerOutput) -> None:
        engine_outputs = self.scheduler.update_from_output(out, mro)
        for eco in engine_outputs.values():
            for o in eco.outputs:
                if o.finished:
                    self.finished.add(o.request_id)
                    self.outputs[o.request_id] = o.kv_transfer_params
                self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)

    def run_pipelined(self, max_steps: int = 400) -> None:
        """Steps as vLLM's engine core runs them under async scheduling
        (``EngineCore.step_with_batch_queue``, a queue of two): the next batch is scheduled
        (and its forward issued) before the previous batch's output is applied."""
        queue: deque[tuple[Any, ModelRunnerOutput]] = deque()
        for _ in range(max_steps):
            if not (self.scheduler.has_requests() or queue):
                return
            if self.scheduler.has_requests():
                out = self.scheduler.schedule()
                queue.appendleft((out, self._forward(out)))
                if not out.total_num_scheduled_tokens:
                    time.sleep(0.005)  # a deferred request (lookup pending): let its thread run
                if len(queue) < 2 and (out.total_num_scheduled_tokens > 0
                                       or self.scheduler.has_requests()):
                    continue
            if queue:
                self._apply(*queue.pop())
        raise AssertionError("requests did not finish")

    def run(self, max_steps: int = 200, max_seconds: float = 60.0) -> None:
        deadline = time.monotonic() + max_seconds
        steps = 0
        while self.scheduler.has_requests():
            out = self.step()
            if not out.num_scheduled_tokens:
                time.sleep(0.005)  # a deferred request (lookup pending): let its thread run
                if time.monotonic() > deadline:
                    raise AssertionError("requests did not finish in time")
                continue
            steps += 1
            if steps > max_steps:
                raise AssertionError("requests did not finish")

    def blocks_hold_own_kv(self, request_id: str, tokens: list[int], num_tokens: int) -> bool:
        """True when the request's first ``num_tokens`` KV slots hold its own forward's values."""
        blocks = self.scheduler.kv_cache_manager.get_block_ids(request_id)[0]
        return all(
            float(self.kv[blocks[p // BLOCK], 0, p % BLOCK, 0]) == token_value(tokens, p)
            for p in range(num_tokens)
        )

    def assert_no_leaks(self) -> None:
        assert self.side.leases.live_count() == 0, "lease leak"
        assert self.side.index.pinned_slots() == 0, "pinned slot leak"
        assert not self.side.requests, "request state leak"


def make_harness(extra: dict[str, Any], *, num_blocks: int = 400, num_batched: int = 4096,
                 policy: str = "recompute", scheduler_cls: type[Scheduler] = Scheduler,
                 async_scheduling: bool = False) -> Harness:
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    from semkv_vllm.connector import SemanticKVConnector

    config = make_vllm_config(extra, num_batched=num_batched, policy=policy,
                              scheduler_cls=scheduler_cls, async_scheduling=async_scheduling)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32))])
    config.cache_config.num_gpu_blocks = num_blocks
    scheduler = scheduler_cls(vllm_config=config, kv_cache_config=kv_cache_config,
                          structured_output_manager=StructuredOutputManager(config),
                          block_size=BLOCK, log_stats=True)
    worker = SemanticKVConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    kv = torch.zeros((num_blocks, HEADS, BLOCK, 2 * HEAD_SIZE), dtype=torch.float32)
    worker.register_kv_caches({"layer.0": kv})
    if worker._worker is not None and worker._semantic:
        # No attention kernel runs here: the fake forward writes the logical view token-major,
        # so that is the layout token-level loads must use (the real engine probes its kernel).
        from semkv_vllm.page_layout import PageLayout

        worker._worker.layout = PageLayout.token_major(tuple(kv.shape[1:]))
    return Harness(scheduler, worker, kv)


def timed_steps(h: Harness) -> list[float]:
    """The wall time of each of ``h``'s steps from now on (its ``step`` wrapped)."""
    steps: list[float] = []
    step = h.step

    def timed() -> Any:
        began = time.monotonic()
        try:
            return step()
        finally:
            steps.append(time.monotonic() - began)

    h.step = timed  # type: ignore[method-assign]
    return steps
