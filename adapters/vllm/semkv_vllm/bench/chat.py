"""A multi-turn chat through an OpenAI-compatible server, sent as a client sends one.

Each turn re-sends the whole conversation so far (the system prompt, every earlier question
and answer, the new question) to ``/v1/chat/completions``; the server applies the model's chat
template. Answers are greedy and streamed: a turn's time to first token is measured at the
client, from the request to the first chunk that carries text.

Arms, per turn, in the order given: ``hit`` sends the turn as is (whatever the server's
caches hold from the turns before: vLLM's own prefix hit); ``cold`` empties vLLM's own prefix
cache first (``/reset_prefix_cache``, dev mode), so only what semkv keeps (if the server runs
it) can serve the history. The conversation is built from a reference: the given ``answers``
(another server's) when replaying, else the ``reference`` arm's own answers; every server then
sees the same messages turn by turn.

The questions are passages of the bundled essays (read at run time, never written or logged)
with a request to summarize them.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

from semkv_vllm.bench.serve import post

SYSTEM = ("You are a careful reader helping a user go through a long text part by part. "
          "Answer in one or two short sentences, plainly, without lists or headings, and "
          "say so when a part does not say enough to answer.")
PAUSE_S = 0.5  # before each request: the server settles (a chat's reader is slower still)


@dataclass
class Turn:
    index: int
    prompt_tokens: int = 0
    ttft_s: dict[str, float] = field(default_factory=dict)  # per arm
    answers: dict[str, str] = field(default_factory=dict)  # per arm


def questions(turns: int, *, chars: int = 360, seed: int = 0) -> list[str]:
    """``turns`` questions, each a passage of ``chars`` characters from the bundled essays."""
    from semkv.eval.corpus import load_essays

    texts = [essay.text for essay in load_essays()]
    rng = random.Random(seed)
    out = []
    for i in range(turns):
        text = texts[rng.randrange(len(texts))]
        start = rng.randrange(0, max(1, len(text) - chars))
        out.append(f"Part {i + 1} of the text:\n{text[start:start + chars]}\n\nSummarize it.")
    return out


def _ask(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int,
         params: dict[str, Any] | None = None) -> tuple[float, str, int]:
    started = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    prompt_tokens = 0
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"kv_transfer_params": params} if params is not None else None)
    for chunk in stream:
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                if first is None:
                    first = time.perf_counter()
                pieces.append(choice.delta.content)
    end = time.perf_counter()
    return (first or end) - started, "".join(pieces), prompt_tokens


def run_chat(base: str, users: list[str], *, arms: tuple[str, ...], reference: str = "cold",
             max_tokens: int = 24, answers: list[str] | None = None,
             params: dict[str, Any] | None = None) -> list[Turn]:
    """The chat on the server at ``base``; per turn each arm's TTFT and answer (``params``:
    every request's ``kv_transfer_params``, e.g. semkv's request options)."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": SYSTEM}]
    turns: list[Turn] = []
    for i, question in enumerate(users):
        messages.append({"role": "user", "content": question})
        turn = Turn(i)
        for arm in arms:
            if arm == "cold" and not post(base + "/reset_prefix_cache").get("success", True):
                raise RuntimeError("the server did not reset its prefix cache")
            time.sleep(PAUSE_S)
            ttft, text, turn.prompt_tokens = _ask(client, model, messages, max_tokens, params)
            turn.ttft_s[arm], turn.answers[arm] = ttft, text
        turns.append(turn)
        said = answers[i] if answers is not None else turn.answers[reference]
        messages.append({"role": "assistant", "content": said})
    return turns
