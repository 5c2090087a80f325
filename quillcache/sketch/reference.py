"""Count-min sketch in plain Python: the specification the Cython core (``quillcache.sketch._sketch``) follows.

Everything here is deliberately simple and slow; ``tests/test_sketch.py`` checks that the
compiled core produces *identical* counters, totals and heavy-hitter lists on random streams.

Hashing (the part both implementations must share bit for bit)
---------------------------------------------------------------
- ``seed_key = mix64(seed)`` once per sketch; per key ``h = mix64(key XOR seed_key)`` where
  ``mix64`` is ``quillcache._mix.splitmix64`` (add the golden-ratio increment, then Stafford's
  "mix13" finaliser: two 64-bit multiplies, three xor-shifts). It is a bijection on 64-bit words with
  full avalanche, costs a few integer operations, and is enough because keys are already xxh3 block hashes; it is
  not a keyed PRF, so an adversary who knows the seed can force collisions (only overcounting).
- Double hashing (Kirsch & Mitzenmacher): ``h1 = h mod 2**32``, ``h2 = h >> 32``; row ``i`` uses
  ``g_i = (h1 + i*h2) mod 2**32`` and column ``(g_i * width) >> 32`` (Lemire's multiply-shift
  range reduction: uniform on [0, width) without a division). One mixer call per key.

Invariants
----------
- Counters are uint32 and saturate at ``COUNTER_MAX``; they never wrap. ``total`` (N, the
  counted stream length) saturates at ``2**64 - 1``.
- Without aging, ``estimate(x) >= true count of x`` (never undercounts), in both update modes and
  after ``merge``. Conservative update (``c_i = max(c_i, min + count)``) never gives a larger
  estimate than the standard one (``c_i += count``) on the same stream.
- Aging: with ``aging_window = W > 0``, additions (with multiplicity) accumulate in a clock; when
  the clock reaches W after an addition, every counter, ``total`` and every stored heavy-hitter
  estimate are halved (right shift) and the clock restarts at 0. ``halve()`` does the same but
  leaves the clock alone. A key added with count 0 is a no-op.
- Heavy hitters: at most ``top_k`` candidate keys in a binary min-heap on the estimate recorded
  when the key was last added; after each addition the key is offered with its new estimate.
  ``heavy_hitters()`` re-estimates the candidates and sorts by (estimate desc, key asc).
"""

from __future__ import annotations

import math
from typing import Iterable

from quillcache._mix import splitmix64

MASK32 = (1 << 32) - 1
MASK64 = (1 << 64) - 1
COUNTER_MAX = MASK32
TOTAL_MAX = MASK64
MAX_DEPTH = 32
MAX_WIDTH = 1 << 31
MAX_COUNTERS = 1 << 28  # 1 GiB of uint32 counters
MAX_TOP_K = 1 << 20

mix64 = splitmix64  # the sketch's name for the package's one mixer


def seed_key(seed: int) -> int:
    """The per-sketch word XORed into every key before mixing."""
    return mix64(seed & MASK64)


def key_hash(key: int, skey: int) -> int:
    """The one 64-bit hash of a key (given ``skey = seed_key(seed)``)."""
    return mix64((key ^ skey) & MASK64)


def row_columns(key: int, skey: int, width: int, depth: int) -> list[int]:
    """Column of ``key`` in each of the ``depth`` rows (double hashing + multiply-shift)."""
    h = key_hash(key, skey)
    h1, h2 = h & MASK32, h >> 32
    return [((((h1 + i * h2) & MASK32) * width) >> 32) for i in range(depth)]


def dimensions_for(eps: float, delta: float) -> tuple[int, int]:
    """``(width, depth) = (ceil(e/eps), ceil(ln(1/delta)))``; inputs assumed validated."""
    return max(1, math.ceil(math.e / eps)), max(1, math.ceil(math.log(1.0 / delta)))


class ReferenceCountMinSketch:
    """Plain-Python count-min sketch; same semantics and hashing as the Cython core."""

    def __init__(
        self,
        width: int,
        depth: int,
        *,
        conservative: bool = True,
        seed: int = 0,
        aging_window: int | None = None,
        top_k: int = 0,
    ) -> None:
        if not (1 <= width <= MAX_WIDTH and 1 <= depth <= MAX_DEPTH):
            raise ValueError(f"width={width}, depth={depth} out of range")
        self.width = width
        self.depth = depth
        self.conservative = bool(conservative)
        self.seed = seed & MASK64
        self.aging_window = int(aging_window or 0)
        self.top_k = int(top_k)
        self._skey = seed_key(self.seed)
        self.rows: list[list[int]] = [[0] * width for _ in range(depth)]
        self.total = 0
        self.since_aging = 0
        self.heap_keys: list[int] = []
        self.heap_est: list[int] = []
        self._pos: dict[int, int] = {}

    # ---- updates -------------------------------------------------------------------------
    def add(self, keys: Iterable[int], counts: Iterable[int] | None = None) -> None:
        keys = list(keys)
        cs = [1] * len(keys) if counts is None else list(counts)
        if len(cs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(cs)} counts")
        for k, c in zip(keys, cs):
            self.add_one(k, c)

    def add_one(self, key: int, count: int = 1) -> None:
        if count == 0:
            return
        cols = row_columns(key, self._skey, self.width, self.depth)
        if self.conservative:
            m = min(self.rows[i][j] for i, j in enumerate(cols))
            new = min(m + count, COUNTER_MAX)
            for i, j in enumerate(cols):
                if self.rows[i][j] < new:
                    self.rows[i][j] = new
            est = new
        else:
            est = COUNTER_MAX
            for i, j in enumerate(cols):
                v = min(self.rows[i][j] + count, COUNTER_MAX)
                self.rows[i][j] = v
                est = min(est, v)
        if self.top_k:
            self._offer(key, est)
        self.total = min(self.total + count, TOTAL_MAX)
        if self.aging_window:
            self.since_aging += count
            if self.since_aging >= self.aging_window:
                self.halve()
                self.since_aging = 0

    def halve(self) -> None:
        for row in self.rows:
            for j in range(self.width):
                row[j] >>= 1
        self.heap_est = [e >> 1 for e in self.heap_est]  # monotone: heap order is kept
        self.total >>= 1

    def merge(self, other: "ReferenceCountMinSketch") -> None:
        if (other.width, other.depth, other.seed, other.conservative) != (
            self.width,
            self.depth,
            self.seed,
            self.conservative,
        ):
            raise ValueError("merge needs equal width, depth, seed and update mode")
        for r, o in zip(self.rows, other.rows):
            for j in range(self.width):
                r[j] = min(r[j] + o[j], COUNTER_MAX)
        self.total = min(self.total + other.total, TOTAL_MAX)
        self.rebuild_heavy(list(dict.fromkeys(self.heap_keys + other.heap_keys)))

    def clear(self) -> None:
        for row in self.rows:
            row[:] = [0] * self.width
        self.total = 0
        self.since_aging = 0
        self.heap_keys.clear()
        self.heap_est.clear()
        self._pos.clear()

    # ---- queries -------------------------------------------------------------------------
    def estimate_one(self, key: int) -> int:
        cols = row_columns(key, self._skey, self.width, self.depth)
        return min(self.rows[i][j] for i, j in enumerate(cols))

    def estimate(self, keys: Iterable[int]) -> list[int]:
        return [self.estimate_one(k) for k in keys]

    def counters(self) -> list[int]:
        """All counters, row-major (depth x width)."""
        return [v for row in self.rows for v in row]

    def heavy_hitters(self) -> list[tuple[int, int]]:
        out = [(k, self.estimate_one(k)) for k in self.heap_keys]
        out.sort(key=lambda kv: (-kv[1], kv[0]))
        return out

    # ---- heavy-hitter min-heap -------------------------------------------------------------
    def rebuild_heavy(self, candidates: list[int]) -> None:
        """Empty the heap, then offer each candidate (in order) with its current estimate."""
        self.heap_keys.clear()
        self.heap_est.clear()
        self._pos.clear()
        for k in candidates:
            self._offer(k, self.estimate_one(k))

    def _offer(self, key: int, est: int) -> None:
        n = len(self.heap_keys)
        if self.top_k == 0:
            return
        if n == self.top_k and est <= self.heap_est[0]:
            return  # a member's stored estimate is >= the root, so it cannot need an update
        i = self._pos.get(key)
        if i is not None:
            if est > self.heap_est[i]:
                self.heap_est[i] = est
                self._sift_down(i)
            return
        if n < self.top_k:
            self.heap_keys.append(key)
            self.heap_est.append(est)
            self._pos[key] = n
            self._sift_up(n)
        else:
            del self._pos[self.heap_keys[0]]
            self.heap_keys[0] = key
            self.heap_est[0] = est
            self._pos[key] = 0
            self._sift_down(0)

    def _swap(self, i: int, j: int) -> None:
        hk, he = self.heap_keys, self.heap_est
        hk[i], hk[j] = hk[j], hk[i]
        he[i], he[j] = he[j], he[i]
        self._pos[hk[i]] = i
        self._pos[hk[j]] = j

    def _sift_up(self, i: int) -> None:
        he = self.heap_est
        while i > 0:
            p = (i - 1) >> 1
            if he[i] < he[p]:
                self._swap(i, p)
                i = p
            else:
                break

    def _sift_down(self, i: int) -> None:
        he = self.heap_est
        n = len(he)
        while True:
            small = i
            left = 2 * i + 1
            right = left + 1
            if left < n and he[left] < he[small]:
                small = left
            if right < n and he[right] < he[small]:
                small = right
            if small == i:
                return
            self._swap(i, small)
            i = small
