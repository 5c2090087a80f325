"""ARC (Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST '03).

Lists: ``T1`` (keys seen once recently) and ``T2`` (seen at least twice), both LRU and holding
data; ghosts ``B1`` and ``B2`` (keys recently evicted from T1 and T2, no data); a target size
``p`` for T1, adapted online (no parameter to tune).

- admit(x) of a key remembered in B1: ``p = min(c, p + max(1, |B2| / |B1|))``; in B2:
  ``p = max(0, p - max(1, |B1| / |B2|))`` (the adaptation happens once per miss, before the
  victim is chosen, as in the paper; ``insert`` adapts if ``admit`` was not called for the key).
- victim (REPLACE): T1's LRU key if T1 is non-empty and (``|T1| > p``, or the incoming key is in
  B2 and ``|T1| == p``, or T2 is empty); else T2's LRU key. ``evict`` moves it to the MRU end of
  B1 or B2.
- insert(x): a ghost hit goes to T2's MRU end (and leaves its ghost list); any other key to T1's.
  Then the ghosts are trimmed as in libCacheSim's ARC: B1's LRU key is dropped while
  ``|T1| + |B1| > c``, B2's while ``|T1| + |T2| + |B1| + |B2| > 2c``.
- touch (hit, in T1 or T2): move to T2's MRU end.

``c`` is ``capacity_keys`` when given, else the largest number of keys tracked so far. A key the
predicate refuses is passed over (its place kept); ``remove`` leaves no history.
"""

from __future__ import annotations

from collections import OrderedDict

from quillcache._checks import check_int
from quillcache.policies.base import EvictionPolicy, Key, Predicate, always, check_size


class ArcPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, *, capacity_keys: int | None = None) -> None:
        super().__init__()
        self.capacity_keys = None if capacity_keys is None else check_int("capacity_keys", capacity_keys, 1)
        self._t1: OrderedDict[Key, None] = OrderedDict()
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self._p = 0.0
        self._peak = 0
        self._adapted: Key | None = None  # the key whose ghost hit already moved p
        self._adapted_set = False

    @property
    def p(self) -> float:
        return self._p

    def _cap(self) -> int:
        return self.capacity_keys if self.capacity_keys is not None else max(self._peak, 1)

    def list_of(self, key: Key) -> str:
        for name, lst in (("t1", self._t1), ("t2", self._t2), ("b1", self._b1), ("b2", self._b2)):
            if key in lst:
                return name
        raise KeyError(key)

    def _adapt(self, key: Key) -> None:
        c = float(self._cap())
        if key in self._b1:
            self._p = min(c, self._p + max(1.0, len(self._b2) / len(self._b1)))
        elif key in self._b2:
            self._p = max(0.0, self._p - max(1.0, len(self._b1) / len(self._b2)))
        self._adapted, self._adapted_set = key, True

    def admit(self, key: Key, size_bytes: int) -> bool:
        check_size(size_bytes)
        if key not in self._sizes:
            self._adapt(key)
        return True

    def insert(self, key: Key, size_bytes: int) -> None:
        self._add(key, size_bytes)
        self._peak = max(self._peak, len(self._sizes))
        if not (self._adapted_set and self._adapted == key):
            self._adapt(key)
        self._adapted, self._adapted_set = None, False
        if key in self._b1 or key in self._b2:
            self._b1.pop(key, None)
            self._b2.pop(key, None)
            self._t2[key] = None
        else:
            self._t1[key] = None
        c = self._cap()
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c:
            self._b2.popitem(last=False)

    def touch(self, key: Key) -> None:
        self._require(key)
        if key in self._t1:
            del self._t1[key]
        else:
            del self._t2[key]
        self._t2[key] = None

    def _forget(self, key: Key) -> bool:
        self._drop(key)
        if key in self._t1:
            del self._t1[key]
            return True
        del self._t2[key]
        return False

    def remove(self, key: Key) -> None:
        self._forget(key)

    def evict(self, key: Key) -> None:
        (self._b1 if self._forget(key) else self._b2)[key] = None

    def victim(self, is_evictable: Predicate = always) -> Key | None:
        incoming_in_b2 = self._adapted_set and self._adapted in self._b2
        n1 = len(self._t1)
        from_t1 = n1 > 0 and (n1 > self._p or (incoming_in_b2 and n1 == self._p) or not self._t2)
        for lst in ((self._t1, self._t2) if from_t1 else (self._t2, self._t1)):
            for key in lst:
                if is_evictable(key):
                    return key
        return None
