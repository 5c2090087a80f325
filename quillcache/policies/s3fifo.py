"""S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23).

Three FIFO queues: a small queue S (~10% of the cache), a main queue M (the rest) and a ghost
queue G of recently evicted keys (no data). Each tracked key has a 2-bit frequency (0..3).

- insert: a key remembered in G goes to M (and leaves G); any other key goes to S; freq = 0.
- touch (hit): freq = min(freq + 1, 3).
- victim: if S holds at least ``small_ratio`` of the cache's bytes, evict from S, else from M
  (if the chosen queue yields nothing, the other one is tried).
  - from S (Algorithm 1, EVICTS): look at S's oldest key; if freq >= ``move_to_main_threshold``
    (default 2, i.e. "accessed more than once", as in the paper and libCacheSim) it moves to M's
    new end with freq = 0 and the scan goes on; otherwise it is the victim and, once the caller
    evicts it, it enters G.
  - from M (EVICTM, FIFO-reinsertion with a 2-bit counter): look at M's oldest key; if freq > 0
    it is reinserted at M's new end with freq - 1 and the scan goes on; otherwise it is the victim.
- G keeps keys in FIFO order and forgets the oldest once their bytes exceed ``ghost_ratio`` of
  the cache's bytes.

"The cache's bytes" is ``capacity_bytes`` when given, else the largest ``tracked_bytes`` seen so
far (eviction happens when the cache is full, so the two agree then).

Adaptations to the ``EvictionPolicy`` protocol (one victim per call, caller-side predicate):
- The paper's EVICTS calls EVICTM when moving a key into a full M; here the move is all that
  happens: total bytes are unchanged by it, and the next ``victim`` call picks from M once S has
  shrunk below its share, which evicts the same keys.
- A key the predicate refuses (pinned, leased) is skipped by moving it to its queue's new end,
  as if reinserted; freq counters still decay on the way through M. Each ``victim`` call is
  bounded: one pass over S and at most four over M (freq <= 3), so it ends even when every key
  is refused.
- ``evict`` of an S key puts it in G; ``remove`` (explicit delete, moved to another tier) does not.
"""

from __future__ import annotations

from collections import OrderedDict

from quillcache._checks import check_float, check_int
from quillcache.policies.base import EvictionPolicy, Key, Predicate, always

MAX_FREQ = 3


class S3FifoPolicy(EvictionPolicy):
    name = "s3fifo"

    def __init__(self, *, small_ratio: float = 0.10, ghost_ratio: float = 0.90, move_to_main_threshold: int = 2,
                 capacity_bytes: int | None = None) -> None:
        super().__init__()
        self.small_ratio = check_float("small_ratio", small_ratio, 0.0, 1.0, lo_open=True, hi_open=True)
        self.ghost_ratio = check_float("ghost_ratio", ghost_ratio, 0.0, 10.0)
        self.move_to_main_threshold = check_int("move_to_main_threshold", move_to_main_threshold, 1, MAX_FREQ)
        self.capacity_bytes = None if capacity_bytes is None else check_int("capacity_bytes", capacity_bytes, 1)
        self._small: OrderedDict[Key, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._ghost: OrderedDict[Key, int] = OrderedDict()  # key -> size_bytes, oldest first
        self._freq: dict[Key, int] = {}
        self._small_bytes = 0
        self._ghost_bytes = 0
        self._peak_bytes = 0

    # ---- sizes ----------------------------------------------------------------------------
    @property
    def cache_bytes(self) -> int:
        return self.capacity_bytes if self.capacity_bytes is not None else self._peak_bytes

    @property
    def small_bytes(self) -> int:
        return self._small_bytes

    def queue_of(self, key: Key) -> str:
        """'small', 'main' or 'ghost' (tests and diagnostics); UnknownKeyError otherwise."""
        if key in self._small:
            return "small"
        if key in self._main:
            return "main"
        if key in self._ghost:
            return "ghost"
        self._require(key)
        raise AssertionError("tracked key in no queue")

    def frequency(self, key: Key) -> int:
        self._require(key)
        return self._freq[key]

    def ghost_keys(self) -> list[Key]:
        return list(self._ghost)

    # ---- protocol -------------------------------------------------------------------------
    def insert(self, key: Key, size_bytes: int) -> None:
        size = self._add(key, size_bytes)
        self._peak_bytes = max(self._peak_bytes, self._tracked_bytes)
        self._freq[key] = 0
        ghost_size = self._ghost.pop(key, None)
        if ghost_size is not None:
            self._ghost_bytes -= ghost_size
            self._main[key] = None
        else:
            self._small[key] = None
            self._small_bytes += size

    def touch(self, key: Key) -> None:
        self._require(key)
        f = self._freq[key]
        if f < MAX_FREQ:
            self._freq[key] = f + 1

    def _forget(self, key: Key) -> bool:
        """Drop a tracked key from its queue; True if it was in S."""
        size = self._drop(key)
        del self._freq[key]
        if key in self._small:
            del self._small[key]
            self._small_bytes -= size
            return True
        del self._main[key]
        return False

    def remove(self, key: Key) -> None:
        self._forget(key)

    def evict(self, key: Key) -> None:
        size = self._sizes.get(key)
        if self._forget(key) and self.ghost_ratio > 0:
            assert size is not None
            self._ghost[key] = size
            self._ghost_bytes += size
            limit = self.ghost_ratio * self.cache_bytes
            while self._ghost and self._ghost_bytes > limit:
                _, old = self._ghost.popitem(last=False)
                self._ghost_bytes -= old

    def _scan_small(self, is_evictable: Predicate) -> Key | None:
        small, freq = self._small, self._freq
        for _ in range(len(small)):
            key = next(iter(small))
            if freq[key] >= self.move_to_main_threshold:
                del small[key]
                self._small_bytes -= self._sizes[key]
                freq[key] = 0
                self._main[key] = None
            elif is_evictable(key):
                return key
            else:
                small.move_to_end(key)
        return None

    def _scan_main(self, is_evictable: Predicate) -> Key | None:
        main, freq = self._main, self._freq
        for _ in range((MAX_FREQ + 1) * len(main)):
            key = next(iter(main))
            f = freq[key]
            if f > 0:
                freq[key] = f - 1
                main.move_to_end(key)
            elif is_evictable(key):
                return key
            else:
                main.move_to_end(key)
        return None

    def victim(self, is_evictable: Predicate = always) -> Key | None:
        if self._small and self._small_bytes >= self.small_ratio * self.cache_bytes:
            key = self._scan_small(is_evictable)
            return key if key is not None else self._scan_main(is_evictable)
        key = self._scan_main(is_evictable)
        return key if key is not None else self._scan_small(is_evictable)
