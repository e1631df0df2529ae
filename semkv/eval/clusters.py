"""One builder per cluster kind, drawing documents from a shared, seeded allocation context.

Every builder returns the prompts of one cluster: donors (registered first) and targets (each
naming its true donor, or None). Documents and passages are never reused across clusters, so a
target's true donor is the only prompt of the workload that shares its material; negatives
avoid every essay that a donor uses while unused essays remain.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from semkv.eval import chat
from semkv.eval.corpus import Document, WikiLead, trim_to_chars
from semkv.eval.model import ClusterKind, Prompt

Tokenizer = Callable[[str], list[int]]
DEFAULT_PASSAGES = 6
MIN_PASSAGES = 3
LEAD_LINES = 2  # lines of a document that a paraphrased lead-in edits


class WorkloadSizeError(ValueError):
    """The corpora cannot supply enough distinct documents for the requested workload."""


@dataclass
class Context:
    rng: random.Random
    tokenizer: Tokenizer | None
    essay_docs: list[Document]
    leads: dict[str, list[WikiLead]]  # topic -> unused leads, seeded order
    doc_tokens: int | None  # budget of the shared material; None: whole essays
    essay_chars_per_token: float
    wiki_chars_per_token: float
    donor_sources: set[str] = field(default_factory=set)

    def take_doc(self, *, negative: bool = False) -> Document:
        """The next unused essay document (for negatives: one no donor's essay is part of)."""
        if not self.essay_docs:
            raise WorkloadSizeError(
                "not enough essay text for this workload: lower clusters_per_type or "
                "target_tokens"
            )
        pick = 0
        if negative:
            clean = (
                i for i, d in enumerate(self.essay_docs)
                if not self.donor_sources.intersection(d.sources)
            )
            pick = next(clean, 0)
        doc = self.essay_docs.pop(pick)
        if not negative:
            self.donor_sources.update(doc.sources)
        return self._fit(doc)

    def _fit(self, doc: Document) -> Document:
        """With a tokenizer, trim the document to about its token budget (one correction)."""
        if self.tokenizer is None or self.doc_tokens is None:
            return doc
        count = len(self.tokenizer(doc.text))
        if count <= self.doc_tokens * 1.05:
            return doc
        text = trim_to_chars(doc.text, int(len(doc.text) * self.doc_tokens / count))
        return Document(doc.doc_id, text, doc.sources)

    def take_leads(self, topic: str | None = None) -> tuple[str, list[WikiLead]]:
        """Unused leads of one topic, enough to fill the budget (at least MIN_PASSAGES)."""
        if self.doc_tokens is None:
            want_chars = None
        else:
            want_chars = self.doc_tokens * self.wiki_chars_per_token
        fits = [t for t, pool in sorted(self.leads.items()) if len(pool) >= MIN_PASSAGES]
        if topic is None:
            if not fits:
                raise WorkloadSizeError("not enough unused Wikipedia leads for this workload")
            topic = self.rng.choice(fits)
        pool = self.leads[topic]
        taken: list[WikiLead] = []
        size = 0
        while pool and (
            len(taken) < MIN_PASSAGES
            or (want_chars is None and len(taken) < DEFAULT_PASSAGES)
            or (want_chars is not None and size < want_chars)
        ):
            taken.append(pool.pop())
            size += len(taken[-1].text) + len(taken[-1].title) + 10
        if len(taken) < MIN_PASSAGES:
            raise WorkloadSizeError(f"not enough unused leads of topic {topic!r}")
        return topic, taken

    def prompt(
        self, kind: ClusterKind, k: int, role: Literal["donor", "target"], text: str, **meta: Any
    ) -> Prompt:
        cluster = f"{kind.value}/{k:03d}"
        true_donor = meta.pop("true_donor_id", None)
        ids = tuple(self.tokenizer(text)) if self.tokenizer is not None else None
        meta["approx_tokens"] = len(ids) if ids is not None else round(len(text) / 4.0)
        return Prompt(
            prompt_id=f"{cluster}/{role}", cluster_id=cluster, kind=kind, role=role,
            text=text, true_donor_id=true_donor, token_ids=ids, metadata=meta,
        )


def _doc_meta(doc: Document) -> dict[str, Any]:
    return {"doc_ids": [doc.doc_id], "sources": list(doc.sources), "topic": None}


def _pick(ctx: Context, seq: tuple[Any, ...] | list[Any], avoid: Any = None) -> Any:
    choices = [x for x in seq if x != avoid]
    return ctx.rng.choice(choices)


def _doc_prompt(system: str, style: chat.WrapperStyle, instruction: str, doc: str, q: str) -> str:
    user = chat.user_message(instruction, doc, q)
    return chat.chat_wrap(chat.SYSTEM_PROMPTS[system], user, style)


def exact_control(ctx: Context, k: int) -> list[Prompt]:
    kind, doc = ClusterKind.EXACT_CONTROL, ctx.take_doc()
    system, style = _pick(ctx, sorted(chat.SYSTEM_PROMPTS)), _pick(ctx, chat.WRAPPER_STYLES)
    q = ctx.rng.randrange(len(chat.DOC_QUESTIONS))
    text = _doc_prompt(system, style, chat.DOC_INSTRUCTION, doc.text, chat.DOC_QUESTIONS[q])
    meta = {**_doc_meta(doc), "system": system, "style": style, "question": q}
    donor = ctx.prompt(kind, k, "donor", text, **meta)
    target = ctx.prompt(kind, k, "target", text, true_donor_id=donor.prompt_id, **meta)
    return [donor, target]


def partial_overlap(ctx: Context, k: int) -> list[Prompt]:
    kind, doc = ClusterKind.PARTIAL_OVERLAP, ctx.take_doc()
    system, style = _pick(ctx, sorted(chat.SYSTEM_PROMPTS)), _pick(ctx, chat.WRAPPER_STYLES)
    q1, q2 = ctx.rng.sample(range(len(chat.DOC_QUESTIONS)), 2)
    meta = {**_doc_meta(doc), "system": system, "style": style}
    donor_text = _doc_prompt(system, style, chat.DOC_INSTRUCTION, doc.text, chat.DOC_QUESTIONS[q1])
    donor = ctx.prompt(kind, k, "donor", donor_text, question=q1, **meta)
    text = _doc_prompt(system, style, chat.DOC_INSTRUCTION, doc.text, chat.DOC_QUESTIONS[q2])
    target = ctx.prompt(kind, k, "target", text, true_donor_id=donor.prompt_id, question=q2, **meta)
    return [donor, target]


def cross_instruction(ctx: Context, k: int) -> list[Prompt]:
    kind, doc = ClusterKind.CROSS_INSTRUCTION, ctx.take_doc()
    change = ("system", "wrapper", "both")[k % 3]
    sys_a, style_a = _pick(ctx, sorted(chat.SYSTEM_PROMPTS)), _pick(ctx, chat.WRAPPER_STYLES)
    sys_b = sys_a if change == "wrapper" else _pick(ctx, sorted(chat.SYSTEM_PROMPTS), sys_a)
    style_b = style_a if change == "system" else _pick(ctx, chat.WRAPPER_STYLES, style_a)
    q = ctx.rng.randrange(len(chat.DOC_QUESTIONS))
    meta = {**_doc_meta(doc), "question": q, "change": change}
    question = chat.DOC_QUESTIONS[q]
    donor_text = _doc_prompt(sys_a, style_a, chat.DOC_INSTRUCTION, doc.text, question)
    donor = ctx.prompt(kind, k, "donor", donor_text, system=sys_a, style=style_a, **meta)
    text = _doc_prompt(sys_b, style_b, chat.DOC_INSTRUCTION, doc.text, question)
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
    system, style = _pick(ctx, sorted(chat.SYSTEM_PROMPTS)), _pick(ctx, chat.WRAPPER_STYLES)
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
    system, style = _pick(ctx, sorted(chat.SYSTEM_PROMPTS)), _pick(ctx, chat.WRAPPER_STYLES)
    q = ctx.rng.randrange(len(chat.DOC_QUESTIONS))
    variant = ctx.rng.randrange(len(chat.DOC_INSTRUCTION_PARAPHRASES))
    lines = doc.text.split("\n")
    # Only whole lines change, so the unchanged rest starts on a newline (token-identical).
    lead_in = chat.paraphrase_lines("\n".join(lines[:LEAD_LINES]), k)
    edited = "\n".join([lead_in, *lines[LEAD_LINES:]])
    meta = {**_doc_meta(doc), "system": system, "style": style, "question": q}
    question = chat.DOC_QUESTIONS[q]
    donor_text = _doc_prompt(system, style, chat.DOC_INSTRUCTION, doc.text, question)
    donor = ctx.prompt(kind, k, "donor", donor_text, **meta)
    instruction = chat.DOC_INSTRUCTION_PARAPHRASES[variant]
    text = _doc_prompt(system, style, instruction, edited, question)
    target = ctx.prompt(
        kind, k, "target", text, true_donor_id=donor.prompt_id, edited_lines=LEAD_LINES,
        instruction_variant=variant, **meta,
    )
    return [donor, target]


def negative_unrelated(ctx: Context, k: int) -> list[Prompt]:
    kind, doc = ClusterKind.NEGATIVE_UNRELATED, ctx.take_doc(negative=True)
    system, style = _pick(ctx, sorted(chat.SYSTEM_PROMPTS)), _pick(ctx, chat.WRAPPER_STYLES)
    q = ctx.rng.randrange(len(chat.DOC_QUESTIONS))
    text = _doc_prompt(system, style, chat.DOC_INSTRUCTION, doc.text, chat.DOC_QUESTIONS[q])
    meta = {**_doc_meta(doc), "system": system, "style": style, "question": q}
    return [ctx.prompt(kind, k, "target", text, true_donor_id=None, **meta)]


def negative_same_topic(ctx: Context, k: int) -> list[Prompt]:
    """A decoy donor and a target built from other leads of the same topic: no valid donor."""
    kind = ClusterKind.NEGATIVE_SAME_TOPIC
    topic, decoy_leads = ctx.take_leads()
    _, leads = ctx.take_leads(topic)
    system, style = _pick(ctx, sorted(chat.SYSTEM_PROMPTS)), _pick(ctx, chat.WRAPPER_STYLES)
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
}
