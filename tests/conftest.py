"""Suite-wide settings.

``make test`` runs the suite in two pytest-xdist workers (``-n 2 --dist loadfile``): a module's
tests stay on one worker, so a module-scoped engine is started once. Each worker, and every
engine and child process it starts, is pinned to its own share of the CPUs (one core each on
this 2-core machine), so two engines never contend for one core and each module's timed
comparisons (cold against reuse) run on one core throughout. Modules that start engines are
sent first (the longest jobs first keeps the two workers' finishing times close).

NOTE: the fault-injecting provider (``faulty``, ``semkv.testing``) is refused unless
``SEMKV_ALLOW_FAULT_INJECTION=1``; the suite selects it on purpose, in this process and in the
engine processes it spawns (they inherit the environment).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("SEMKV_ALLOW_FAULT_INJECTION", "1")


def _pin_xdist_worker() -> None:
    """This worker's share of the CPUs (worker i of n takes every n-th CPU from the i-th), as
    its affinity and OpenMP's thread count; its children inherit both. Outside xdist, or with
    fewer CPUs than workers, nothing changes."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < count:
        return
    mine = set(cpus[int(worker.removeprefix("gw"))::count])
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))  # read when torch starts its thread pool


_pin_xdist_worker()


def _stand_in_for_triton_cpu() -> None:
    """``make test-cuda-build`` runs the CUDA build's Python over the CPU platform
    (scripts/cuda_build_check.sh). From vLLM 0.34 that platform refuses an x86 machine without
    triton-cpu (``RuntimeError: vLLM on x86 CPUs requires Triton (triton-cpu)``), which only its
    model runner's kernels need; the check runs no kernel. A stand-in, named so: vLLM is told
    Triton is there, only when the script sets ``CUDA_BUILD_TRITON_CPU_STANDIN=1``."""
    if os.environ.get("CUDA_BUILD_TRITON_CPU_STANDIN") != "1":
        return
    import vllm.triton_utils

    vllm.triton_utils.HAS_TRITON = True  # read by CpuPlatform.check_and_update_config


_stand_in_for_triton_cpu()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with engine tests first, otherwise in collection order (stable).

    NOTE: every xdist worker collects and must order identically (it does: the order depends
    on the items only); ``make test`` passes ``--no-loadscope-reorder`` so xdist keeps it.
    """
    engine_files = {item.path for item in items if item.get_closest_marker("engine")}
    items.sort(key=lambda item: item.path not in engine_files)
