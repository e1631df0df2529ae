"""A fault-injecting provider for tests and chaos runs: ``provider: faulty``.

It wraps any installed provider (``inner``) and, for a seeded random fraction (``rate``) of
lookups, misbehaves in the chosen way instead of answering. It is registered through the
``semkv`` entry-point group like any provider, so it can be selected in a real engine::

    {"provider": "faulty", "provider_config": {"inner": "chunks", "faults": ["raise", "hang"],
                                               "rate": 0.5}}

Fault kinds: ``raise`` (an exception), ``hang`` (sleeps ``hang_seconds``, past any budget),
``garbage`` (a non-list answer), ``foreign`` (candidates from another namespace),
``out_of_range`` (spans past the end of the prompt), ``unknown_donor`` (an id never registered),
``negative`` (negative span offsets and counts), ``unaligned`` (a span that starts and ends
inside blocks), ``nan_similarity`` (a NaN similarity).

NOTE: malformed candidates are built with ``model_copy(update=...)``, which skips pydantic's
validation, exactly as a careless provider could; the guard must re-validate them.
NOTE: every injected fault is logged as ``fault_injected`` with its kind (no request data), so
a chaos run can count faults by kind from the engine's log.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

import semkv
from semkv.log import get_logger
from semkv.provider import LookupQuery, ProviderContext
from semkv.testing.delegating import DelegatingProvider
from semkv.types import Candidate

FaultKind = Literal["raise", "hang", "garbage", "foreign", "out_of_range", "unknown_donor",
                    "negative", "unaligned", "nan_similarity"]
_DEFAULT_FAULTS: list[FaultKind] = ["raise"]
log = get_logger("semkv.testing.faults")


class FaultyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    inner: str = "chunks"
    inner_config: dict[str, Any] = Field(default_factory=dict)
    faults: list[FaultKind] = Field(default_factory=lambda: _DEFAULT_FAULTS.copy(), min_length=1)
    rate: float = Field(default=1.0, ge=0.0, le=1.0)
    hang_seconds: float = Field(default=2.0, ge=0.0)
    seed: int = 0


class FaultyProvider(DelegatingProvider):
    name = "faulty"
    fault_injection = True  # excluded from the conformance kit's default run
    Config = FaultyConfig
    config: FaultyConfig

    def __init__(self, config: BaseModel, context: ProviderContext) -> None:
        from semkv.plugins import get_provider_class

        assert isinstance(config, FaultyConfig)
        inner = get_provider_class(config.inner).from_config(config.inner_config, context)
        super().__init__(inner, config, context)
        self._rng = random.Random(self.config.seed)
        self._lock = threading.Lock()
        self.injected: Counter[str] = Counter()

    def _pick(self) -> str | None:
        with self._lock:
            if self._rng.random() >= self.config.rate:
                return None
            kind = self._rng.choice(self.config.faults)
            self.injected[kind] += 1
        log.info("fault_injected", kind=kind)
        return kind

    def lookup(self, query: LookupQuery) -> list[Candidate]:
        kind = self._pick()
        if kind is None:
            return self.inner.lookup(query)
        if kind == "raise":
            raise RuntimeError("injected provider fault")
        if kind == "hang":
            time.sleep(self.config.hang_seconds)
            return self.inner.lookup(query)
        if kind == "garbage":
            return {"not": "a list"}  # type: ignore[return-value]
        found = self.inner.lookup(query) or [
            Candidate(donor_id="ghost", namespace=query.namespace, similarity=1.0)]
        first = found[0]
        if kind == "foreign":
            return [first.model_copy(update={"namespace": "another-namespace"})]
        if kind == "out_of_range":
            return [first.model_copy(update={"num_tokens": len(query.token_ids) + 64})]
        if kind == "negative":
            return [first.model_copy(update={"donor_start": -1, "num_tokens": -64})]
        if kind == "unaligned":
            bs = self.context.block_size if self.context is not None else 16
            span = max(min(len(query.token_ids) - 5, 3 * bs + 1), 0)
            return [first.model_copy(update={"target_start": min(5, len(query.token_ids)),
                                             "donor_start": 5, "num_tokens": span})]
        if kind == "nan_similarity":
            return [first.model_copy(update={"similarity": float("nan")})]
        return [first.model_copy(update={"donor_id": "never-registered"})]

    def stats(self) -> dict[str, float]:
        return {f"injected_{k}": float(v) for k, v in self.injected.items()}


@semkv.hookimpl
def register_providers(register: Callable[..., None]) -> None:
    register(FaultyProvider)
