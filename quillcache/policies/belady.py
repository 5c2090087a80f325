"""Belady's MIN (offline optimum): evict the tracked key whose next use is farthest in the future.

It needs the future, so it takes a **next-use oracle** from whoever replays the trace:
``next_use_oracle(key) -> int`` must return the time (any totally ordered int clock, e.g. the
position in the reference stream) of the next reference to ``key`` after the one being made
right now, or a value larger than every real time if there is none (the replay harness uses
``N + p`` for a last reference at position ``p``, so values never tie). The policy calls the
oracle exactly once per ``insert``/``touch`` (for the key referenced) and once per ``admit``; the
harness advances its cursor between references. This policy cannot run online: it is the bound
every online policy is measured against.

- ``insert``/``touch``: record the key's next use.
- ``victim``: the key with the farthest recorded next use (a max-heap with lazy deletion; ties
  cannot happen with the harness's oracle, otherwise the larger key-insertion counter wins).
- ``admit`` (bypass, on by default when ``capacity_keys`` is given): refuse a new key when the
  cache is full and the key's own next use is farther than every tracked key's, i.e. when MIN
  would evict the newcomer itself. For the prefix-aware hit count used here this is the bound we
  rely on: a block's ancestors are referenced just before it in every request, so an ancestor's
  next use always comes first and MIN drops descendants before their ancestors; the tests check
  on random prefix-structured traces that no policy beats it. Without bypass it is per-reference
  MIN (it always admits): it is not optimal for prefix hits, not even among policies that always
  admit, since a reference after its request's first miss is no hit even when its block is cached.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from quillcache._checks import check_int
from quillcache.policies.base import EvictionPolicy, Key, Predicate, always, check_size

Oracle = Callable[[Key], int]


class BeladyPolicy(EvictionPolicy):
    name = "belady"

    def __init__(self, *, next_use_oracle: Oracle | None = None, capacity_keys: int | None = None,
                 bypass: bool = True) -> None:
        super().__init__()
        if next_use_oracle is None or not callable(next_use_oracle):
            raise TypeError("belady needs the future: pass next_use_oracle=callable(key) -> next-use time "
                            f"(got {next_use_oracle!r}); quillcache.hitrate.reference builds one from a trace")
        self._oracle = next_use_oracle
        self.capacity_keys = None if capacity_keys is None else check_int("capacity_keys", capacity_keys, 1)
        self.bypass = bool(bypass)
        self._next: dict[Key, int] = {}
        self._heap: list[tuple[int, int, Key]] = []  # (-next_use, -counter, key)
        self._counter = 0

    def _record(self, key: Key) -> None:
        nu = int(self._oracle(key))
        self._next[key] = nu
        self._counter += 1
        heapq.heappush(self._heap, (-nu, -self._counter, key))
        if len(self._heap) > 2 * len(self._next) + 16:
            self._heap = [(-nu_, 0, k) for k, nu_ in self._next.items()]
            heapq.heapify(self._heap)

    def _top(self) -> tuple[int, Key] | None:
        heap = self._heap
        while heap and self._next.get(heap[0][2], None) != -heap[0][0]:
            heapq.heappop(heap)
        return (-heap[0][0], heap[0][2]) if heap else None

    def next_use(self, key: Key) -> int:
        self._require(key)
        return self._next[key]

    def admit(self, key: Key, size_bytes: int) -> bool:
        check_size(size_bytes)
        if not self.bypass or self.capacity_keys is None or len(self) < self.capacity_keys:
            return True
        top = self._top()
        return top is None or int(self._oracle(key)) <= top[0]

    def insert(self, key: Key, size_bytes: int) -> None:
        self._add(key, size_bytes)
        self._record(key)

    def touch(self, key: Key) -> None:
        self._require(key)
        self._record(key)

    def remove(self, key: Key) -> None:
        self._drop(key)
        del self._next[key]

    def victim(self, is_evictable: Predicate = always) -> Key | None:
        top = self._top()
        if top is None:
            return None
        if is_evictable(top[1]):
            return top[1]
        live = sorted(((-nu, k) for k, nu in self._next.items() if is_evictable(k)), key=lambda x: x[0])
        return live[0][1] if live else None
