"""The operator's own prompts for ``semkv calibrate --prompts FILE.jsonl`` (issue #24, item 4).

One JSON object per line::

    {"prompt": "<the whole prompt, as sent to the engine>", "group": "faq", "id": "q17"}

``prompt`` (a non-empty string) is required; ``group`` and ``id`` (strings) are optional; no
other key is read (an unknown key is an error, so a typo is not silently dropped). Blank lines
are skipped. ``id`` labels the prompt's rows in the raw JSON (default ``line-<n>``); it must be
unique.

The donors of a prompt are the earlier prompts of its group, the most recent ``donors`` of them
(a prompt without a group: the most recent earlier prompts without a group). A prompt with at
least one donor is a calibration target; the first prompt of each group is only a donor. The
frontier runner stores a target's donors, then measures the target against them: the plan the
engine makes from them is what is classed and certified, whatever the groups say.

Errors (``PromptsError``) name the file and the line, never the line's text. Text is held in
memory only: tokenized with the engine's tokenizer, then dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from semkv.bench.workload import Workload

KIND = "prompts"  # the rows' kind for the operator's prompts
DONORS = 4
_KEYS = frozenset({"prompt", "group", "id"})


class PromptsError(ValueError):
    """The prompts file cannot be used (the message names the file and the line)."""


@dataclass(frozen=True)
class PromptLine:
    line: int  # 1-based line number in the file
    id: str
    group: str | None
    prompt: str


def read_prompts(path: Path) -> list[PromptLine]:
    """Every prompt of a JSONL file, or ``PromptsError`` naming the line that is wrong."""
    where = f"prompts file {str(path)!r}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PromptsError(f"{where}: cannot read ({exc.strerror or type(exc).__name__})"
                           ) from None
    except UnicodeDecodeError:
        raise PromptsError(f"{where}: not UTF-8 text") from None
    out: list[PromptLine] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        at = f"{where}: line {n}"
        try:
            obj = json.loads(raw)
        except ValueError as exc:
            msg = exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
            raise PromptsError(f"{at}: not JSON ({msg})") from None
        if not isinstance(obj, dict):
            raise PromptsError(f"{at}: not a JSON object (one object per line: "
                               '{"prompt": ..., "group": ..., "id": ...})')
        unknown = sorted(set(obj) - _KEYS)
        if unknown:
            raise PromptsError(f"{at}: unknown key(s) {unknown}; known: {sorted(_KEYS)}")
        prompt = obj.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptsError(f"{at}: 'prompt' must be a non-empty string")
        for key in ("group", "id"):
            if key in obj and not isinstance(obj[key], str):
                raise PromptsError(f"{at}: '{key}' must be a string")
        pid = obj.get("id", f"line-{n}")
        if pid in seen:
            raise PromptsError(f"{at}: 'id' repeats the id of line {seen[pid]}")
        seen[pid] = n
        out.append(PromptLine(line=n, id=pid, group=obj.get("group"), prompt=prompt))
    return out


def donors_of(prompts: Sequence[PromptLine], donors: int = DONORS) -> dict[str, list[str]]:
    """Prompt id -> its donors' ids (most recent first); prompts without a donor left out."""
    out: dict[str, list[str]] = {}
    earlier: dict[str | None, list[str]] = {}
    for p in prompts:
        before = earlier.setdefault(p.group, [])
        if before:
            out[p.id] = before[::-1][:donors]
        before.append(p.id)
    return out


def require_targets(prompts: Sequence[PromptLine], *, where: str, donors: int = DONORS,
                    min_targets: int = 1) -> dict[str, list[str]]:
    """``donors_of``, or ``PromptsError`` when fewer than ``min_targets`` prompts have one."""
    if donors < 1:
        raise PromptsError("donors per target must be at least 1")
    labelled = donors_of(prompts, donors)
    if len(labelled) < min_targets:
        raise PromptsError(
            f"prompts file {where!r}: too few prompts: {len(prompts)} prompt(s), "
            f"{len(labelled)} with an earlier prompt of their group to reuse from; at least "
            f"{min_targets} such targets are needed (a group's first prompt is only a donor)")
    return labelled


def prompts_workload(prompts: Sequence[PromptLine], encode: Callable[[str], list[int]], *,
                     where: str, donors: int = DONORS, min_targets: int = 1) -> Workload:
    """The frontier workload of ``prompts``: every prompt with a donor is a target (text
    tokenized by ``encode``, then dropped); ``require_targets``'s error when too few."""
    labelled = require_targets(prompts, where=where, donors=donors, min_targets=min_targets)
    ids = {p.id: list(encode(p.prompt)) for p in prompts}
    targets = [p.id for p in prompts if p.id in labelled]
    used = {d for ds in labelled.values() for d in ds}
    return Workload(
        ids=ids, kind=dict.fromkeys(ids, KIND), negative=dict.fromkeys(ids, False),
        donor_of={t: labelled[t][0] for t in targets}, true_donor=dict.fromkeys(targets, True),
        targets=targets, donors=[p.id for p in prompts if p.id in used],
        donor_ids={t: labelled[t] for t in targets})


def line_of(prompts: Sequence[PromptLine]) -> dict[str, int]:
    return {p.id: p.line for p in prompts}
