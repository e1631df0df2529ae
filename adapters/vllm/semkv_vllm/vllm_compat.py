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


def kv_cache_access(donor_store: str, *, on_cuda: bool) -> Any:
    """vLLM 0.34's ``KVCacheAccess`` flags for semkv's workers (None before 0.34: no such hook).

    semkv's own store (``donor_store: host``) reads and writes the KV cache with torch copies in
    the worker process: ``IN_PROCESS``, any allocation works. With ``donor_store: lmcache`` the
    LMCache server reads and writes it from its own process: on a GPU through legacy CUDA IPC
    handles (LMCache 0.5.6's default, unless its ``use_vmm_api``), so ``LEGACY_IPC`` (vLLM then
    keeps its extensible KV cache off); on a CPU engine LMCache's worker side copies in process.
    """
    try:
        from vllm.config.kv_transfer import KVCacheAccess
    except ImportError:
        return None
    if donor_store == "lmcache" and on_cuda:
        return KVCacheAccess.LEGACY_IPC
    return KVCacheAccess.IN_PROCESS
