"""SortedDict backend: an ordered in-memory map (``sortedcontainers``) — the best pure-Python
ordered baseline (REFERENCE §6 cites its prefix-scan latency; ``results/storage`` measures it beside
the ART, RocksDB and flat-map backends in the same run).

Prefix scans are ``irange`` walks between the prefix and its successor, O(log N + k).
Durability is the flat map's: a whole-map msgpack snapshot at ``flush()``/``close()``.
"""

from __future__ import annotations

from collections.abc import Sequence

from sortedcontainers import SortedDict

from quillcache.index import keys as K
from quillcache.index.flat import FlatIndex


def prefix_end(prefix: bytes) -> bytes | None:
    """The smallest byte string greater than every string starting with ``prefix`` (None: no bound)."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        return None
    p[-1] += 1
    return bytes(p)


class SortedIndex(FlatIndex):
    kind = "sorted"

    @staticmethod
    def _new_map() -> SortedDict:
        return SortedDict()

    def _apply_put(self, k: bytes, v: bytes) -> None:
        self._map[k] = v

    def _raw_write(self, puts: Sequence[tuple[bytes, bytes]], deletes: Sequence[bytes]) -> None:
        m = self._map
        for k, v in puts:
            m[k] = v
        for k in deletes:
            m.pop(k, None)

    def _raw_scan(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        m = self._map
        end = prefix_end(prefix)
        keys = m.irange(prefix, end, inclusive=(True, False)) if end is not None else m.irange(prefix)
        return [(k, m[k]) for k in keys]

    def _raw_scan_many(self, prefixes: Sequence[bytes]) -> list[list[tuple[bytes, bytes]]]:
        return [self._raw_scan(p) for p in prefixes]

    def __len__(self) -> int:
        """The number of replicas (primary records), as every backend counts (O(log N))."""
        self._check_open()
        m = self._map
        return m.bisect_left(prefix_end(K.PRIMARY)) - m.bisect_left(K.PRIMARY)
