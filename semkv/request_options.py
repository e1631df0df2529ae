"""Per-request options: what one request may ask of semkv through ``kv_transfer_params``.

Protocol: a client sends ``{"kv_transfer_params": {"semkv_options": {...}}}`` (OpenAI server:
``extra_body``; ``LLM``: ``SamplingParams(extra_args={"kv_transfer_params": ...})``). The
connector reads them only when the operator set ``request_options: true``; otherwise they are
ignored (and counted), so a client can never change how an engine reuses KV unless allowed.

- ``lookup: false``: no donor is looked up for this request (it prefills normally);
- ``save: false``: its prompt never becomes a donor;
- ``recompute``: the recompute strategy of this request's realized span (the ``recompute_*``
  keys' values for this request only; unset fields keep the engine's);
- ``reuse_until: n``: semkv places no KV at prompt positions ``>= n`` (the span or load ends
  at the last block boundary at or before it): scoring a continuation appended to a prompt
  (``prompt_logprobs``) gets every continuation position computed by vLLM, with its logprobs;
- ``kv_floor: "fp8_e4m3"`` (measurement): KV that semkv places for this request is rounded
  through fp8 e4m3 with one scale per layer for K and one for V (amax / 448), as an fp8 KV
  cache stores it. Loading a target's own stored KV this way gives the noise floor that
  ``--kv-cache-dtype fp8`` deployments accept (``semkv bench --preset frontier``).

Every option changes only the requesting request's own KV (reuse stays REQUEST_ONLY). Bad
options (unknown keys, wrong types) end in the exact tier only (the request's stored exact
prefix, as any request is served; no lookup, no non-identical reuse), counted as
``lookup_errors{kind="request_options"}``: nothing fails because of them.

NOTE: no torch, no vLLM here; the adapter turns ``recompute`` into the engine's strategy.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

OPTIONS_KEY = "semkv_options"


class RecomputeOverride(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: Literal["none", "first_k", "blend", "first_k_blend", "query",
                      "first_k_query", "query_valued"] | None = None
    fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    first_k: int | None = Field(default=None, ge=1)
    probe_layers: int | None = Field(default=None, ge=1)
    query_tokens: int | None = Field(default=None, ge=1)


class RequestOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    lookup: bool = True
    save: bool = True
    recompute: RecomputeOverride | None = None
    reuse_until: int | None = Field(default=None, ge=1)
    kv_floor: Literal["fp8_e4m3"] | None = None


class BadRequestOptions(ValueError):
    """A request's ``semkv_options`` do not parse (the message names the field, no values)."""


def parse_options(params: Any) -> RequestOptions | None:
    """The options in a request's ``kv_transfer_params`` (None: it sent none)."""
    if not isinstance(params, dict) or OPTIONS_KEY not in params:
        return None
    try:
        return RequestOptions.model_validate(params[OPTIONS_KEY])
    except ValidationError as exc:
        fields = sorted({".".join(str(p) for p in e["loc"]) or OPTIONS_KEY
                         for e in exc.errors()})
        raise BadRequestOptions(f"{OPTIONS_KEY}: invalid field(s) {fields}") from None


def request_params(**options: Any) -> dict[str, Any]:
    """``kv_transfer_params`` carrying ``options`` (validated here, client side)."""
    return {OPTIONS_KEY: RequestOptions.model_validate(options).model_dump(exclude_none=True)}
