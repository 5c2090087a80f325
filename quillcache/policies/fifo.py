"""FIFO: evict the earliest inserted key; hits change nothing.

Invariant: ``_order`` lists every tracked key in insertion order; ``victim`` is the first key the
predicate accepts. O(1) operations; ``victim`` is O(number of refused keys before the answer).
"""

from __future__ import annotations

from collections import OrderedDict

from quillcache.policies.base import EvictionPolicy, Key, Predicate, always


class FifoPolicy(EvictionPolicy):
    name = "fifo"

    def __init__(self) -> None:
        super().__init__()
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, size_bytes: int) -> None:
        self._add(key, size_bytes)
        self._order[key] = None

    def touch(self, key: Key) -> None:
        self._require(key)

    def remove(self, key: Key) -> None:
        self._drop(key)
        del self._order[key]

    def victim(self, is_evictable: Predicate = always) -> Key | None:
        for key in self._order:
            if is_evictable(key):
                return key
        return None
