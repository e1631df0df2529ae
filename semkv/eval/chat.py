"""Chat wrappers and the fixed prompt furniture (system prompts, instructions, questions).

Token identity rule: every wrapper puts the user message after a newline, and every builder
puts shared content (documents, passages) between blank lines (``"\\n\\n"``). BPE and
SentencePiece pre-tokenizers split at whitespace, so a shared block that starts after the same
newline and ends before one tokenizes to the same ids whatever surrounds it.
"""

from __future__ import annotations

import re
from typing import Literal

WrapperStyle = Literal["chatml", "llama2", "alpaca", "plain"]
WRAPPER_STYLES: tuple[WrapperStyle, ...] = ("chatml", "llama2", "alpaca", "plain")

SYSTEM_PROMPTS: dict[str, str] = {
    "helpful": "You are a helpful assistant. Answer using only the provided material.",
    "analyst": (
        "You are a careful research analyst. Quote the material when you rely on it and say "
        "plainly when it does not contain the answer."
    ),
    "tutor": "You are a patient tutor. Explain your answer step by step in plain language.",
    "terse": "You are a terse expert. Reply in at most three sentences.",
}

DOC_INSTRUCTION = "Read the document below and answer the question that follows it."
# Paraphrases of DOC_INSTRUCTION: same request, different tokens.
DOC_INSTRUCTION_PARAPHRASES: tuple[str, ...] = (
    "Go through the text that follows, then respond to the question at its end.",
    "Below is a document. After reading it, answer the question placed after it.",
    "Please study the following document and reply to the question that comes after it.",
)
RAG_INSTRUCTION = (
    "Use the retrieved passages below to answer the question. Passages are separated by "
    "blank lines and are not in any particular order."
)

DOC_QUESTIONS: tuple[str, ...] = (
    "What is the main argument of the document?",
    "Summarize the document in three sentences.",
    "Which example in the document is the most convincing, and why?",
    "What would a critic of this document object to?",
    "List the key claims the author makes.",
    "What practical advice does the document give?",
    "How does the document open, and why might the author have chosen that opening?",
    "Explain the document to a high-school student.",
    "What assumption does the author rely on most?",
    "Which part of the document is the weakest, and how could it be improved?",
)

# The question of a target that reads several retrieved essay passages.
PASSAGES_QUESTION = "Which of the passages above makes the strongest point, and why?"

# Tasks stated BEFORE the document (cross_instruction_task_first): each decides the answer on
# its own, so a donor computed under one task must not answer another. TASK_CLOSING follows the
# document in every such prompt, so everything after the task is shared text.
TASK_INSTRUCTIONS: dict[str, str] = {
    "summarize": "Summarize the document below in three sentences.",
    "people": "List every person named in the document below, one name per line.",
    "translate": "Translate the first sentence of the document below into French.",
    "title": "Propose a short title for the document below.",
    "claims": "Quote the single sentence of the document below that best states its thesis.",
}
TASK_CLOSING = "Carry out only the task stated before the document."


def rag_question(topic: str) -> str:
    return (
        f"Which of the passages above matters most for someone studying {topic.lower()}, "
        "and why?"
    )


def chat_wrap(system: str, user: str, style: WrapperStyle = "chatml") -> str:
    """``system`` and ``user`` in one of a few common chat-template shapes (plain text)."""
    if style == "chatml":
        return (
            f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
    if style == "llama2":
        return f"[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST]"
    if style == "alpaca":
        return f"### System:\n{system}\n\n### User:\n{user}\n\n### Assistant:\n"
    if style == "plain":
        return f"System: {system}\n\nUser:\n{user}\n\nAssistant:"
    raise ValueError(f"unknown wrapper style {style!r}; choose one of {WRAPPER_STYLES}")


def user_message(instruction: str, material: str, question: str) -> str:
    """Instruction, material, question: the material sits between blank lines (see above)."""
    return f"{instruction}\n\n{material}\n\n{question}"


# Word swaps for paraphrased lead-ins (whole words, case kept for a leading capital).
_SYNONYMS: dict[str, str] = {
    "important": "significant", "because": "since", "people": "folks", "think": "believe",
    "often": "frequently", "big": "large", "many": "numerous", "very": "really",
    "start": "begin", "hard": "difficult", "seems": "appears", "get": "obtain",
    "usually": "typically", "good": "fine", "but": "yet", "about": "regarding",
    "small": "little", "make": "create", "thing": "matter", "things": "matters",
    "is": "remains", "are": "stay", "was": "had been", "first": "initial",
}
_WORD = re.compile(r"[A-Za-z]+")
LEAD_INS: tuple[str, ...] = ("To put it briefly: ", "In short, ", "As a start, ")


def paraphrase_lines(lines: str, variant: int) -> str:
    """A deterministic light paraphrase: a lead-in phrase plus up to four word swaps."""
    swaps = 0

    def swap(match: re.Match[str]) -> str:
        nonlocal swaps
        word = match.group(0)
        repl = _SYNONYMS.get(word.lower())
        if repl is None or swaps >= 4:
            return word
        swaps += 1
        return repl.capitalize() if word[0].isupper() else repl

    edited = _WORD.sub(swap, lines)
    return LEAD_INS[variant % len(LEAD_INS)] + edited
