"""What differs between the vLLM releases semkv supports (0.32 to 0.34), read in one place.

Each function reads the newer field where the running vLLM has it and the older one where it
does not, so the rest of the adapter never asks which release it runs on.
"""

from __future__ import annotations

from typing import Any


def skips_external_kv(request: Any) -> bool:
    """Whether vLLM discards a connector's hit for ``request``: it is asked, but the scheduler
    schedules the request from its local prefix only. 0.34: ``skip_reading_external_kv``
    (a bounded request: ``skip_reading_prefix_cache``, or prompt logprobs, whose scored rows
    must be computed); 0.32 and 0.33: ``skip_reading_prefix_cache`` (prompt logprobs set it
    unless the client says otherwise)."""
    flag = getattr(request, "skip_reading_external_kv", None)
    if flag is None:
        flag = getattr(request, "skip_reading_prefix_cache", False)
    return bool(flag)
