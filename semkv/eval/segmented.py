"""Clusters whose targets are realized from donor segments and computed gaps (issue #16).

Neither target shares a prefix with any donor: the engine serves it only through a segmented
span plan (``semkv.span_plan.plan_span``: copied donor segments, re-rotated, and computed gaps).

- ``multi_passage_rag``: one essay document cut (at line boundaries) into k = 3 or 4 passages.
  Each passage is cached by a DIFFERENT donor, alone, under that donor's own system prompt,
  chat wrapper and question. The target reads all k passages in a new order (never the cut
  order) under the RAG instruction, with a question after them. Donors are about 1/k of the
  target's length.
- ``cross_instruction_task_first``: donor and target share the system prompt, chat wrapper,
  document and closing line, and differ only in the task stated FIRST, before the document;
  that task decides the answer (summarize / list the people named / translate ...).

Labels, following the other kinds: every target names ``true_donor_id`` (for the RAG target
the donor of its first passage) and, in its metadata, ``donor_ids`` (every donor it is meant to
reuse from, in target order) and ``expected_tier``: ``verified`` (identical tokens, served
from other positions, keys re-rotated; the differing text is computed, never substituted).
Passages sit between blank lines in donors and targets alike, so they tokenize identically
(``semkv.eval.chat``).
"""

from __future__ import annotations

from semkv.eval import chat
from semkv.eval.context import Context, WorkloadSizeError, doc_meta, doc_prompt, pick
from semkv.eval.corpus import Document
from semkv.eval.model import ClusterKind, Prompt
from semkv.types import QualityTier

RAG_PASSAGES = (3, 4)  # passages (= donors) per multi_passage_rag cluster, alternating
EXPECTED_TIER = QualityTier.VERIFIED.value


def split_passages(text: str, k: int) -> list[str]:
    """``text`` cut at line boundaries into ``k`` passages of about equal length."""
    lines = text.split("\n")
    if len(lines) < k:
        raise WorkloadSizeError(f"a document of {len(lines)} lines cannot make {k} passages: "
                                "raise target_tokens")
    passages: list[str] = []
    current: list[str] = []
    size = 0
    for i, line in enumerate(lines):
        current.append(line)
        size += len(line) + 1
        # Cut when this passage reached its share, keeping a line for every later passage
        # (and at the latest when only that many lines are left).
        later, left = k - 1 - len(passages), len(lines) - i - 1
        if later and left >= later and (size >= len(text) * (len(passages) + 1) / k
                                        or left == later):
            passages.append("\n".join(current))
            current = []
    passages.append("\n".join(current))
    return passages


def _passage_meta(doc: Document, index: int) -> dict[str, object]:
    return {"doc_ids": [f"{doc.doc_id}/p{index}"], "sources": list(doc.sources), "topic": None}


def multi_passage_rag(ctx: Context, k: int) -> list[Prompt]:
    kind, doc = ClusterKind.MULTI_PASSAGE_RAG, ctx.take_doc()
    passages = split_passages(doc.text, RAG_PASSAGES[k % len(RAG_PASSAGES)])
    donors: list[Prompt] = []
    for i, passage in enumerate(passages):
        system, style = pick(ctx, sorted(chat.SYSTEM_PROMPTS)), pick(ctx, chat.WRAPPER_STYLES)
        q = ctx.rng.randrange(len(chat.DOC_QUESTIONS))
        text = doc_prompt(system, style, chat.DOC_INSTRUCTION, passage, chat.DOC_QUESTIONS[q])
        donors.append(ctx.prompt(
            kind, k, "donor", text, name=f"donor{i}", passage=i, system=system, style=style,
            question=q, **_passage_meta(doc, i),
        ))
    order = list(range(len(passages)))
    while order == sorted(order):  # a real reordering, never the cut order
        ctx.rng.shuffle(order)
    system, style = pick(ctx, sorted(chat.SYSTEM_PROMPTS)), pick(ctx, chat.WRAPPER_STYLES)
    material = "\n\n".join(passages[i] for i in order)
    text = doc_prompt(system, style, chat.RAG_INSTRUCTION, material, chat.PASSAGES_QUESTION)
    donor_ids = [donors[i].prompt_id for i in order]
    target = ctx.prompt(
        kind, k, "target", text, true_donor_id=donor_ids[0], donor_ids=donor_ids, order=order,
        expected_tier=EXPECTED_TIER, system=system, style=style,
        doc_ids=[f"{doc.doc_id}/p{i}" for i in order], sources=list(doc.sources), topic=None,
    )
    return [*donors, target]


def cross_instruction_task_first(ctx: Context, k: int) -> list[Prompt]:
    kind, doc = ClusterKind.CROSS_INSTRUCTION_TASK_FIRST, ctx.take_doc()
    system, style = pick(ctx, sorted(chat.SYSTEM_PROMPTS)), pick(ctx, chat.WRAPPER_STYLES)
    task_a, task_b = ctx.rng.sample(sorted(chat.TASK_INSTRUCTIONS), 2)
    meta = {**doc_meta(doc), "system": system, "style": style}

    def text(task: str) -> str:
        instruction = chat.TASK_INSTRUCTIONS[task]
        return doc_prompt(system, style, instruction, doc.text, chat.TASK_CLOSING)

    donor = ctx.prompt(kind, k, "donor", text(task_a), task=task_a, **meta)
    target = ctx.prompt(
        kind, k, "target", text(task_b), true_donor_id=donor.prompt_id,
        donor_ids=[donor.prompt_id], expected_tier=EXPECTED_TIER, task=task_b,
        donor_task=task_a, **meta,
    )
    return [donor, target]
