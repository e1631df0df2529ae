"""Suite-wide settings.

NOTE: the fault-injecting provider (``faulty``, ``semkv.testing``) is refused unless
``SEMKV_ALLOW_FAULT_INJECTION=1``; the suite selects it on purpose, in this process and in the
engine processes it spawns (they inherit the environment).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.engine_utils import EnginePool

os.environ.setdefault("SEMKV_ALLOW_FAULT_INJECTION", "1")


@pytest.fixture(scope="session")
def engines() -> Iterator[EnginePool]:
    """The session's shared engines (``tests.engine_utils.EnginePool``), shut down at its end."""
    from tests.engine_utils import POOL

    try:
        yield POOL
    finally:
        POOL.close()
