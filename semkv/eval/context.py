"""The seeded allocation context every cluster builder draws documents and furniture from.

Documents and passages are handed out once (popped), so no two clusters share material.
Essays used by a donor are recorded (``donor_sources``), so negatives can avoid them; essays
used by an unrelated negative are recorded too (``negative_sources``), so a donor built after
the negatives (kinds added later, see ``semkv.eval.workload``) never shares one with them.
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
    negative_sources: set[str] = field(default_factory=set)

    def take_doc(self, *, negative: bool = False) -> Document:
        """The next unused essay document (for negatives: one no donor's essay is part of)."""
        too_few = WorkloadSizeError(
            "not enough essay text for this workload: lower clusters_per_type or target_tokens"
        )
        if not self.essay_docs:
            raise too_few
        index = 0
        if negative:
            clean = (
                i for i, d in enumerate(self.essay_docs)
                if not self.donor_sources.intersection(d.sources)
            )
            index = next(clean, 0)
        elif self.negative_sources:  # only kinds built after the negatives get here
            index = next((i for i, d in enumerate(self.essay_docs)
                          if not self.negative_sources.intersection(d.sources)), -1)
            if index < 0:
                raise too_few
        doc = self.essay_docs.pop(index)
        (self.negative_sources if negative else self.donor_sources).update(doc.sources)
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
        self, kind: ClusterKind, k: int, role: Literal["donor", "target"], text: str, *,
        name: str | None = None, **meta: Any,
    ) -> Prompt:
        """A prompt of cluster ``k``; its id ends in ``name`` (default: the role)."""
        cluster = f"{kind.value}/{k:03d}"
        true_donor = meta.pop("true_donor_id", None)
        ids = tuple(self.tokenizer(text)) if self.tokenizer is not None else None
        meta["approx_tokens"] = len(ids) if ids is not None else round(len(text) / 4.0)
        return Prompt(
            prompt_id=f"{cluster}/{name or role}", cluster_id=cluster, kind=kind, role=role,
            text=text, true_donor_id=true_donor, token_ids=ids, metadata=meta,
        )


def doc_meta(doc: Document) -> dict[str, Any]:
    return {"doc_ids": [doc.doc_id], "sources": list(doc.sources), "topic": None}


def pick(ctx: Context, seq: tuple[Any, ...] | list[Any], avoid: Any = None) -> Any:
    choices = [x for x in seq if x != avoid]
    return ctx.rng.choice(choices)


def doc_prompt(
    system: str, style: chat.WrapperStyle, instruction: str, doc: str, q: str
) -> str:
    user = chat.user_message(instruction, doc, q)
    return chat.chat_wrap(chat.SYSTEM_PROMPTS[system], user, style)


