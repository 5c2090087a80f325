"""LRU: evict the least recently inserted-or-touched key.

Invariant: ``_order`` lists every tracked key from least to most recently used; ``insert`` and
``touch`` move a key to the most-recent end, so ``victim`` is the first key of ``_order`` the
predicate accepts (keys it refuses keep their place). All operations are O(1) except ``victim``,
which is O(number of refused keys before the answer).
"""

from __future__ import annotations

from collections import OrderedDict

from quillcache.policies.base import EvictionPolicy, Key, Predicate, always


class LruPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, size_bytes: int) -> None:
        self._add(key, size_bytes)
        self._order[key] = None

    def touch(self, key: Key) -> None:
        self._require(key)
        self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._drop(key)
        del self._order[key]

    def victim(self, is_evictable: Predicate = always) -> Key | None:
        for key in self._order:
            if is_evictable(key):
                return key
        return None
