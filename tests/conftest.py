"""Suite-wide settings.

NOTE: the fault-injecting provider (``faulty``, ``semkv.testing``) is refused unless
``SEMKV_ALLOW_FAULT_INJECTION=1``; the suite selects it on purpose, in this process and in the
engine processes it spawns (they inherit the environment).
"""

from __future__ import annotations

import os

os.environ.setdefault("SEMKV_ALLOW_FAULT_INJECTION", "1")
