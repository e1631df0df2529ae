"""The cost gate's engine side (issue #24, item 2): a realized plan's predicted TTFT gain.

``EngineCost`` (built in the scheduler process, ``SpanAdmission.cost``) prices a plan with
``semkv.cost``: the worker's realization of the span plus vLLM's prefill of the tail after it,
against the request's fallback, in chunks of ``max_num_batched_tokens``: vLLM's prefill of
everything after the local prefix, or, where the request has a stored exact prefix that would
be served instead (``exact_end``), of everything after that prefix. A plan that copies more
tokens than the exact prefix but would answer later than it is refused, and the exact prefix
served. The gain is the point prediction discounted by the fits'
own measured errors (``semkv.cost.Prediction.gain``); a plan predicted under
``realize_min_gain`` falls back ``low_predicted_gain`` (``span_admission.py`` counts it), and a
served one carries that figure as ``predicted_gain``. The rates are the engine's own:

- vLLM's forward, every step that prefills: the scheduler attaches the step's work to the
  step's metadata (``step_work``: tokens and attention pairs, from ``num_scheduled_tokens``
  and each request's computed tokens; steps where decode tokens are the majority are left
  out, they would teach the prefill fit the decode rate); the workers time the forward
  (``step_timing.py``) and report ``(work, seconds)`` back (``SemkvWorkerMetadata.forwards``).
- the worker's realization, every realization that ends well: its work (``op_work``: what the
  op moved and computed, the positions the strategy really recomputed) and its busy seconds,
  the block write included (``SemkvWorkerMetadata.realizations``).
- at start-up, before any realization: the worker times its realization runner on a few
  synthetic spans when the engine registers its KV caches (``realize_calibration.py``: 1,088
  tokens computed per round, two rounds within 10 s), reported with its first step. Chosen
  over a fixed conservative guess because no constant holds across machines, or across the
  shapes of one machine: on the bundled model the runner computes a token of a causal prefix
  about as fast as vLLM (2.65 s against 3.15 s for 1,800 tokens, VLLM_FACTS.md), a gap-heavy
  span's tokens (attending over a mask) slower, and a GPU's CUDA graphs need not match either.

A plan is priced the way the worker will run it (``plan_work``): the same rows read and
written, the gaps and the copied tokens its strategy selects; blend's selection is not known
before the probe layers ran, so its recomputed tokens are taken at the span's end (the most
attention: an upper bound on what ranking may pick). Query-aware selection is priced with its
probe (the tail after the span included) and with every gap after the first copied token
recomputed in its second stage (the most it may recompute).

NOTE: None (the plan is not priced, and served) only before the first worker report, or when
the realization's calibration failed (logged) and no realization has been timed yet.
NOTE: counts and seconds only; token ids never enter a sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from semkv.cost import (
    EngineRates,
    Prediction,
    RealizeWork,
    StepWork,
    chunk_attention,
    realize_work,
)
from semkv.realize.recompute import (
    RecomputeStrategy,
    budget,
    copied_positions,
    first_k_positions,
    needed_positions,
    tail_positions,
    uncovered_positions,
)
from semkv.span_plan import SpanPlan
from semkv_vllm.metadata import RealizeOp, SemkvWorkerMetadata

Runs = list[tuple[int, int]]


def _passes(layers: int, positions: range, runs: Runs, recompute: RecomputeStrategy,
            top: Sequence[int], prompt_tokens: int,
            first: int | None = None) -> list[tuple[int, list[int]]]:
    """(layers, positions) computed: the strategy's choice, as ``recompute_steps`` runs it.
    ``first`` (query): where its stage 2 starts (default: the first of ``top``)."""
    if recompute.kind.queries and len(positions) and runs:
        value_probe = [(min(recompute.probe_layers, layers), list(positions))] if (
            recompute.kind.weighs) else []
        return value_probe + _query_passes(layers, positions, runs, top, prompt_tokens, first)
    if not recompute.kind.probes or not len(positions):
        return [(layers, needed_positions(positions, runs, recompute))]
    probe = min(recompute.probe_layers, layers)
    chosen = sorted(set(uncovered_positions(positions, runs)) | set(top))
    passes = [(probe, list(positions))]
    if probe < layers:
        passes.append((layers - probe, chosen))
    return passes


def _query_passes(layers: int, positions: range, runs: Runs, top: Sequence[int],
                  prompt_tokens: int, first: int | None) -> list[tuple[int, list[int]]]:
    """``semkv.realize.query``'s two stages: the probe (the non-copied positions before the
    tail, then the tail, the part after the span included) and the recompute from layer 0."""
    gaps = uncovered_positions(positions, runs)
    tail = tail_positions(runs, prompt_tokens)
    before = [p for p in gaps if p < tail.start]
    passes = [(layers, before), (layers, list(tail))]
    if top:
        start = min(top) if first is None else first
        passes.append((layers, sorted(set(top) | {p for p in gaps if p > start})))
    return [(n, at) for n, at in passes if at]


def plan_work(plan: SpanPlan, recompute: RecomputeStrategy, prompt_tokens: int, *,
              layers: int, chunk_tokens: int | None) -> RealizeWork:
    """What realizing ``plan`` will move and compute (module docstring)."""
    bs, local = plan.block_size, plan.local_tokens
    copies = [s for s in plan.segments if not s.is_gap]
    blocks = sum((s.donor_start + s.length - 1) // bs - s.donor_start // bs + 1 for s in copies)
    runs = [(s.target_start, s.length) for s in copies]
    top: list[int] = []
    first = None
    if recompute.kind.selects:
        copied = copied_positions(runs)
        forced = (sorted(set(first_k_positions(runs, recompute.first_k)))
                  if recompute.kind.forces_first_k else [])
        take = max(0, budget(recompute, prompt_tokens, len(copied)) - len(forced))
        held = set(forced)
        top = forced + [p for p in copied if p not in held][len(copied) - len(held) - take:]
        # query recomputes every gap after its first selected position: at most all of them
        first = copied[0] if copied and top else None
    moved = local + blocks * bs + (plan.span_tokens - local)
    return realize_work(layers, moved, _passes(layers, range(local, plan.span_tokens), runs,
                                               recompute, top, prompt_tokens, first),
                        chunk_tokens)


def op_work(op: RealizeOp, recomputed: Sequence[int], *, layers: int,
            block_size: int) -> RealizeWork:
    """What a finished realization moved and computed (``recomputed``: the copied positions
    it computed through every layer)."""
    runs = [(c.target_start, c.length) for c in op.copies]
    moved = (op.local_tokens + block_size * sum(len(c.slots) for c in op.copies)
             + (op.span_tokens - op.local_tokens))
    return realize_work(layers, moved, _passes(layers, range(op.local_tokens, op.span_tokens),
                                               runs, op.recompute, recomputed,
                                               op.prompt_tokens),
                        op.max_chunk_tokens)


class EngineCost:
    def __init__(self, chunk_tokens: int, layers: int) -> None:
        self.chunk_tokens = chunk_tokens  # vLLM's max_num_batched_tokens
        self.layers = layers
        self.rates = EngineRates(chunk_tokens)
        self.last: Prediction | None = None  # the last plan's prediction (tests, probes)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> EngineCost:
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        return cls(int(vllm_config.scheduler_config.max_num_batched_tokens),
                   int(mc.get_num_layers(pc)))

    def predict(self, plan: SpanPlan, recompute: RecomputeStrategy, prompt_tokens: int, *,
                exact_end: int | None = None) -> Prediction | None:
        work = plan_work(plan, recompute, prompt_tokens, layers=self.layers,
                         chunk_tokens=self.chunk_tokens)
        self.last = self.rates.predict(plan.local_tokens, plan.span_tokens, prompt_tokens, work,
                                       fallback_from=exact_end)
        return self.last

    def predicted_gain(self, plan: SpanPlan, recompute: RecomputeStrategy, prompt_tokens: int,
                       *, exact_end: int | None = None) -> float | None:
        p = self.predict(plan, recompute, prompt_tokens, exact_end=exact_end)
        return None if p is None else p.gain

    def observe(self, meta: SemkvWorkerMetadata) -> None:
        """The samples a worker report carries (``worker_feedback.py``)."""
        for step, seconds in meta.forwards:
            self.rates.add_step(step, seconds)
        for work, seconds in meta.realizations:
            self.rates.add_realization(work, seconds)


def step_work(requests: Mapping[str, Any], scheduler_output: Any) -> StepWork | None:
    """This step's forward work when it is mostly prefill (the connector attaches it to the
    step's metadata when the cost gate is on; the workers time the forward). ``requests``: the
    scheduler side's state per request id (its vLLM ``request``)."""
    tokens = attention = prefill = 0
    for rid, n in scheduler_output.num_scheduled_tokens.items():
        st = requests.get(rid)
        if st is None:
            return None  # a request semkv does not know: the step's work is unknown
        done, prompt = st.request.num_computed_tokens, st.request.num_prompt_tokens
        tokens += n
        attention += chunk_attention(done, n)
        prefill += max(0, min(n, prompt - done))
    if prefill == 0 or 2 * prefill < tokens:
        return None  # no prefill, or mostly decode tokens
    return StepWork(tokens, attention)
