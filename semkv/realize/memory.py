"""How much memory one realization holds at once: the one estimate the scheduler and the worker use.

A realization (``semkv_vllm.realization``) keeps a dense ``KVCache`` of its whole span for every
layer (the paged blocks are written once, at its end), reads one layer's local-prefix and donor
K/V at a time, and computes the positions its strategy selects one layer and at most
``chunk_tokens`` positions per call. Its working set, in bytes (``B`` the dtype's width, every
head count per tensor-parallel rank)::

    kv_row    = kv_heads x head_dim x 2 x B                 one token's K and V in one layer
    cache     = capacity x layers x kv_row                   the dense span KV
    probe     = probe_layers x span positions x kv_row       blend: reused K/V kept for ranking
    read      = 3 x max(read rows, span positions) x kv_row  one layer read, re-rotated, placed
                                                             (or written back at the end)
    carried   = 2 x computed x hidden x B                    a layer's input and output hidden
                                                             states of every computed position
    chunk     = chunk x (6 hidden + 3 q + 2 kv + 3 intermediate) x B     one call's activations
              + chunk x context x (1 + B)                    its chunk x context mask (boolean,
                                                             and the additive form SDPA builds)
    total     = cache + probe + max(read, carried + chunk)

``capacity`` is the span's end (the cache starts at position 0), ``read rows`` the local prefix
plus the donor blocks' rows one layer's read gathers, ``computed`` the positions the strategy
may compute (every span position for blend's probe layers), ``chunk`` = min(``chunk_tokens``,
computed), ``context`` the span's end (the longest any query attends over).

NOTE: an upper bound of what the job's own tensors take (tests/test_engine_long_realization.py
measures them), not of allocator slack or kernel scratch inside a call.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Geometry:
    """The per-rank shape of a model that a realization's memory depends on."""

    layers: int
    kv_heads: int  # this rank's, as every count below
    heads: int
    head_dim: int
    hidden: int  # the residual stream (not sharded)
    intermediate: int  # the MLP's width on this rank
    dtype_bytes: int

    @property
    def kv_row_bytes(self) -> int:
        """One token's K and V in one layer."""
        return self.kv_heads * self.head_dim * 2 * self.dtype_bytes


@dataclass(frozen=True)
class Budget:
    """What one realization may hold (``realize_memory_bytes``) and compute per layer call."""

    geometry: Geometry
    memory_bytes: int
    chunk_tokens: int | None  # positions per layer call (None: a layer at once)


def working_set(g: Geometry, *, span_tokens: int, local_tokens: int, read_rows: int,
                computed: int, probe_layers: int, chunk_tokens: int | None,
                cache_tokens: int | None = None) -> int:
    """Bytes one realization of this shape holds at its peak (module docstring).
    ``cache_tokens``: the dense cache's capacity when it holds more than the span (the query
    probe runs the prompt's tail there: ``semkv.realize.recompute.cache_tokens``)."""
    positions = span_tokens - local_tokens
    span_tokens = max(span_tokens, cache_tokens or 0)
    cache = span_tokens * g.layers * g.kv_row_bytes
    probe = min(probe_layers, g.layers) * positions * g.kv_row_bytes
    read = 3 * max(read_rows, positions) * g.kv_row_bytes
    chunk = computed if chunk_tokens is None else min(chunk_tokens, computed)
    q, kv = g.heads * g.head_dim, g.kv_heads * g.head_dim
    carried = 2 * computed * g.hidden * g.dtype_bytes
    activations = chunk * (6 * g.hidden + 3 * q + 2 * kv + 3 * g.intermediate) * g.dtype_bytes
    mask = chunk * span_tokens * (1 + g.dtype_bytes)
    return cache + probe + max(read, carried + activations + mask)


def over_budget(budget: Budget, needed: int) -> str | None:
    """Why a realization of ``needed`` bytes may not run (None when it fits)."""
    if needed <= budget.memory_bytes:
        return None
    return (f"needs {needed / 2**20:.1f} MiB, over realize_memory_bytes="
            f"{budget.memory_bytes} ({budget.memory_bytes / 2**20:.1f} MiB)")
