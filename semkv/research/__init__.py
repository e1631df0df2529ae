"""Research use without a serving engine: non-prefix KV reuse, re-rotation and recompute.

Protocol (Hugging Face transformers; the families of ``semkv.realize.family``: ``model_type``
llama, mistral, qwen2, qwen3, qwen3_moe, gemma2, gemma3_text; fp32 on CPU)::

    from semkv.research import LayerwiseModel, DonorStore, plan_reuse, Strategy, prefill

    lm = LayerwiseModel.from_pretrained(path)            # the bundled model: ensure_model()
    store = DonorStore(lm)
    store.add("d1", donor_ids)                           # full prefill, KV kept in memory
    plan = plan_reuse(target_ids, {"d1": donor_ids})     # which donor token serves which position
    result = prefill(lm, target_ids, plan, store, Strategy.blend(0.15))
    # result.cache: the target's KV (reused chunks re-rotated, chosen tokens recomputed)
    # result.logits: next-token logits after the prompt; result.passes: (layers, positions)
    # computed, for the FLOPs estimate (semkv.research.flops)

Any span may be reused, not only a prefix (as in CacheBlend / EPIC / KVShare): every target
position is mapped to a donor position by ``semkv.span_map.map_tokens``; keys move to their new
position by a RoPE re-rotation built from the model's config and checked against the model's own
rotary embedding. ``semkv.research.study.run_study`` measures, per cluster type of the labelled
workloads and per recompute strategy, how much is reused and what it costs in quality against a
full prefill (see docs/research.md).

This package needs torch and transformers (``pip install 'semkv[research]'``); importing
``semkv`` never imports it. NOTE: KV, prompts and token ids stay in memory; results carry
counts and scores only.
"""

from __future__ import annotations

from semkv.research._deps import require

require("torch", "transformers")

from semkv.research.assembly import ReusePlan, assemble, plan_reuse, rank_donors  # noqa: E402
from semkv.research.donors import DonorStore  # noqa: E402
from semkv.research.layers import KVCache, LayerwiseModel  # noqa: E402
from semkv.research.quality import QualityScores, score_generation  # noqa: E402
from semkv.research.recompute import PrefillResult, Strategy, prefill  # noqa: E402
from semkv.research.rope import LayerRotator, RopeRotator  # noqa: E402

__all__ = [
    "DonorStore",
    "KVCache",
    "LayerwiseModel",
    "PrefillResult",
    "QualityScores",
    "LayerRotator",
    "ReusePlan",
    "RopeRotator",
    "Strategy",
    "assemble",
    "plan_reuse",
    "prefill",
    "rank_donors",
    "score_generation",
]
