"""Entry point of the ``semblend`` provider (``[project.entry-points.semkv]``).

Importing it never imports ``semblend``: a missing SemBlend surfaces as an ImportError from the
provider's constructor, naming what to install, not as a broken plugin host.
"""

from collections.abc import Callable

import semkv
from semkv_semblend.provider import SemBlendProvider


@semkv.hookimpl
def register_providers(register: Callable[..., None]) -> None:
    register(SemBlendProvider)
