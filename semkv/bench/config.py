"""What a ``semkv bench`` run measures: the arms (one engine each) and the workload shape.

An *arm* is one engine configuration: a connector mode and a provider (``disabled`` is the
baseline every speedup is taken against). ``wrong_donor`` is a control arm, not a mode: it
forces an unrelated donor through the engine (see ``ARMS``) so the quality metrics can be
seen to detect damage. Presets fix everything that shapes the numbers (prompt lengths,
output length, concurrency, cluster kinds), so two runs of one preset are comparable.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from semkv.eval.model import ClusterKind

_SEMANTIC_TIERS = ["verified", "semantic"]
# request_options: the log-likelihood run scores the answer with reuse_until, so the span
# covers the prompt only (a realized span would otherwise reach into the appended answer)
_REALIZED = {"semantic_tiers": ["verified"], "realize_spans": True, "request_options": True}


@dataclass(frozen=True)
class Arm:
    """One engine: ``extra`` is its ``kv_connector_extra_config``."""

    name: str
    mode: str
    provider: str | None
    extra: dict[str, Any]
    negatives_only: bool = False  # the wrong-donor control runs only the negative controls
    commit_policy: bool = False  # materialize_semantic needs CommitPolicyScheduler

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _arm(name: str, mode: str, provider: str | None, **extra: Any) -> Arm:
    config: dict[str, Any] = {"semantic_mode": mode, "donor_store_bytes": "1GiB", **extra}
    if provider is not None:
        config["provider"] = provider
    semantic = mode == "materialize_semantic"
    if semantic:
        config.setdefault("realize_spans", False)
    return Arm(name=name, mode=mode, provider=provider, extra=config, commit_policy=semantic,
               negatives_only=name == "wrong_donor")


# Every arm a preset may name. The semantic arms turn both non-exact tiers on with the DEFAULT
# gates (min_similarity 0.9, 256/512 tokens): the configuration that would ship if it passed.
# They measure one donor's KV over the span (realize_spans false, as docs/bench.md reports);
# realized spans have arms of their own (materialize_realized:*).
ARMS: dict[str, Arm] = {
    a.name: a for a in (
        _arm("disabled", "disabled", None),
        _arm("discovery_only:chunks", "discovery_only", "chunks"),
        _arm("discovery_only:minhash", "discovery_only", "minhash"),
        _arm("materialize_exact:chunks", "materialize_exact", "chunks"),
        _arm("materialize_semantic:minhash", "materialize_semantic", "minhash",
             semantic_tiers=_SEMANTIC_TIERS),
        # SemBlend's own discovery (peer provider); MiniLM lookups take tens of ms on CPU.
        _arm("materialize_semantic:semblend", "materialize_semantic", "semblend",
             semantic_tiers=_SEMANTIC_TIERS, lookup_timeout_ms=5000.0,
             provider_config={"embedder": "minilm"}),
        # The built-in embedding-ANN provider (MiniLM + faiss), same gates and lookup budget.
        _arm("materialize_semantic:embedding", "materialize_semantic", "embedding",
             semantic_tiers=_SEMANTIC_TIERS, lookup_timeout_ms=5000.0),
        _arm("materialize_semantic:semblend-jaccard", "materialize_semantic", "semblend",
             semantic_tiers=_SEMANTIC_TIERS, provider_config={"embedder": "jaccard"}),
        # Control: MinHash with an LSH threshold so low that any shared shingle (the chat
        # template, the system prompt) makes a candidate, and admission gates at zero, so the
        # nearest UNRELATED donor's KV is loaded into a negative control's blocks.
        _arm("wrong_donor", "materialize_semantic", "minhash",
             semantic_tiers=_SEMANTIC_TIERS, min_similarity=0.0, min_reuse_tokens=32,
             verified_min_reuse_tokens=32, semantic_min_reuse_tokens=32,
             provider_config={"threshold": 0.01}),
        # Realized spans: the verified tier only (identical tokens copied from one or more
        # donors, every other span token computed through the engine), default gates.
        # MinHash at its default LSH threshold (0.1; the former 0.3 missed a RAG target's
        # one-passage donors: each holds only 1/k of the target's shingles, Jaccard ~0.25-0.35
        # for k = 3-4). Admission still copies identical tokens only, so a loose discovery
        # cannot serve foreign KV (negatives measure that).
        _arm("materialize_realized:minhash", "materialize_semantic", "minhash", **_REALIZED),
        # chunk hashes find block-aligned shared runs at any offset (no threshold to tune)
        _arm("materialize_realized:chunks", "materialize_semantic", "chunks", **_REALIZED),
    )
}


# The frontier runner's arms (``runner="frontier"``): one engine, every arm a request option
# (``semkv.request_options``). ``cold``: lookup and saving off; ``fp8_floor``: the target's own
# KV loaded back through fp8; ``realized:*``: the recompute option laid over the engine's.
COLD, FLOOR = "cold", "fp8_floor"
STRATEGIES: dict[str, dict[str, Any]] = {
    "realized:none": {"strategy": "none"},
    "realized:first_k4": {"strategy": "first_k", "first_k": 4},  # halo sizes (issue #25)
    "realized:first_k8": {"strategy": "first_k", "first_k": 8},
    "realized:first_k16": {"strategy": "first_k", "first_k": 16},
    "realized:first_k32": {"strategy": "first_k", "first_k": 32},
    "realized:first_k64": {"strategy": "first_k", "first_k": 64},
    "realized:blend15": {"strategy": "blend", "fraction": 0.15},
    "realized:blend30": {"strategy": "blend", "fraction": 0.30},
    "realized:first_k16+blend15": {"strategy": "first_k_blend", "first_k": 16,
                                   "fraction": 0.15},
    "realized:blend50": {"strategy": "blend", "fraction": 0.50},
    "realized:query15": {"strategy": "query", "fraction": 0.15},
    "realized:query30": {"strategy": "query", "fraction": 0.30},
    "realized:query50": {"strategy": "query", "fraction": 0.50},  # where RAG reaches the floor
    "realized:queryv15": {"strategy": "query_valued", "fraction": 0.15},
    "realized:queryv30": {"strategy": "query_valued", "fraction": 0.30},
    "realized:queryv40": {"strategy": "query_valued", "fraction": 0.40},
    "realized:first_k16+query15": {"strategy": "first_k_query", "first_k": 16,
                                   "fraction": 0.15},
}
FRONTIER_ARMS = (COLD, FLOOR, *STRATEGIES)


@dataclass(frozen=True)
class BenchConfig:
    preset: str
    arms: tuple[str, ...]
    kinds: tuple[str, ...]
    clusters_per_type: int
    target_tokens: int  # approximate prompt length of every prompt
    max_tokens: int  # greedy output tokens per answer (ignore_eos: fixed output length)
    concurrency: int  # requests in flight in the throughput phase (1: the sequential phase)
    seed: int = 0
    block_size: int = 32
    kv_cache_bytes: int | None = None  # None: semkv.kv_sizing from max_model_len and seqs
    cores: str = "0"  # VLLM_CPU_OMP_THREADS_BIND for every engine
    # a bundled model's name or a model folder (semkv.bundled_model.served_as); None: SmolLM2
    model: str | None = None
    dtype: str | None = None  # None: float32 for a bundled model, else the model's own
    extra: dict[str, Any] = field(default_factory=dict)
    # "engines": one engine per arm (ARMS); "frontier": one engine, arms are request options
    # (FRONTIER_ARMS)
    runner: str = "engines"

    @property
    def max_model_len(self) -> int:
        # prompts are approximate (x1.25) and the log-likelihood run appends the answer
        return int(self.target_tokens * 1.25) + self.max_tokens + 256

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def validate(self) -> None:
        if self.runner == "frontier":
            self._validate_frontier()
            return
        if self.runner != "engines":
            raise ValueError(f"unknown bench runner {self.runner!r}")
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown:
            raise ValueError(f"unknown bench arm(s) {unknown}; known: {sorted(ARMS)}")
        if "disabled" not in self.arms:
            raise ValueError("every bench run needs the 'disabled' arm: speedups and cold "
                             "references are taken against it")
        self._validate_sizes()

    def _validate_sizes(self) -> None:
        from semkv.bundled_model import MODELS

        if self.model is not None and self.model not in MODELS \
                and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model {self.model!r}: neither a bundled model "
                             f"({', '.join(MODELS)}) nor a model folder with a config.json")
        bad = [k for k in self.kinds if k not in {c.value for c in ClusterKind}]
        if bad:
            raise ValueError(f"unknown cluster kind(s) {bad}")
        if self.concurrency < 1 or self.max_tokens < 1 or self.clusters_per_type < 1:
            raise ValueError("concurrency, max_tokens and clusters_per_type must be >= 1")

    def _validate_frontier(self) -> None:
        unknown = [a for a in self.arms if a not in FRONTIER_ARMS]
        if unknown:
            raise ValueError(f"unknown frontier arm(s) {unknown}; known: {list(FRONTIER_ARMS)}")
        if COLD not in self.arms or not any(a in STRATEGIES for a in self.arms):
            raise ValueError("a frontier run needs the 'cold' arm and at least one realized:* "
                             "strategy arm")
        self._validate_sizes()


_QUICK_KINDS = ("exact_control", "partial_overlap", "cross_instruction", "negative_unrelated",
                "negative_same_topic")
_REALIZED_KINDS = ("cross_instruction", "cross_instruction_task_first", "reordered_chunks",
                   "paraphrased_lead_in", "multi_passage_rag", "exact_control",
                   "negative_unrelated", "negative_same_topic")
_FRONTIER_KINDS = ("cross_instruction", "cross_instruction_task_first", "multi_passage_rag",
                   "reordered_chunks", "paraphrased_lead_in", "negative_unrelated",
                   "negative_same_topic")
_FRONTIER_ARMS = ("cold", "fp8_floor", "realized:none", "realized:first_k16",
                  "realized:blend15", "realized:first_k16+blend15")
PRESETS: dict[str, BenchConfig] = {
    # 5 targets (one cluster of five kinds), ~640-token prompts, 16 output tokens, five arms.
    "quick": BenchConfig(
        preset="quick",
        arms=("disabled", "discovery_only:chunks", "materialize_exact:chunks",
              "materialize_semantic:minhash", "wrong_donor"),
        kinds=_QUICK_KINDS, clusters_per_type=1, target_tokens=640, max_tokens=16,
        concurrency=1),
    # Every cluster kind, both peer providers, a throughput phase at concurrency 4: 2,106 s on
    # the 2-core machine (docs/bench.md has its results), measured before multi_passage_rag,
    # cross_instruction_task_first and quoted_section existed: they now add 6 targets and 11
    # donors to it.
    "full": BenchConfig(
        preset="full",
        arms=("disabled", "discovery_only:chunks", "discovery_only:minhash",
              "materialize_exact:chunks", "materialize_semantic:minhash",
              "materialize_semantic:semblend", "wrong_donor"),
        kinds=tuple(c.value for c in ClusterKind), clusters_per_type=2, target_tokens=768,
        max_tokens=32, concurrency=4),
    # Realized spans against the exact tier and the token swap, on the kinds a span plan
    # serves plus controls; 16 targets, 19 donors. `--clusters 1` took 689 s on the shared
    # 2-core machine (load 1-7); this preset (2 clusters) is est. ~20 min at that load, ~11 min
    # on a quiet machine (the disabled arm's miss phase ran ~8x slower under load than the
    # realized arm's: most of the 689 s is load). 32 output tokens as the full preset.
    "realized": BenchConfig(
        preset="realized",
        arms=("disabled", "materialize_exact:chunks", "materialize_semantic:minhash",
              "materialize_realized:minhash"),
        kinds=_REALIZED_KINDS, clusters_per_type=2, target_tokens=768, max_tokens=32,
        concurrency=1),
    # The quality-vs-recompute frontier of realized spans (issue #17): one engine, every arm a
    # request option (FRONTIER_ARMS), 16 targets per kind at ~1K tokens; both cores.
    "frontier": BenchConfig(
        preset="frontier", arms=_FRONTIER_ARMS, kinds=_FRONTIER_KINDS, clusters_per_type=16,
        target_tokens=1024, max_tokens=32, concurrency=1, runner="frontier", cores="0-1"),
    # The same at 4K+ tokens (a cold prefill is ~40 s on one core: few clusters, few arms).
    "frontier-long": BenchConfig(
        preset="frontier-long", arms=("cold", "fp8_floor", "realized:none",
                                      "realized:first_k16", "realized:first_k16+blend15"),
        kinds=("cross_instruction", "cross_instruction_task_first", "multi_passage_rag",
               "negative_same_topic"),
        clusters_per_type=2, target_tokens=4096, max_tokens=32, concurrency=1,
        runner="frontier", cores="0-1"),
}


def preset(name: str, **overrides: Any) -> BenchConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown bench preset {name!r}; known: {sorted(PRESETS)}")
    config = replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})
    config.validate()
    return config
