"""A tiny random Llama behind ``semkv.research.LayerwiseModel``, for tests of the realization
semantics that need a real layer stack but not a trained model (seeded: the same each run)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def tiny_llama(num_layers: int) -> Iterator[Any]:
    """4 heads over 2 KV heads, head size 16, fp32, one thread (deterministic sums)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from semkv.research import LayerwiseModel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=num_layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=1024,
                         attn_implementation="eager")
    try:
        yield LayerwiseModel(LlamaForCausalLM(config).to(torch.float32))
    finally:
        torch.set_num_threads(threads)


def two_donor_case(lm: Any, question_tokens: int = 6,
                   block: int = 16) -> tuple[list[int], Any, Any]:
    """Two donors' passages in a new order behind another lead-in, then a question of
    ``question_tokens`` random tokens: (target, its ``SpanPlan``, a ``DonorStore``). Shifted
    copies and gaps, the same tokens for a seed (the recompute tests' shared case)."""
    import torch

    from semkv.research import DonorStore
    from semkv.span_plan import plan_span

    gen = torch.Generator().manual_seed(5)

    def tokens(n: int) -> list[int]:
        return torch.randint(10, 300, (n,), generator=gen).tolist()

    a, b, c = tokens(70), tokens(60), tokens(50)
    lead = tokens(40)
    store = DonorStore(lm, chunk_tokens=32)
    store.add("d1", tokens(9) + a + tokens(5) + c)
    store.add("d2", lead[:32] + tokens(13) + b)
    target = lead + b + tokens(7) + a + tokens(4) + c + tokens(question_tokens)
    plan = plan_span(target, store.token_map(), local_tokens=2 * block, block_size=block,
                     chunk_tokens=32)
    assert plan is not None and plan.shifted_tokens > 100 and plan.computed_tokens > 0
    return target, plan, store


def engine_style_recomputed(lm: Any, target: list[int], plan: Any, store: Any,
                            strategy: Any) -> list[int]:
    """The worker's realization of ``plan`` under ``strategy`` (``semkv_vllm.realization``'s
    steps on a research runner): a cache sized as the worker sizes it, the target's own exact
    KV for the local prefix, the copies placed (keys re-rotated), then ``recompute`` over the
    span with the ids the op would carry. Returns the copied positions recomputed."""
    import torch

    from semkv.realize.recompute import cache_tokens, needed_positions, recompute
    from semkv.realize.span import place

    n, local = len(target), plan.local_tokens
    span = range(local, plan.span_tokens)
    runs = [(s.target_start, s.length) for s in plan.segments if s.donor_id is not None]
    exact, _ = lm.full_prefill(target[:local], capacity=n, all_logits=False)
    cache = lm.empty_cache(cache_tokens(span, runs, strategy, n))
    for layer in range(lm.num_layers):  # the local prefix: the target's own KV
        cache.keys[layer][:, :, :local] = exact.keys[layer][:, :, :local]
        cache.values[layer][:, :, :local] = exact.values[layer][:, :, :local]
    for seg in plan.segments:
        if seg.donor_id is None:
            continue
        keys, values = store.gather(seg.donor_id,
                                    torch.arange(seg.donor_start, seg.donor_start + seg.length))
        place(cache, lm.rotator, torch.arange(seg.target_start, seg.end),
              [k[0] for k in keys], [v[0] for v in values],
              torch.full((seg.length,), seg.target_start - seg.donor_start))
    needed = needed_positions(span, runs, strategy, n)
    return recompute(lm, cache, span, runs, {p: target[p] for p in needed}, strategy,
                     n).recomputed


def research_recomputed(lm: Any, target: list[int], plan: Any, store: Any,
                        strategy: Any) -> list[int]:
    """The copied positions ``semkv.research.prefill`` recomputes under the same copies."""
    from semkv.research import prefill
    from semkv.research.recompute import plan_of_span

    reuse = plan_of_span(plan, len(target))
    result = prefill(lm, target, reuse, store, strategy)
    return [p for p in result.passes[-1][1] if reuse.reused[p]]
