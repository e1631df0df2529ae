"""The cost gate's start-up measurement of the worker's realization (``calibrate(realizer)``).

When the worker is handed its realizer (``register_kv_caches``, before any request), it runs
``CALIBRATION``'s synthetic spans to their end through the very code a realization runs
(``SpanRealizer.run_now``: its ``_steps`` and ``write``) and times them: (span tokens, tokens
copied from its start), the rest gaps. Copies read the first donor-store slots, zeroed first,
one block into their donor, so keys are re-rotated as a shifted copy's are; gaps are token 0;
the result is written into the engine's last blocks (at start-up every block is free), which
are zeroed again at the end. The samples go to the scheduler with the worker's first report
(``cost_gate.py`` says why a measurement and not a constant).

NOTE: the donor store is allocated uninitialized (``block_copy.allocate_store``): its bytes
are whatever the process's memory held, NaN patterns included. Read as they were, they put
NaN into the engine's last blocks, and vLLM 0.32's CPU attention lets a NaN value in a slot
past a sequence's end reach the output (softmax weight 0 times NaN): every later request whose
last, partly filled block was one of them answered token id 0 until its slots were rewritten
(docs/notes.md, the sixteenth session). Hence the zeroed slots, and no calibration value is
left in the engine's blocks.

The spans tell the rates apart: copies against computation, attention from a causal prefix up
to a 2K context (a gap-heavy span's layer calls attend ~1K positions over its whole context; on
the bundled model their cost per query-key pair at 2-3K was several times a short context's).
The spans run in ``CALIBRATION_REPEATS`` rounds, after an untimed warm-up span, and each span's
fastest run counts (a busy machine only slows a run down). No span starts once
``CALIBRATION_BUDGET_S`` is spent: a large model on a CPU, or a loaded machine, times every span
once or the first ones only, and learns the rest from real realizations (on this 2-core machine
with three other processes running, the first round's first span alone took 10 s). None reaches
past the engine's rotary table, and spans that the donor store, the engine's blocks or
``realize_memory_bytes`` cannot hold are skipped. Any failure ends the
calibration (logged). The bundled model on 2 CPU cores: 1,088 tokens computed per round.

NOTE: no calibration under tensor parallelism: realized spans are refused there, and each rank's
time budget would end its calibration at another span than the others', leaving the layers'
all-reduces unpaired (a hang).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from semkv.cost import RealizeWork
from semkv.log import get_logger
from semkv_vllm.metadata import CopySource, RealizeOp

if TYPE_CHECKING:
    from semkv_vllm.realization import SpanRealizer

log = get_logger("semkv.vllm.realization")
CALIBRATION = ((256, 0), (512, 448), (1024, 768), (2048, 1536))
CALIBRATION_REPEATS = 2
CALIBRATION_WARMUP = 64
CALIBRATION_BUDGET_S = 10.0


def calibrate(realizer: SpanRealizer) -> list[tuple[RealizeWork, float]]:
    """(work, fastest seconds) per calibration span run (module docstring)."""
    from semkv_vllm.cost_gate import op_work

    if realizer.reduce is not None:  # tensor parallel (module docstring)
        log.info("realization_calibration_skipped", why="tensor_parallel_size > 1")
        return []
    bs = realizer.layout.block_size
    slots = min((int(t.shape[0]) for t in realizer.store.values()), default=0)
    blocks = min((int(t.shape[0]) for t in realizer.kv_caches.values()), default=0)
    positions = _rotary_positions(realizer.runner)
    fastest: dict[tuple[int, int], tuple[RealizeOp, float]] = {}
    written: set[int] = set()  # the engine blocks the spans were written into
    started = time.perf_counter()
    try:
        _zero(realizer.store.values(), range(min(slots, _slots_read(bs))))
        _run(realizer, CALIBRATION_WARMUP, 0, slots, blocks, written)
        for _ in range(CALIBRATION_REPEATS):
            for shape in CALIBRATION:
                if time.perf_counter() - started > CALIBRATION_BUDGET_S:
                    break
                timed = (_run(realizer, *shape, slots, blocks, written)
                         if shape[0] <= positions else None)
                if timed is not None and (shape not in fastest or timed[1] < fastest[shape][1]):
                    fastest[shape] = timed
    except Exception as exc:  # noqa: BLE001 - the gate then learns from real realizations
        log.warning("realization_calibration_failed", error_type=type(exc).__name__)
    finally:
        _zero([realizer.kv_caches[name] for name in realizer.layer_names], sorted(written))
    out = [(op_work(op, (), layers=realizer.runner.num_layers, block_size=bs), seconds)
           for op, seconds in fastest.values()]
    log.info("realization_calibrated", spans=len(out),
             seconds=round(time.perf_counter() - started, 3))
    return out


def _slots_read(block_size: int) -> int:
    """How many donor-store slots the calibration's longest copy reads."""
    return max((_copy_blocks(copied, block_size) for _, copied in CALIBRATION), default=0)


def _copy_blocks(copied: int, block_size: int) -> int:
    """The donor-store slots a copy of ``copied`` tokens reads."""
    return -(-(copied + block_size) // block_size) if copied else 0  # a block into its donor


def _zero(tensors: Iterable[torch.Tensor], pages: Sequence[int]) -> None:
    """Zero these pages (first dimension) of every tensor."""
    if not pages:
        return
    for t in tensors:
        t.index_fill_(0, torch.as_tensor(list(pages), dtype=torch.long, device=t.device), 0)


def _run(realizer: SpanRealizer, span: int, copied: int, slots: int, blocks: int,
         written: set[int]) -> tuple[RealizeOp, float] | None:
    """One synthetic span realized and written (its blocks added to ``written``), timed; None
    when it cannot be held."""
    bs = realizer.layout.block_size
    span = -(-span // bs) * bs
    read = _copy_blocks(copied, bs)
    if read > slots or span // bs >= blocks:
        return None
    copies = [CopySource(0, copied, bs, 0, list(range(read)), [0] * read)] if copied else []
    gaps = list(range(copied, span))
    op = RealizeOp("semkv-calibration", 0, span, [], list(range(blocks - span // bs, blocks)),
                   copies, gaps, gaps, [0] * len(gaps), prompt_tokens=span + 1)
    clock = realizer.clock
    start = clock.mark()
    written.update(op.block_ids)
    if not realizer.run_now(op):
        return None
    stop = clock.mark()
    clock.synchronize()
    seconds = clock.seconds([(start, stop)])
    return (op, seconds) if seconds is not None else None


def _rotary_positions(runner: Any) -> int:
    """Positions the engine's rotary table holds (1,024 when it cannot be read)."""
    try:
        rotary = runner.model.model.layers[0].self_attn.rotary_emb
        return int(rotary.cos_sin_cache.shape[0])
    except Exception:  # noqa: BLE001 - another model family: the short spans only
        return 1024
