"""The class of a realized span's plan, from its shape alone (issue #24, item 1).

Admission never sees a workload label, only the plan (DESIGN.md, "Admission of realized spans:
by class, by cost, per model"). ``plan_class(plan)`` names the plan's shape with one of four
closed values, few enough to label a metric, drawn from what ``docs/frontier.md`` measured:

``multi_donor``
    Copied runs from two or more donors (multi-passage RAG: a median of 3.5 donors per span).
    Each passage's KV was computed without the passages that now precede it. Measured 11-23x
    the fp8-KV floor's KL under every strategy, at 1K and at 4K (4K, ``first_k16``: 0.0359
    against 0.0022; ``first_k16+blend15``: 0.0252).
``gap_dominated``
    At most one donor, and more tokens computed inside the span than copied
    (``computed_tokens > copied_tokens``): a document quoting a donor's section at another
    place, with large gaps around it. Its copied tokens are the minority and saw another
    context; computing most of the span in the worker also costs about what vLLM's own prefill
    would (the operator trial of issue #24 served two such prompts: one answer left cold's,
    the other ran slower than cold). No frontier plan has this shape (its plans compute at most
    14 % of the span), so nothing certifies it; the cost side reads the same counts.
``one_donor_reordered``
    One donor, copied runs NOT in the donor's order: a run starts in the donor before the end
    of the run copied before it (reordered chunks: 6-11 runs at 1K, 30-38 at 4K). Each run's KV
    saw other chunks before it. Measured 9-21x the floor under every strategy (4K,
    ``first_k16``: 0.0267 against 0.0029, with 14 % of the prompt recomputed).
``one_donor_in_order``
    One donor, copied runs in the donor's order (each starts in the donor at or after the end
    of the previous one), at least as many tokens copied as computed: another instruction,
    chat wrapper or lead-in before the same document. Measured at or below the floor: at 4K
    ``first_k16`` 0.0005 / 0.0001 / 0.0002 (cross-instruction, task-first, paraphrased lead-in)
    against 0.0039 / 0.0017 / 0.0020, 12-15x the cold TTFT; at 1K 0.0021 / 0.0015 / 0.0011
    against 0.0023 / 0.0020 / 0.0022.

Why order and not one offset: the measured in-order plans are rarely one shift. A system prompt
the donor shares is copied in place (shift 0), then the document after another instruction at
another shift (-3 to +8 tokens), sometimes a few instruction words in between: 2-3 shifts in
most of them, every run still in the donor's order. Order is what separates the kinds: over the
bundled frontier workloads, 16 targets per kind at 1K and at 4K, planned by
``semkv.span_plan.plan_span`` from the labelled donors as the frontier engine holds them (block
32), every cross-instruction, task-first and paraphrased-lead-in plan is ``one_donor_in_order``
(at most 6.4 % of the span computed), every reordered-chunks plan ``one_donor_reordered`` and
every RAG plan ``multi_donor`` (``tests/test_plan_class.py`` checks this on a few clusters).
The class depends neither on where the span starts nor on the offsets themselves: shifting the
whole plan, or the donor's copy of it, keeps its class.

Precedence: donors first (the widest quality gap measured), then the shares (a mostly computed
plan is gap-dominated whatever its order), then order. Recomputed tokens are not part of the
class: how many are recomputed is the strategy's choice, which a gate policy makes per class.
Signals measured while realizing (the probe layers' deviation) may refine a request's class
later; this module is the plan's shape only.

Pure Python: no torch, no vLLM. Classes carry no ids, safe as metric labels.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Protocol

from semkv.span_plan import SpanPlan

# Bumped whenever a class's definition changes: a gate policy measured under another version
# certifies classes that no longer mean what they meant (semkv.gate_policy refuses it as stale).
CLASSES_VERSION = 1


class PlanClass(str, Enum):
    ONE_DONOR_IN_ORDER = "one_donor_in_order"
    ONE_DONOR_REORDERED = "one_donor_reordered"
    GAP_DOMINATED = "gap_dominated"
    MULTI_DONOR = "multi_donor"

    def __str__(self) -> str:
        return str(self.value)


class CopiedRun(Protocol):
    """A copied run of target positions: ``SpanSegment`` (not a gap), the research ``Segment``."""

    @property
    def target_start(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def donor_id(self) -> str | None: ...
    @property
    def donor_start(self) -> int: ...


def classify(runs: Iterable[CopiedRun], computed_tokens: int) -> PlanClass:
    """The class of a plan given its copied runs (gaps left out) and the tokens it computes."""
    copies = sorted((r for r in runs if r.donor_id is not None), key=lambda r: r.target_start)
    if len({r.donor_id for r in copies}) >= 2:
        return PlanClass.MULTI_DONOR
    if computed_tokens > sum(r.length for r in copies):
        return PlanClass.GAP_DOMINATED
    for before, after in zip(copies, copies[1:], strict=False):
        if after.donor_start < before.donor_start + before.length:
            return PlanClass.ONE_DONOR_REORDERED
    return PlanClass.ONE_DONOR_IN_ORDER


def plan_class(plan: SpanPlan) -> PlanClass:
    """The class of a realized span's plan: its copied segments against its gaps."""
    return classify((s for s in plan.segments if not s.is_gap), plan.computed_tokens)
