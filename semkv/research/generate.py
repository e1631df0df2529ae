"""Greedy decoding and teacher-forced log-likelihood on top of a prefilled cache.

Protocol: after ``prefill`` (capacity >= prompt + new tokens), ``greedy(lm, result, n)``
decodes up to ``n`` tokens (stopping after an end-of-sequence token, which is kept), and
``answer_logprob(lm, result, answer)`` is the mean log-probability per token of ``answer``
continuing the prompt, in one forward pass over the answer (under the model's unmodified
distribution, even where ``greedy`` suppressed some tokens).

Both write only positions at or after the prompt's end, so the prompt's cache is never changed
and the two can run in either order on the same result (the second overwrites the first's
positions before it reads them: a query only sees keys at or before its own position).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from semkv.research.layers import LayerwiseModel
from semkv.research.recompute import PrefillResult


def _check_room(result: PrefillResult, tokens: int) -> None:
    if result.num_tokens + tokens > result.cache.capacity:
        raise ValueError("the cache has no room for these tokens: prefill with a larger capacity")


def greedy(lm: LayerwiseModel, result: PrefillResult, max_new_tokens: int,
           eos_ids: Collection[int] = (), *, suppress_ids: Collection[int] = ()) -> list[int]:
    """Greedy continuation of the prefilled prompt (argmax; ties: lowest id).

    ``suppress_ids`` are never generated (e.g. end-of-sequence, so that every continuation
    has ``max_new_tokens`` tokens to compare); ``eos_ids`` end the continuation.
    """
    _check_room(result, max_new_tokens)
    out: list[int] = []
    logits = result.logits
    banned = torch.tensor(sorted(suppress_ids), dtype=torch.long)
    for step in range(max_new_tokens):
        if banned.numel():
            logits = logits.clone()
            logits[banned] = float("-inf")
        token = int(torch.argmax(logits))
        out.append(token)
        if token in eos_ids or step == max_new_tokens - 1:
            break
        position = torch.tensor([result.num_tokens + step], dtype=torch.long)
        logits = lm.forward(result.cache, [token], position)[-1]
    return out


def answer_logprob(lm: LayerwiseModel, result: PrefillResult, answer: Sequence[int]) -> float:
    """Mean log-probability per token of ``answer`` right after the prompt (0.0 if empty)."""
    if not answer:
        return 0.0
    _check_room(result, len(answer))
    logits = [result.logits[None, :]]
    if len(answer) > 1:
        positions = torch.arange(result.num_tokens, result.num_tokens + len(answer) - 1)
        logits.append(lm.forward(result.cache, list(answer[:-1]), positions))
    logprobs = torch.log_softmax(torch.cat(logits), dim=-1)
    picked = logprobs[torch.arange(len(answer)), torch.tensor(list(answer), dtype=torch.long)]
    return float(picked.mean())
