from collections.abc import Callable

import semkv
from semkv_chunks.provider import ChunksProvider


@semkv.hookimpl
def register_providers(register: Callable[..., None]) -> None:
    register(ChunksProvider)
