"""Per-request options: what one request may ask of semkv through ``kv_transfer_params``.

Protocol: a client sends ``{"kv_transfer_params": {"semkv_options": {...}}}`` (OpenAI server:
``extra_body``; ``LLM``: ``SamplingParams(extra_args={"kv_transfer_params": ...})``). Two kinds:

Opt-outs (``OPT_OUTS``: always safe, they only mean less reuse) are read whenever the operator
leaves ``request_options`` on (the default):

- ``lookup: false``: no donor is looked up for this request (it prefills normally);
- ``save: false``: its prompt never becomes a donor;
- ``reuse_until: n``: semkv places no KV at prompt positions ``>= n`` (the span or load ends
  at the last block boundary at or before it): scoring a continuation appended to a prompt
  (``prompt_logprobs``) gets every continuation position computed by vLLM, with its logprobs.

Overrides (``OVERRIDES``: they could reuse more, recompute less or change the KV) are refused,
dropped and counted, unless the operator names them in ``request_overrides``:

- ``recompute``: the recompute strategy of this request's realized span (the ``recompute_*``
  keys' values for this request only; unset fields keep the engine's). Where the gate policy
  certifies the plan's class with a strategy, a request's strategy is used only if it
  recomputes at least what the policy's does (``semkv.realize.selection.covers``);
- ``kv_floor: "fp8_e4m3"`` (measurement): KV that semkv places for this request is rounded
  through fp8 e4m3 with one scale per layer for K and one for V (amax / 448), as an fp8 KV
  cache stores it. Loading a target's own stored KV this way gives the noise floor that
  ``--kv-cache-dtype fp8`` deployments accept (``semkv bench --preset frontier``);
- ``text``: the prompt's text for providers that embed text rather than token ids.

A request that sends an option changing its KV (``kv_floor``, ``recompute``; ``changes_kv``) is
REQUEST_ONLY and never saved: nothing it computed becomes prefix-cache state or a donor. Bad
options (unknown keys, wrong types) end in the exact tier only (the request's stored exact
prefix, as any request is served; no lookup, no non-identical reuse), counted as
``lookup_errors{kind="request_options"}``: nothing fails because of them.

NOTE: no torch, no vLLM here; the adapter turns ``recompute`` into the engine's strategy.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

OPTIONS_KEY = "semkv_options"
OPT_OUTS = ("lookup", "save", "reuse_until")
OVERRIDES = ("recompute", "kv_floor", "text")
MAX_TEXT_CHARS = 1_000_000


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
    text: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)

    def overrides(self) -> list[str]:
        """The overrides this request sends (``OVERRIDES`` that are set)."""
        return [name for name in OVERRIDES if getattr(self, name) is not None]

    def without(self, names: list[str]) -> RequestOptions:
        """These options with the overrides ``names`` dropped."""
        return self.model_copy(update=dict.fromkeys(names)) if names else self

    @property
    def changes_kv(self) -> bool:
        """Does an option change the KV this request gets (its reuse is then request-only)?"""
        return self.kv_floor is not None or self.recompute is not None


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
