"""The research benchmarks' per-target loop: each labelled target with its own donors planned.

``planned_targets(lm, tokenize, workload)`` yields, for every target of a labelled workload
(``semkv.eval.build_workload``), its token ids, its labelled donors (``donor_ids`` for
multi-donor kinds, else the true donor) prefilled into a store of their own, and the reuse plan
against exactly them. ``started`` is taken before the store is built, so a benchmark's
per-target time includes it.

Used by ``benchmarks/recompute_curves.py`` and ``benchmarks/window_deviation.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from semkv.research.assembly import ReusePlan, plan_reuse
from semkv.research.donors import DonorStore
from semkv.research.layers import LayerwiseModel


@dataclass(frozen=True)
class PlannedTarget:
    target: Any  # semkv.eval.Prompt
    ids: list[int]
    donors: list[str]  # the labelled donors' ids
    store: DonorStore  # those donors only, prefilled
    plan: ReusePlan
    started: float  # time.perf_counter() before the store was built


def planned_targets(lm: LayerwiseModel, tokenize: Callable[[str], list[int]], workload: Any,
                    *, chunk_tokens: int = 32) -> Iterator[PlannedTarget]:
    donors = {d.prompt_id: list(d.token_ids or tokenize(d.text)) for d in workload.donors}
    for t in workload.targets:
        started = time.perf_counter()
        ids = list(t.token_ids or tokenize(t.text))
        labelled = list(t.metadata.get("donor_ids") or [t.true_donor_id])
        store = DonorStore(lm, chunk_tokens=chunk_tokens)
        for d in labelled:
            store.add(d, donors[d])
        plan = plan_reuse(ids, store.token_map(), chunk_tokens=chunk_tokens)
        yield PlannedTarget(t, ids, labelled, store, plan, started)
