"""W-TinyLFU: a count-min-sketch admission filter with a doorkeeper, in front of SLRU.

Einziger, Friedman and Manes, "TinyLFU: A Highly Efficient Cache Admission Policy", ACM ToS 2017
(the W-TinyLFU design Caffeine uses). Three LRU lists share the capacity:
- a **window** (``window_ratio`` of the capacity, at least 1 key) that every new key enters;
- the **main** SLRU: ``probation`` and ``protected`` (``protected_ratio`` of the main part).

Frequency: every insert and touch is recorded. A key not yet in the **doorkeeper** (a Bloom
filter of ``doorkeeper_bits`` bits, 3 hashes) is only added there; otherwise the count-min sketch
(``quillcache.sketch.countmin.CountMinSketch``, conservative update, width ``ceil(e/eps)`` with eps chosen
so the width is about ``capacity``, depth 4) counts it. ``frequency(key) = sketch estimate + 1 if
in the doorkeeper``. After every ``sample_factor * capacity`` recorded accesses (the paper's W)
the sketch is halved and the doorkeeper cleared (aging). The doorkeeper hashes a key the same way
the sketch does (splitmix64 + double hashing + multiply-shift, ``quillcache.sketch.reference``)
with seed 1; keys must be ints (block hashes) or hashable objects (then ``hash(key)`` is used).

Eviction/admission (``victim``, called when the cache is full, before the new key is inserted):
while the window holds at least its share, its LRU key is the *candidate*; if the main part has
room the candidate simply moves to probation's MRU end; otherwise the candidate competes with
main's victim (probation LRU, else protected LRU): if ``frequency(candidate) > frequency(victim)``
the candidate moves into probation and main's victim is returned, else the candidate is returned.
When the window is below its share, main's victim is returned. Moves never change membership.
A touch in probation promotes to protected's MRU end (the protected LRU key is demoted to
probation's MRU end when protected is over its share); a touch elsewhere moves to its list's MRU
end. With a predicate refusing the chosen key, the first evictable key in window, probation,
protected order (each LRU first) is returned instead.

``admit`` always says yes: TinyLFU's admission decision is the candidate-vs-victim duel above.
The sketch is shared statistics, not per-key history: ``remove`` drops membership only.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from quillcache._checks import check_float, check_int
from quillcache.policies.base import EvictionPolicy, Key, Predicate, always
from quillcache.sketch.countmin import CountMinSketch
from quillcache.sketch.reference import MASK64, row_columns, seed_key

# the largest ``sample_factor``: aging after more accesses than any trace holds is no aging, and
# times any capacity of the hit-rate kernel (at most 2**31 blocks: int32 ids) it fits int64
MAX_SAMPLE_FACTOR = 1 << 30

SKETCH_DELTA = math.exp(-4) * 1.0001  # depth ceil(ln(1/delta)) = 4
DOORKEEPER_HASHES = 3
DOORKEEPER_SEED = 1


def sketch_eps(capacity: int) -> float:
    """eps giving a sketch width of about max(capacity, 64) counters."""
    return math.e / max(capacity, 64)


def key_int(key: Key) -> int:
    if isinstance(key, int) and not isinstance(key, bool):
        return key & MASK64
    return hash(key) & MASK64


class TinyLfuPolicy(EvictionPolicy):
    name = "tinylfu"

    def __init__(self, *, capacity_keys: int = 1024, window_ratio: float = 0.01, protected_ratio: float = 0.8,
                 sample_factor: int = 10, doorkeeper: bool = True) -> None:
        super().__init__()
        cap = check_int("capacity_keys", capacity_keys, 1)
        check_float("window_ratio", window_ratio, 0.0, 1.0, hi_open=True)
        check_float("protected_ratio", protected_ratio, 0.0, 1.0, hi_open=True)
        check_int("sample_factor", sample_factor, 1, MAX_SAMPLE_FACTOR)
        self.capacity_keys = cap
        self.window_cap = max(1, round(window_ratio * cap))
        self.main_cap = cap - self.window_cap
        self.protected_cap = int(protected_ratio * self.main_cap)
        self.sample_size = sample_factor * cap
        self.sketch = CountMinSketch(sketch_eps(cap), SKETCH_DELTA, conservative=True, seed=0)
        self.doorkeeper_bits = max(64, 8 * cap) if doorkeeper else 0
        self._dk = bytearray(self.doorkeeper_bits)
        self._dk_skey = seed_key(DOORKEEPER_SEED)
        self._since_reset = 0
        self._window: OrderedDict[Key, None] = OrderedDict()
        self._probation: OrderedDict[Key, None] = OrderedDict()
        self._protected: OrderedDict[Key, None] = OrderedDict()

    # ---- frequency ----------------------------------------------------------------------------
    def _dk_cols(self, k: int) -> list[int]:
        return row_columns(k, self._dk_skey, self.doorkeeper_bits, DOORKEEPER_HASHES)

    def _record(self, key: Key) -> None:
        k = key_int(key)
        if self.doorkeeper_bits:
            cols = self._dk_cols(k)
            if all(self._dk[c] for c in cols):
                self.sketch.add_one(k)
            else:
                for c in cols:
                    self._dk[c] = 1
        else:
            self.sketch.add_one(k)
        self._since_reset += 1
        if self._since_reset >= self.sample_size:
            self.sketch.halve()
            self._dk = bytearray(self.doorkeeper_bits)
            self._since_reset = 0

    def frequency(self, key: Key) -> int:
        k = key_int(key)
        est = self.sketch.estimate_one(k)
        if self.doorkeeper_bits and all(self._dk[c] for c in self._dk_cols(k)):
            est += 1
        return est

    def segment_of(self, key: Key) -> str:
        self._require(key)
        return "window" if key in self._window else "probation" if key in self._probation else "protected"

    # ---- protocol -------------------------------------------------------------------------
    def insert(self, key: Key, size_bytes: int) -> None:
        self._add(key, size_bytes)
        self._record(key)
        self._window[key] = None

    def touch(self, key: Key) -> None:
        self._require(key)
        self._record(key)
        if key in self._window:
            self._window.move_to_end(key)
        elif key in self._protected:
            self._protected.move_to_end(key)
        else:
            del self._probation[key]
            self._protected[key] = None
            if len(self._protected) > self.protected_cap:
                demoted, _ = self._protected.popitem(last=False)
                self._probation[demoted] = None

    def remove(self, key: Key) -> None:
        self._drop(key)
        for lst in (self._window, self._probation, self._protected):
            if key in lst:
                del lst[key]
                return

    def _main_victim(self) -> Key | None:
        if self._probation:
            return next(iter(self._probation))
        if self._protected:
            return next(iter(self._protected))
        return None

    def _choose(self) -> Key | None:
        while self._window and len(self._window) >= self.window_cap:
            cand = next(iter(self._window))
            if len(self._probation) + len(self._protected) < self.main_cap:
                del self._window[cand]
                self._probation[cand] = None
                continue
            v = self._main_victim()
            if v is None:
                return cand
            if self.frequency(cand) > self.frequency(v):
                del self._window[cand]
                self._probation[cand] = None
                return v
            return cand
        v = self._main_victim()
        if v is None and self._window:
            return next(iter(self._window))
        return v

    def victim(self, is_evictable: Predicate = always) -> Key | None:
        v = self._choose()
        if v is None or is_evictable(v):
            return v
        for lst in (self._window, self._probation, self._protected):
            for key in lst:
                if is_evictable(key):
                    return key
        return None
