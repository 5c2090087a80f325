"""2Q (Johnson and Shasha, "2Q: A Low Overhead High Performance Buffer Management Replacement
Algorithm", VLDB '94), the full version with a ghost queue.

Queues: ``A1in`` (FIFO of keys seen once recently, data held), ``A1out`` (FIFO ghost of keys
evicted from A1in, no data) and ``Am`` (LRU of keys re-referenced after leaving A1in).

- insert: a key remembered in A1out goes to Am's most-recent end (and leaves A1out); any other
  key goes to A1in's newest end.
- touch (hit): in Am, move to the most-recent end; in A1in, nothing (a correlated reference).
- victim: if A1in holds more than ``kin`` keys (or Am is empty), A1in's oldest key; else Am's
  least recent key. ``evict`` of an A1in key puts it in A1out, which forgets its oldest key
  beyond ``kout`` keys; an Am key leaves no history.

Defaults are the paper's recommendation: ``kin_ratio=0.25`` and ``kout_ratio=0.5`` of the cache's
capacity in keys (``capacity_keys`` when given, else the largest number of keys tracked so far).
A key the predicate refuses is passed over (its place is kept); ``remove`` leaves no history.
"""

from __future__ import annotations

from collections import OrderedDict

from quillcache._checks import check_float, check_int
from quillcache.policies.base import EvictionPolicy, Key, Predicate, always


class TwoQPolicy(EvictionPolicy):
    name = "2q"

    def __init__(self, *, capacity_keys: int | None = None, kin_ratio: float = 0.25, kout_ratio: float = 0.5) -> None:
        super().__init__()
        self.capacity_keys = None if capacity_keys is None else check_int("capacity_keys", capacity_keys, 1)
        self.kin_ratio = check_float("kin_ratio", kin_ratio, 0.0, 1.0, lo_open=True, hi_open=True)
        self.kout_ratio = check_float("kout_ratio", kout_ratio, 0.0, 10.0)
        self._a1in: OrderedDict[Key, None] = OrderedDict()
        self._a1out: OrderedDict[Key, None] = OrderedDict()
        self._am: OrderedDict[Key, None] = OrderedDict()
        self._peak = 0

    def _cap(self) -> int:
        return self.capacity_keys if self.capacity_keys is not None else max(self._peak, 1)

    def queue_of(self, key: Key) -> str:
        if key in self._a1in:
            return "a1in"
        if key in self._am:
            return "am"
        if key in self._a1out:
            return "a1out"
        self._require(key)
        raise AssertionError("tracked key in no queue")

    def insert(self, key: Key, size_bytes: int) -> None:
        self._add(key, size_bytes)
        self._peak = max(self._peak, len(self._sizes))
        if key in self._a1out:
            del self._a1out[key]
            self._am[key] = None
        else:
            self._a1in[key] = None

    def touch(self, key: Key) -> None:
        self._require(key)
        if key in self._am:
            self._am.move_to_end(key)

    def _forget(self, key: Key) -> bool:
        self._drop(key)
        if key in self._a1in:
            del self._a1in[key]
            return True
        del self._am[key]
        return False

    def remove(self, key: Key) -> None:
        self._forget(key)

    def evict(self, key: Key) -> None:
        if self._forget(key):
            self._a1out[key] = None
            limit = self.kout_ratio * self._cap()
            while self._a1out and len(self._a1out) > limit:
                self._a1out.popitem(last=False)

    def victim(self, is_evictable: Predicate = always) -> Key | None:
        first, second = ((self._a1in, self._am) if len(self._a1in) > self.kin_ratio * self._cap() or not self._am
                         else (self._am, self._a1in))
        for queue in (first, second):
            for key in queue:
                if is_evictable(key):
                    return key
        return None
