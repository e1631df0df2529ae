"""The entry point named in pyproject.toml: semkv's plugin host imports this module."""

from collections.abc import Callable

import semkv
from semkv_trigram.provider import TrigramProvider


@semkv.hookimpl
def register_providers(register: Callable[..., None]) -> None:
    register(TrigramProvider)
