"""One builder per cluster kind, drawing documents from a shared, seeded allocation context.

Every builder returns the prompts of one cluster: donors (registered first) and targets (each
naming its true donor, or None). Documents and passages are never reused across clusters, so a
target's true donor is the only prompt of the workload that shares its material; negatives
avoid every essay that a donor uses while unused essays remain. The builders of targets that
reuse several donors, segments after a differing instruction, or a donor's section quoted
inside another document, are in ``semkv.eval.segmented``; ``BUILDERS`` registers every kind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from semkv.eval import chat
from semkv.eval.context import (
    DEFAULT_PASSAGES,
    LEAD_LINES,
    MIN_PASSAGES,
    Context,
    Tokenizer,
    WorkloadSizeError,
    doc_meta,
    doc_prompt,
    pick,
)
from semkv.eval.corpus import WikiLead
from semkv.eval.model import ClusterKind, Prompt
from semkv.eval.segmented import cross_instruction_task_first, multi_passage_rag, quoted_section

__all__ = ["BUILDERS", "DEFAULT_PASSAGES", "LEAD_LINES", "MIN_PASSAGES", "Context", "Tokenizer",
           "WorkloadSizeError"]


def exact_control(ctx: Context, k: int) -> list[Prompt]:
    kind, doc = ClusterKind.EXACT_CONTROL, ctx.take_doc()
    system, style = pick(ctx, sorted(chat.SYSTEM_PROMPTS)), pick(ctx, chat.WRAPPER_STYLES)
    q = ctx.rng.randrange(len(chat.DOC_QUESTIONS))
    text = doc_prompt(system, style, chat.DOC_INSTRUCTION, doc.text, chat.DOC_QUESTIONS[q])
    meta = {**doc_meta(doc), "system": system, "style": style, "question": q}
    donor = ctx.prompt(kind, k, "donor", text, **meta)
    target = ctx.prompt(kind, k, "target", text, true_donor_id=donor.prompt_id, **meta)
    return [donor, target]


def partial_overlap(ctx: Context, k: int) -> list[Prompt]:
    kind, doc = ClusterKind.PARTIAL_OVERLAP, ctx.take_doc()
    system, style = pick(ctx, sorted(chat.SYSTEM_PROMPTS)), pick(ctx, chat.WRAPPER_STYLES)
    q1, q2 = ctx.rng.sample(range(len(chat.DOC_QUESTIONS)), 2)
    meta = {**doc_meta(doc), "system": system, "style": style}
    donor_text = doc_prompt(system, style, chat.DOC_INSTRUCTION, doc.text, chat.DOC_QUESTIONS[q1])
    donor = ctx.prompt(kind, k, "donor", donor_text, question=q1, **meta)
    text = doc_prompt(system, style, chat.DOC_INSTRUCTION, doc.text, chat.DOC_QUESTIONS[q2])
    target = ctx.prompt(kind, k, "target", text, true_donor_id=donor.prompt_id, question=q2, **meta)
    return [donor, target]


def cross_instruction(ctx: Context, k: int) -> list[Prompt]:
    kind, doc = ClusterKind.CROSS_INSTRUCTION, ctx.take_doc()
    change = ("system", "wrapper", "both")[k % 3]
    sys_a, style_a = pick(ctx, sorted(chat.SYSTEM_PROMPTS)), pick(ctx, chat.WRAPPER_STYLES)
    sys_b = sys_a if change == "wrapper" else pick(ctx, sorted(chat.SYSTEM_PROMPTS), sys_a)
    style_b = style_a if change == "system" else pick(ctx, chat.WRAPPER_STYLES, style_a)
    q = ctx.rng.randrange(len(chat.DOC_QUESTIONS))
    meta = {**doc_meta(doc), "question": q, "change": change}
    question = chat.DOC_QUESTIONS[q]
    donor_text = doc_prompt(sys_a, style_a, chat.DOC_INSTRUCTION, doc.text, question)
    donor = ctx.prompt(kind, k, "donor", donor_text, system=sys_a, style=style_a, **meta)
    text = doc_prompt(sys_b, style_b, chat.DOC_INSTRUCTION, doc.text, question)
    target = ctx.prompt(
        kind, k, "target", text, true_donor_id=donor.prompt_id, system=sys_b, style=style_b, **meta
    )
    return [donor, target]


def _rag_prompt(system: str, style: chat.WrapperStyle, leads: list[WikiLead], topic: str) -> str:
    material = "\n\n".join(lead.passage() for lead in leads)
    user = chat.user_message(chat.RAG_INSTRUCTION, material, chat.rag_question(topic))
    return chat.chat_wrap(chat.SYSTEM_PROMPTS[system], user, style)


def _lead_meta(topic: str, leads: list[WikiLead]) -> dict[str, Any]:
    titles = [lead.title for lead in leads]
    return {"doc_ids": [f"wiki:{t}" for t in titles], "sources": titles, "topic": topic}


def reordered_chunks(ctx: Context, k: int) -> list[Prompt]:
    kind = ClusterKind.REORDERED_CHUNKS
    topic, leads = ctx.take_leads()
    order = list(range(len(leads)))
    while order == sorted(order):  # a real reordering, never the identity
        ctx.rng.shuffle(order)
    system, style = pick(ctx, sorted(chat.SYSTEM_PROMPTS)), pick(ctx, chat.WRAPPER_STYLES)
    meta = {**_lead_meta(topic, leads), "system": system, "style": style}
    donor = ctx.prompt(kind, k, "donor", _rag_prompt(system, style, leads, topic), **meta)
    shuffled = [leads[i] for i in order]
    target = ctx.prompt(
        kind, k, "target", _rag_prompt(system, style, shuffled, topic),
        true_donor_id=donor.prompt_id, order=order, **meta,
    )
    return [donor, target]


def paraphrased_lead_in(ctx: Context, k: int) -> list[Prompt]:
    kind, doc = ClusterKind.PARAPHRASED_LEAD_IN, ctx.take_doc()
    system, style = pick(ctx, sorted(chat.SYSTEM_PROMPTS)), pick(ctx, chat.WRAPPER_STYLES)
    q = ctx.rng.randrange(len(chat.DOC_QUESTIONS))
    variant = ctx.rng.randrange(len(chat.DOC_INSTRUCTION_PARAPHRASES))
    lines = doc.text.split("\n")
    # Only whole lines change, so the unchanged rest starts on a newline (token-identical).
    lead_in = chat.paraphrase_lines("\n".join(lines[:LEAD_LINES]), k)
    edited = "\n".join([lead_in, *lines[LEAD_LINES:]])
    meta = {**doc_meta(doc), "system": system, "style": style, "question": q}
    question = chat.DOC_QUESTIONS[q]
    donor_text = doc_prompt(system, style, chat.DOC_INSTRUCTION, doc.text, question)
    donor = ctx.prompt(kind, k, "donor", donor_text, **meta)
    instruction = chat.DOC_INSTRUCTION_PARAPHRASES[variant]
    text = doc_prompt(system, style, instruction, edited, question)
    target = ctx.prompt(
        kind, k, "target", text, true_donor_id=donor.prompt_id, edited_lines=LEAD_LINES,
        instruction_variant=variant, **meta,
    )
    return [donor, target]


def negative_unrelated(ctx: Context, k: int) -> list[Prompt]:
    kind, doc = ClusterKind.NEGATIVE_UNRELATED, ctx.take_doc(negative=True)
    system, style = pick(ctx, sorted(chat.SYSTEM_PROMPTS)), pick(ctx, chat.WRAPPER_STYLES)
    q = ctx.rng.randrange(len(chat.DOC_QUESTIONS))
    text = doc_prompt(system, style, chat.DOC_INSTRUCTION, doc.text, chat.DOC_QUESTIONS[q])
    meta = {**doc_meta(doc), "system": system, "style": style, "question": q}
    return [ctx.prompt(kind, k, "target", text, true_donor_id=None, **meta)]


def negative_same_topic(ctx: Context, k: int) -> list[Prompt]:
    """A decoy donor and a target built from other leads of the same topic: no valid donor."""
    kind = ClusterKind.NEGATIVE_SAME_TOPIC
    topic, decoy_leads = ctx.take_leads()
    _, leads = ctx.take_leads(topic)
    system, style = pick(ctx, sorted(chat.SYSTEM_PROMPTS)), pick(ctx, chat.WRAPPER_STYLES)
    decoy_text = _rag_prompt(system, style, decoy_leads, topic)
    meta = {"system": system, "style": style}
    decoy = ctx.prompt(
        kind, k, "donor", decoy_text, decoy=True, **_lead_meta(topic, decoy_leads), **meta
    )
    target = ctx.prompt(
        kind, k, "target", _rag_prompt(system, style, leads, topic), true_donor_id=None,
        decoy_donor_id=decoy.prompt_id, **_lead_meta(topic, leads), **meta,
    )
    return [decoy, target]


BUILDERS: dict[ClusterKind, Callable[[Context, int], list[Prompt]]] = {
    ClusterKind.EXACT_CONTROL: exact_control,
    ClusterKind.PARTIAL_OVERLAP: partial_overlap,
    ClusterKind.CROSS_INSTRUCTION: cross_instruction,
    ClusterKind.REORDERED_CHUNKS: reordered_chunks,
    ClusterKind.PARAPHRASED_LEAD_IN: paraphrased_lead_in,
    ClusterKind.NEGATIVE_UNRELATED: negative_unrelated,
    ClusterKind.NEGATIVE_SAME_TOPIC: negative_same_topic,
    ClusterKind.MULTI_PASSAGE_RAG: multi_passage_rag,
    ClusterKind.CROSS_INSTRUCTION_TASK_FIRST: cross_instruction_task_first,
    ClusterKind.QUOTED_SECTION: quoted_section,
}
