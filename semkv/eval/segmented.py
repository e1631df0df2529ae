"""Clusters whose targets are realized from donor segments and computed gaps (issue #16).

No target shares a prefix with any donor: the engine serves it only through a segmented span
plan (``semkv.span_plan.plan_span``: copied donor segments, re-rotated, and computed gaps).

- ``multi_passage_rag``: one essay document cut (at line boundaries) into k = 3 or 4 passages.
  Each passage is cached by a DIFFERENT donor, alone, under that donor's own system prompt,
  chat wrapper and question. The target reads all k passages in a new order (never the cut
  order) under the RAG instruction, with a question after them. Donors are about 1/k of the
  target's length.
- ``cross_instruction_task_first``: donor and target share the system prompt, chat wrapper,
  document and closing line, and differ only in the task stated FIRST, before the document;
  that task decides the answer (summarize / list the people named / translate ...).
- ``quoted_section`` (issue #25): two documents sharing a section. The donor is a document of
  its own (an essay window, cached first); the target is ANOTHER document, used by no donor,
  into which a contiguous run of the donor's lines (``share`` of the target's material, 0.4 by
  default: about 30-50 % of the prompt; never the donor's first line) is quoted between blank
  lines at another place: host text before and after it, and a relative offset at least
  ``MIN_SHIFT`` away from the donor's. System prompt, chat wrapper, instruction (a paraphrase)
  and question all differ from the donor's, so the section is the one long copied run (a few
  coincidental tokens aside), shifted, among computed text: the shape ``semkv.plan_class``
  calls ``gap_dominated``. Its metadata says where (``quoted_lines``, ``host_line``,
  ``donor_offset``, ``target_offset``, ``section_share``: line numbers and shares, no text).
  With a budget under ~200 tokens the documents are too short (``WorkloadSizeError``).

Labels, following the other kinds: every target names ``true_donor_id`` (for the RAG target
the donor of its first passage) and, in its metadata, ``donor_ids`` (every donor it is meant to
reuse from, in target order) and ``expected_tier``: ``verified`` (identical tokens, served
from other positions, keys re-rotated; the differing text is computed, never substituted).
Passages sit between blank lines in donors and targets alike, so they tokenize identically
(``semkv.eval.chat``); a quoted section starts after a newline and ends before one in both.
"""

from __future__ import annotations

from semkv.eval import chat
from semkv.eval.context import Context, WorkloadSizeError, doc_meta, doc_prompt, pick
from semkv.eval.corpus import Document, trim_to_chars
from semkv.eval.model import ClusterKind, Prompt
from semkv.types import QualityTier

RAG_PASSAGES = (3, 4)  # passages (= donors) per multi_passage_rag cluster, alternating
QUOTED_SHARE = 0.4  # the quoted section's share of a quoted_section target's material
MIN_SHIFT = 0.15  # the section's relative offsets in donor and target differ by at least this
MIN_HOST = 0.1  # share of the target's material that is host text before, and after, the section
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


def _starts(lines: list[str]) -> list[int]:
    """Offset of each line in ``"\\n".join(lines)``, then that text's length plus one."""
    out, at = [], 0
    for line in lines:
        out.append(at)
        at += len(line) + 1
    return [*out, at]


def _quote_at(ctx: Context, donor: str, host: str, share: float) -> tuple[int, int, list[str], int]:
    """Donor lines ``[a, b)`` to quote, the host's lines, and the host line to quote them at."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"share must be between 0 and 1 (exclusive), not {share}")
    material = min(len(donor), len(host) / (1.0 - share))
    lines = donor.split("\n")
    at, want = _starts(lines), share * material
    # Every start but the first line, each with the first end that reaches the section's share.
    sections = [(a, next(b for b in range(a + 1, len(lines) + 1) if at[b] - at[a] > want))
                for a in range(1, len(lines)) if at[-1] - at[a] > want]
    host_lines = trim_to_chars(host, int((1.0 - share) * material)).split("\n")
    there = _starts(host_lines)
    while sections:
        a, b = sections.pop(ctx.rng.randrange(len(sections)))
        quoted = at[b] - at[a] + 1  # the section and the blank line around it
        size = there[-1] + quoted
        places = [i for i in range(1, len(host_lines))
                  if min(there[i], there[-1] - there[i]) >= MIN_HOST * size
                  and abs(there[i] / size - at[a] / len(donor)) >= MIN_SHIFT]
        if places:
            return a, b, host_lines, ctx.rng.choice(places)
    raise WorkloadSizeError("documents too short to quote a section at another place: raise "
                            "target_tokens")


def quoted_section(ctx: Context, k: int, *, share: float = QUOTED_SHARE) -> list[Prompt]:
    """A donor document, and another document quoting ``share`` of its material from it."""
    kind, source, host = ClusterKind.QUOTED_SECTION, ctx.take_doc(), ctx.take_doc()
    a, b, host_lines, i = _quote_at(ctx, source.text, host.text, share)
    section = "\n".join(source.text.split("\n")[a:b])
    system, style = pick(ctx, sorted(chat.SYSTEM_PROMPTS)), pick(ctx, chat.WRAPPER_STYLES)
    q1, q2 = ctx.rng.sample(range(len(chat.DOC_QUESTIONS)), 2)
    donor_text = doc_prompt(system, style, chat.DOC_INSTRUCTION, source.text,
                            chat.DOC_QUESTIONS[q1])
    donor = ctx.prompt(kind, k, "donor", donor_text, **doc_meta(source), system=system,
                       style=style, question=q1)
    before, after = "\n".join(host_lines[:i]), "\n".join(host_lines[i:])
    material = f"{before}\n\n{section}\n\n{after}"
    system_b = pick(ctx, sorted(chat.SYSTEM_PROMPTS), system)
    style_b = pick(ctx, chat.WRAPPER_STYLES, style)
    variant = ctx.rng.randrange(len(chat.DOC_INSTRUCTION_PARAPHRASES))
    text = doc_prompt(system_b, style_b, chat.DOC_INSTRUCTION_PARAPHRASES[variant], material,
                      chat.DOC_QUESTIONS[q2])
    target = ctx.prompt(
        kind, k, "target", text, true_donor_id=donor.prompt_id, donor_ids=[donor.prompt_id],
        expected_tier=EXPECTED_TIER, system=system_b, style=style_b, question=q2,
        instruction_variant=variant, doc_ids=[host.doc_id, source.doc_id],
        sources=list(dict.fromkeys((*host.sources, *source.sources))), topic=None,
        quoted_doc_id=source.doc_id, quoted_lines=[a, b], host_line=i,
        section_share=round(len(section) / len(material), 3),
        donor_offset=round(_starts(source.text.split("\n"))[a] / len(source.text), 3),
        target_offset=round((len(before) + 2) / len(material), 3),
    )
    return [donor, target]
