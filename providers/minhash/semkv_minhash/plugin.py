"""Entry point of ``semkv-minhash``: registers the ``minhash`` provider with semkv."""

from collections.abc import Callable

import semkv
from semkv_minhash.provider import MinHashProvider


@semkv.hookimpl
def register_providers(register: Callable[..., None]) -> None:
    register(MinHashProvider)
