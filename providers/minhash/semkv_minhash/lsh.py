"""Band tables of MinHash LSH: the compact default and datasketch's ``MinHashLSH``.

Both take datasketch's band parameters ``(b, r)`` (optimized by ``MinHashLSH`` for the
configured threshold) and the same band keys (each band's hash values, byte-swapped, as
datasketch's dict storage keys them), so they return the same candidates for the same
signatures (the tests check it).

Why a compact default: datasketch's dict storage keeps one Python set per band bucket, about 40
garbage-collected containers per donor. A full collection of the cyclic GC then walks all of
them with the GIL held: measured 0.65 s at 10K donors and 6.6 s at 100K on a 2-core CPU, a
pause for the whole serving process whenever Python decides to run one. ``CompactLSH`` stores
a bucket holding one donor as a plain ``str`` (not tracked by the GC) and only shared buckets as
sets; per-donor state lives in a few large dicts. Lookups are also cheaper: the band keys are
slices of one byte string instead of one array copy per band.

Not thread-safe by themselves: the provider serializes every call under its lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    from semkv_minhash.sketch import ShingleSketcher


class BandIndex(Protocol):
    def insert(self, key: str, signature: NDArray[np.uint32]) -> None: ...

    def remove(self, key: str, signature: NDArray[np.uint32]) -> None: ...

    def query(self, signature: NDArray[np.uint32]) -> set[str]: ...


def band_keys(signature: NDArray[np.uint32], params: tuple[int, int]) -> list[bytes]:
    """datasketch's band keys: ``bytes(signature[i*r:(i+1)*r].byteswap().data)`` per band."""
    bands, rows = params
    raw = signature.byteswap().tobytes()
    width = rows * signature.itemsize
    return [raw[i * width : (i + 1) * width] for i in range(bands)]


class CompactLSH:
    def __init__(self, params: tuple[int, int]) -> None:
        self.params = params
        self.tables: list[dict[bytes, str | set[str]]] = [{} for _ in range(params[0])]

    def insert(self, key: str, signature: NDArray[np.uint32]) -> None:
        for table, band in zip(self.tables, band_keys(signature, self.params), strict=True):
            held = table.get(band)
            if held is None:
                table[band] = key
            elif isinstance(held, set):
                held.add(key)
            elif held != key:
                table[band] = {held, key}

    def remove(self, key: str, signature: NDArray[np.uint32]) -> None:
        for table, band in zip(self.tables, band_keys(signature, self.params), strict=True):
            held = table.get(band)
            if held == key:
                del table[band]
            elif isinstance(held, set):
                held.discard(key)
                if len(held) == 1:  # back to an untracked plain string
                    table[band] = next(iter(held))

    def query(self, signature: NDArray[np.uint32]) -> set[str]:
        found: set[str] = set()
        for table, band in zip(self.tables, band_keys(signature, self.params), strict=True):
            held = table.get(band)
            if held is None:
                continue
            if isinstance(held, set):
                found |= held
            else:
                found.add(held)
        return found


class DatasketchLSH:
    """``datasketch.MinHashLSH`` behind the same interface (``lsh: datasketch``)."""

    def __init__(self, params: tuple[int, int], sketcher: ShingleSketcher) -> None:
        from datasketch import MinHashLSH

        self._sketcher = sketcher
        self._lsh: Any = MinHashLSH(num_perm=sketcher.num_perm, params=params)

    def insert(self, key: str, signature: NDArray[np.uint32]) -> None:
        self._lsh.insert(key, self._sketcher.minhash(signature), check_duplication=False)

    def remove(self, key: str, signature: NDArray[np.uint32]) -> None:
        if key in self._lsh:
            self._lsh.remove(key)

    def query(self, signature: NDArray[np.uint32]) -> set[str]:
        return set(self._lsh.query(self._sketcher.minhash(signature)))
