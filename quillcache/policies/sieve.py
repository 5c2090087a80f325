"""SIEVE (Zhang et al., "SIEVE is Simpler than LRU: an Efficient Turn-Key Eviction Algorithm for
Web Caches", NSDI '24).

One FIFO queue (oldest to newest) with a ``visited`` bit per key and a *hand*:

- insert: the key joins the newest end, ``visited = False``; touch (hit): ``visited = True``.
- victim: start at the hand (or at the oldest key when the hand is unset); while the key there is
  visited, clear its bit and move the hand one step toward the newer end (wrapping from the
  newest to the oldest); the first unvisited key is the victim. Keys are never moved: survivors
  stay in place, which is what separates SIEVE from CLOCK/FIFO-reinsertion.
- evict(victim): the hand moves to the victim's newer neighbour (unset if there is none, so the
  next scan starts again at the oldest key); the key leaves.

Protocol adaptations: a key the predicate refuses is passed over like a visited key (its bit is
cleared on the way); a scan visits at most two laps, so ``victim`` ends even when every key is
refused. ``remove`` of the key under the hand moves the hand the same way as ``evict``.
Clearing bits during ``victim`` is the queue reorganisation the protocol allows.
"""

from __future__ import annotations

from quillcache.policies.base import EvictionPolicy, Key, Predicate, always


class SievePolicy(EvictionPolicy):
    name = "sieve"

    def __init__(self) -> None:
        super().__init__()
        self._older: dict[Key, Key | None] = {}
        self._newer: dict[Key, Key | None] = {}
        self._oldest: Key | None = None
        self._newest: Key | None = None
        self._visited: dict[Key, bool] = {}
        self._hand: Key | None = None

    def visited(self, key: Key) -> bool:
        self._require(key)
        return self._visited[key]

    @property
    def hand(self) -> Key | None:
        return self._hand

    def insert(self, key: Key, size_bytes: int) -> None:
        self._add(key, size_bytes)
        self._older[key] = self._newest
        self._newer[key] = None
        if self._newest is None:
            self._oldest = key
        else:
            self._newer[self._newest] = key
        self._newest = key
        self._visited[key] = False

    def touch(self, key: Key) -> None:
        self._require(key)
        self._visited[key] = True

    def remove(self, key: Key) -> None:
        self._drop(key)
        if self._hand == key:
            self._hand = self._newer[key]
        o, n = self._older.pop(key), self._newer.pop(key)
        if o is None:
            self._oldest = n
        else:
            self._newer[o] = n
        if n is None:
            self._newest = o
        else:
            self._older[n] = o
        del self._visited[key]

    def victim(self, is_evictable: Predicate = always) -> Key | None:
        if not self._sizes:
            return None
        cur = self._hand if self._hand is not None else self._oldest
        for _ in range(2 * len(self._sizes) + 1):
            if self._visited[cur] or not is_evictable(cur):
                self._visited[cur] = False
                nxt = self._newer[cur]
                cur = nxt if nxt is not None else self._oldest
                continue
            self._hand = cur
            return cur
        self._hand = cur
        return None
