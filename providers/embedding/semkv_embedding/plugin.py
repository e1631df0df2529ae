"""Entry point of ``semkv-embedding``: registers the ``embedding`` provider with semkv."""

from collections.abc import Callable

import semkv
from semkv_embedding.provider import EmbeddingProvider


@semkv.hookimpl
def register_providers(register: Callable[..., None]) -> None:
    register(EmbeddingProvider)
