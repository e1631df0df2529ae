"""Cache namespaces: KV may only ever be shared between requests of the same namespace.

A namespace is the set of everything that changes what a KV block means: model, weights and
tokenizer identity, numerics, paging layout, parallel layout, adapters, positional settings and the
tenant. Engine adapters fill it from the engine's own config (see ``semkv_vllm.namespace``).

NOTE: a field whose value the adapter could not determine is ``None`` ("unknown"), and a
namespace with any unknown field matches nothing, not even itself. "Known to be absent" is
spelled out as the string ``"none"``.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, ConfigDict

from semkv.types import FallbackReason

ABSENT = "none"


class Namespace(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model_id: str | None
    model_revision: str | None
    model_weights: str | None  # the weights' digest (semkv.model_identity.weights_identity)
    tokenizer_id: str | None
    tokenizer_revision: str | None
    tokenizer_settings: str | None  # mode, special tokens, chat template digest
    dtype: str | None
    kv_cache_dtype: str | None
    quantization: str | None  # the serving-time weight quantization (method, config)
    kv_quantization: str | None  # KV scales computed or loaded, layers kept unquantized
    block_size: int | None
    kv_layout: str | None
    attention_isa: str | None  # CPU attention kernels lay pages out per ISA
    attention_backend: str | None
    tensor_parallel_size: int | None
    pipeline_parallel_size: int | None
    rank_layout: str | None
    lora_identity: str | None
    positional: str | None  # rope theta / scaling / max positions, as canonical JSON
    cache_salt: str | None  # per-request salt or tenant

    @property
    def unknown_fields(self) -> tuple[str, ...]:
        return tuple(name for name, value in self if value is None)

    @property
    def is_complete(self) -> bool:
        return not self.unknown_fields

    @property
    def digest(self) -> str:
        """A stable hex digest; identical for identical field values across processes."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]

    def for_request(self, *, lora_identity: str | None, cache_salt: str | None) -> Namespace:
        """The namespace of one request: the engine's, plus its adapter and tenant.

        NOTE: present values are wrapped (``{"salt": ...}``) so that no tenant's salt or
        adapter name can equal ``ABSENT``: a request salted ``"none"`` once shared the
        namespace of unsalted requests.
        """
        return self.model_copy(
            update={
                "lora_identity": (canonical({"lora": lora_identity})
                                  if lora_identity is not None else ABSENT),
                "cache_salt": (canonical({"salt": cache_salt})
                               if cache_salt is not None else ABSENT),
            }
        )


def namespace_gate(request: Namespace, donor_digest: str) -> FallbackReason | None:
    """``None`` when a donor registered under ``donor_digest`` may serve ``request``."""
    if not request.is_complete or request.digest != donor_digest:
        return FallbackReason.NAMESPACE_MISMATCH
    return None


def canonical(value: object) -> str:
    """Canonical JSON for a nested settings value (used to fill string namespace fields)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def content_key(namespace: str, text: str) -> bytes:
    """A 16-byte key of ``text`` under ``namespace`` (a digest, salt included), for providers'
    content caches (embedded windows, embedded prompts): the same text under two namespaces
    never shares an entry, so no lookup answers faster because another tenant sent the text.
    The namespace goes in length first: no (namespace, text) pair aliases another."""
    digest = hashlib.blake2b(digest_size=16)
    ns = namespace.encode("utf-8", "surrogatepass")
    digest.update(len(ns).to_bytes(4, "little") + ns)
    digest.update(text.encode("utf-8", "surrogatepass"))
    return digest.digest()
