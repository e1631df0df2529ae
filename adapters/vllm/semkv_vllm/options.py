"""Per-request options (``semkv.request_options``) on the engine: read once, applied where due.

The scheduler reads a request's options when it registers it (``read_options``): with
``request_options`` on (the default), its opt-outs, and the overrides ``request_overrides``
names (others are dropped, counted ``request_options_refused{option}``); off, present options
are ignored and counted. Its recompute strategy (``strategy_for``: the engine's with the
request's fields laid over) is built then, once, and the span admission plans with it (never
below the gate policy's strategy for the plan's class); loads and realizations carry
``kv_floor`` to the worker, which rounds the KV it placed with ``round_blocks_fp8``.

NOTE: an fp8 floor scale is per layer and per K / V over the request's placed blocks on one
worker; with tensor parallelism each rank scales its own heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from semkv.config import SemkvConfig
from semkv.metrics import CounterBag
from semkv.request_options import OPTIONS_KEY, RequestOptions, parse_options
from semkv.types import QualityTier, SemanticKVMatch

if TYPE_CHECKING:
    import torch

    from semkv.realize.recompute import RecomputeStrategy
    from semkv_vllm.page_layout import PageLayout

BAD = "request_options"  # lookup_errors kind: options that do not parse (exact tier only)
IGNORED = "request_options_ignored"  # lookup_errors kind: options sent, not allowed


def read_options(request: Any, config: SemkvConfig, stats: CounterBag, base: RecomputeStrategy,
                 ) -> tuple[RequestOptions | None, RecomputeStrategy, bool]:
    """(options, recompute strategy, bad): the request's options and the strategy its span
    would be realized with (``base``, the engine's, when it sends none); bad when options were
    sent and do not parse, or its recompute fields do not make a valid strategy over ``base``."""
    params = getattr(request, "kv_transfer_params", None)
    if not config.request_options:
        if isinstance(params, dict) and OPTIONS_KEY in params:
            stats.inc("lookup_errors", IGNORED)
        return None, base, False
    try:
        options = parse_options(params)
    except ValueError:  # BadRequestOptions
        stats.inc("lookup_errors", BAD)
        return None, base, True
    if options is not None:
        refused = [o for o in options.overrides() if o not in config.request_overrides]
        for name in refused:
            stats.inc("request_options_refused", name)
        options = options.without(refused)
    try:
        return options, strategy_for(base, options), False
    except ValueError:  # recompute fields that make no valid strategy over the engine's
        stats.inc("lookup_errors", BAD)
        return None, base, True


def strategy_for(base: RecomputeStrategy, options: RequestOptions | None) -> RecomputeStrategy:
    """The engine's strategy with this request's ``recompute`` fields laid over it."""
    if options is None or options.recompute is None:
        return base
    fields = options.recompute.model_dump(exclude_none=True)
    if "strategy" in fields:
        fields["kind"] = fields.pop("strategy")
    return replace(base, **fields)


def cap_match(match: SemanticKVMatch, until: int | None, block_size: int,
              ) -> SemanticKVMatch | None:
    """An exact-tier ``match`` ending at the last block boundary at or before ``until`` (None:
    nothing of it is left). Other tiers' single-donor spans are not cut: None when they reach
    past ``until``."""
    if until is None or not match.is_hit:
        return match
    end = match.local_prefix_tokens + match.external_prefix_tokens
    if end <= until:
        return match
    if match.quality_tier is not QualityTier.EXACT:
        return None
    external = until - until % block_size - match.local_prefix_tokens
    if external <= 0:
        return None
    return match.model_copy(update={"external_prefix_tokens": external,
                                    "donor_prefix_tokens": match.local_prefix_tokens + external})


def round_blocks_fp8(kv: torch.Tensor, block_ids: Sequence[int], layout: PageLayout) -> None:
    """Round the K and the V of ``block_ids`` in one layer's ``kv`` through fp8, in place."""
    import torch

    from semkv.realize.fp8 import round_fp8

    if not block_ids:
        return
    pages = kv.index_select(0, torch.as_tensor(list(block_ids), dtype=torch.long,
                                               device=kv.device))
    keys, values = layout.read(pages)
    layout.write(kv, block_ids, round_fp8(keys), round_fp8(values))
