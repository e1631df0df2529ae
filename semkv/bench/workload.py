"""The labelled workload of a ``semkv bench`` run, tokenized (``semkv.eval`` builds it).

Engine-free: the bundled model's tokenizer (or the served model's, for ``semkv calibrate``;
transformers, imported inside ``load_workload``) turns every prompt into token ids; the text is
dropped once tokenized.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from semkv.bench.config import BenchConfig


@dataclass
class Workload:
    """Token ids of every prompt plus its labels (text is dropped once tokenized)."""

    ids: dict[str, list[int]]
    kind: dict[str, str]
    negative: dict[str, bool]
    donor_of: dict[str, str | None]  # target -> true donor, or the decoy of a same-topic negative
    true_donor: dict[str, bool]
    targets: list[str]
    donors: list[str]
    # target -> every donor it is labelled to reuse from (several for multi_passage_rag)
    donor_ids: dict[str, list[str]] = field(default_factory=dict)


def load_workload(config: BenchConfig, tokenizer: Path | None = None) -> Workload:
    """The workload of ``config``, tokenized by ``tokenizer`` (a model folder; default: the
    tokenizer of the model ``config`` serves)."""
    from transformers import AutoTokenizer

    from semkv.eval import build_workload

    if tokenizer is None:
        from semkv.bundled_model import served_as

        tokenizer = Path(served_as(config.model, config.dtype)[0])
    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    wl = build_workload(config.seed, clusters_per_type=config.clusters_per_type,
                        target_tokens=config.target_tokens, tokenizer=tok.encode,
                        kinds=config.kinds)
    prompts = [*wl.donors, *wl.targets]
    return Workload(
        ids={p.prompt_id: list(p.token_ids or tok.encode(p.text)) for p in prompts},
        kind={p.prompt_id: p.kind.value for p in prompts},
        negative={p.prompt_id: p.kind.is_negative for p in prompts},
        donor_of={t.prompt_id: t.true_donor_id or t.metadata.get("decoy_donor_id")
                  for t in wl.targets},
        true_donor={t.prompt_id: t.true_donor_id is not None for t in wl.targets},
        targets=[t.prompt_id for t in wl.targets],
        donors=[d.prompt_id for d in wl.donors],
        donor_ids={t.prompt_id: list(t.metadata.get("donor_ids") or []) for t in wl.targets},
    )
