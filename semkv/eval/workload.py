"""``build_workload``: labelled prompt clusters from the offline corpora, deterministic per seed.

Length control: ``target_tokens`` is the approximate size of each prompt. Without a tokenizer
the budget is converted to characters at 4 characters per token; with one, the characters per
token are measured on a sample of each corpus and every essay document is trimmed (at a line
boundary) to about its token budget. ``target_tokens=None`` keeps whole essays and six passages.

Build order: positive kinds, then negatives (so negatives can avoid every essay a donor uses),
then ``LATER_KINDS`` (kinds added after results were published) from their own random stream,
their prompts inserted at seeded positions: the prompts of every other kind, and their order,
are what they were before those kinds existed, for the same seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

from semkv.eval import chat
from semkv.eval.clusters import BUILDERS, Context
from semkv.eval.corpus import essay_documents, leads_by_topic, load_essays, load_wiki
from semkv.eval.model import KINDS, LATER_KINDS, ClusterKind, Prompt, Workload

CHARS_PER_TOKEN = 4.0  # the usual English BPE ratio, used when no tokenizer is given
_SAMPLE_CHARS = 40_000


def _chars_per_token(texts: Iterable[str], tokenizer: Callable[[str], list[int]] | None) -> float:
    if tokenizer is None:
        return CHARS_PER_TOKEN
    sample = ""
    for text in texts:
        sample += text + "\n"
        if len(sample) >= _SAMPLE_CHARS:
            break
    count = len(tokenizer(sample))
    return len(sample) / count if count else CHARS_PER_TOKEN


def _overhead_tokens(tokenizer: Callable[[str], list[int]] | None) -> int:
    """Tokens of everything around the material: the longest wrapper, system prompt, etc."""
    system = max(chat.SYSTEM_PROMPTS.values(), key=len)
    question = max((*chat.DOC_QUESTIONS, chat.PASSAGES_QUESTION, chat.TASK_CLOSING), key=len)
    instruction = max(
        (chat.DOC_INSTRUCTION, chat.RAG_INSTRUCTION, *chat.TASK_INSTRUCTIONS.values()), key=len
    )
    text = chat.chat_wrap(system, chat.user_message(instruction, "", question), "chatml")
    return len(tokenizer(text)) if tokenizer is not None else round(len(text) / CHARS_PER_TOKEN)


def build_workload(
    seed: int,
    *,
    clusters_per_type: int = 4,
    target_tokens: int | None = None,
    tokenizer: Callable[[str], list[int]] | None = None,
    kinds: Iterable[str | ClusterKind] | None = None,
) -> Workload:
    """Build ``clusters_per_type`` clusters of each kind in ``kinds`` (all by default).

    Raises ``ValueError`` for an unknown kind and ``WorkloadSizeError`` (a ValueError) when the
    corpora cannot supply enough distinct documents at this size.
    """
    if clusters_per_type < 1:
        raise ValueError("clusters_per_type must be at least 1")
    if target_tokens is not None and target_tokens < 64:
        raise ValueError("target_tokens must be at least 64 (or None for whole documents)")
    wanted = KINDS if kinds is None else tuple(ClusterKind(k) for k in kinds)
    rng = random.Random(seed)
    doc_tokens = None
    essay_cpt = _chars_per_token((e.text for e in load_essays()), tokenizer)
    wiki_cpt = _chars_per_token((lead.passage() for lead in load_wiki()), tokenizer)
    if target_tokens is not None:
        doc_tokens = max(32, target_tokens - _overhead_tokens(tokenizer))
    leads = leads_by_topic()
    for topic in sorted(leads):
        rng.shuffle(leads[topic])
    essay_chars = None if doc_tokens is None else int(doc_tokens * essay_cpt)
    ctx = Context(
        rng=rng,
        tokenizer=tokenizer,
        essay_docs=essay_documents(rng, essay_chars),
        leads=leads,
        doc_tokens=doc_tokens,
        essay_chars_per_token=essay_cpt,
        wiki_chars_per_token=wiki_cpt,
    )
    built: list[Prompt] = []
    # Positives first, so negatives can avoid every essay that a donor uses.
    first = [kd for kd in wanted if kd not in LATER_KINDS]
    for kind in sorted(first, key=lambda kd: (kd.is_negative, KINDS.index(kd))):
        for k in range(clusters_per_type):
            built.extend(BUILDERS[kind](ctx, k))
    donors = [p for p in built if p.role == "donor"]
    targets = [p for p in built if p.role == "target"]
    rng.shuffle(donors)  # interleave kinds, reproducibly
    rng.shuffle(targets)
    ctx.rng = later = random.Random(f"semkv.eval.later/{seed}")  # leaves `rng` as it was
    for kind in (kd for kd in LATER_KINDS if kd in wanted):
        for k in range(clusters_per_type):
            for prompt in BUILDERS[kind](ctx, k):
                into = donors if prompt.role == "donor" else targets
                into.insert(later.randrange(len(into) + 1), prompt)
    return Workload(
        seed=seed,
        target_tokens=target_tokens,
        kinds=tuple(k for k in KINDS if k in wanted),
        donors=tuple(donors),
        targets=tuple(targets),
    )
