"""Count-min sketch core (private; use ``quillcache.sketch.countmin.CountMinSketch``).

Same algorithm and hashing as ``quillcache.sketch.reference`` (the specification): per key one
splitmix64 mix of ``key ^ splitmix64(seed)`` (``quillcache/_mix.pxd``), double hashing ``h1 + i*h2`` (32-bit wrap) and
Lemire's multiply-shift ``(g * width) >> 32`` for the column of row ``i``.

Invariants:
- ``_t`` points at a C-contiguous uint32 array of ``depth * width`` counters owned by this
  object and never reallocated; counters saturate at UINT32_MAX and never wrap.
- The heavy-hitter min-heap has ``_hn <= top_k`` entries ``(_hk[i], _he[i])``; ``_ht`` is an
  open-addressing (linear probing, backward-shift deletion) table of heap positions, size a
  power of two >= 2*top_k, so it is never more than half full; ``_hs[i]`` is the table slot that
  holds heap position ``i``. All heap arrays have at least one element so pointers stay valid.
- Loops run without the GIL. A ``_busy`` flag, set and tested while holding the GIL, makes a
  second concurrent mutating call raise RuntimeError instead of racing on the heap table.
The public wrapper validates inputs; the checks here are a second line that keeps bad calls
from touching memory out of bounds.
"""


from libc.stdint cimport int32_t, uint32_t, uint64_t

import numpy as np

# Kernels (splitmix64 from quillcache/_mix.pxd, _block_offsets, _update_at, ...) and constants come from _sketch.pxd.

MAX_DEPTH = 32
MAX_WIDTH = 1 << 31
MAX_COUNTERS = 1 << 28
MAX_TOP_K = 1 << 20


def splitmix64_array(const uint64_t[::1] z):
    """The Cython ``splitmix64`` (``quillcache/_mix.pxd``) of each element: a thin wrapper for tests."""
    cdef Py_ssize_t i, n = z.shape[0]
    out = np.empty(n, dtype=np.uint64)
    cdef uint64_t[::1] o = out
    with nogil:
        for i in range(n):
            o[i] = splitmix64(z[i])
    return out


cdef void _add_plain(uint32_t* t, uint32_t w, Py_ssize_t d, uint64_t skey, bint conservative,
                     const uint64_t* keys, const uint32_t* counts, Py_ssize_t n,
                     uint64_t* total) noexcept nogil:
    """Batch update without heavy hitters or aging (the hot path). ``counts`` may be NULL (all 1)."""
    cdef uint64_t hb[_BLOCK]
    cdef uint32_t off[QC_SK_MAX_DEPTH * _BLOCK]
    cdef Py_ssize_t s, j, m
    cdef uint64_t c
    cdef uint64_t tot = total[0]
    s = 0
    while s < n:
        m = n - s if n - s < _BLOCK else _BLOCK
        _block_offsets(keys + s, m, skey, w, d, hb, off)
        if counts == NULL:
            if conservative and d == 5:
                for j in range(m):
                    _cu5_at(t, off + j, 1)
            elif d == 5:
                for j in range(m):
                    _std5_at(t, off + j, 1)
            else:
                for j in range(m):
                    _update_at(t, off + j, d, conservative, 1)
            tot = _sat_add64(tot, <uint64_t>m)
        else:
            for j in range(m):
                c = counts[s + j]
                if c == 0:
                    continue
                _update_at(t, off + j, d, conservative, c)
                tot = _sat_add64(tot, c)
        s += m
    total[0] = tot


cdef class SketchCore:
    """Counters, running total, aging clock and heavy-hitter heap of one sketch."""

    cdef readonly object table  # np.ndarray[uint32], shape (depth, width)
    cdef uint32_t* _t
    cdef readonly Py_ssize_t width
    cdef readonly Py_ssize_t depth
    cdef uint32_t _w
    cdef readonly uint64_t seed
    cdef uint64_t _skey
    cdef readonly bint conservative
    cdef readonly uint64_t aging_window
    cdef readonly uint64_t since_aging
    cdef readonly uint64_t total
    cdef readonly Py_ssize_t top_k
    cdef Py_ssize_t _hn
    cdef object _hk_arr, _he_arr, _hs_arr, _ht_arr
    cdef uint64_t* _hk
    cdef uint32_t* _he
    cdef uint64_t* _hs
    cdef int32_t* _ht
    cdef uint64_t _hmask
    cdef bint _busy

    def __cinit__(self, Py_ssize_t width, Py_ssize_t depth, bint conservative=True,
                  uint64_t seed=0, uint64_t aging_window=0, Py_ssize_t top_k=0):
        cdef uint32_t[::1] tv
        cdef uint64_t[::1] kv
        cdef uint32_t[::1] ev
        cdef uint64_t[::1] sv
        cdef int32_t[::1] hv
        cdef Py_ssize_t tsize = 2
        if not 1 <= width <= MAX_WIDTH:
            raise ValueError(f"width={width} out of range [1, {MAX_WIDTH}]")
        if not 1 <= depth <= MAX_DEPTH:
            raise ValueError(f"depth={depth} out of range [1, {MAX_DEPTH}]")
        if width * depth > MAX_COUNTERS:
            raise ValueError(f"width*depth={width * depth} counters exceeds {MAX_COUNTERS}")
        if not 0 <= top_k <= MAX_TOP_K:
            raise ValueError(f"top_k={top_k} out of range [0, {MAX_TOP_K}]")
        self.width = width
        self.depth = depth
        self._w = <uint32_t>width
        self.seed = seed
        self._skey = splitmix64(seed)
        self.conservative = conservative
        self.aging_window = aging_window
        self.top_k = top_k
        self.table = np.zeros((depth, width), dtype=np.uint32)
        tv = self.table.reshape(-1)
        self._t = &tv[0]
        while tsize < 2 * top_k:
            tsize *= 2
        self._hk_arr = np.zeros(max(top_k, 1), dtype=np.uint64)
        self._he_arr = np.zeros(max(top_k, 1), dtype=np.uint32)
        self._hs_arr = np.zeros(max(top_k, 1), dtype=np.uint64)
        self._ht_arr = np.full(tsize, -1, dtype=np.int32)
        kv = self._hk_arr
        ev = self._he_arr
        sv = self._hs_arr
        hv = self._ht_arr
        self._hk = &kv[0]
        self._he = &ev[0]
        self._hs = &sv[0]
        self._ht = &hv[0]
        self._hmask = <uint64_t>(tsize - 1)

    # ---- guard -----------------------------------------------------------------------------
    cdef int _enter(self) except -1:
        if self._busy:
            raise RuntimeError("CountMinSketch is being updated by another thread; it is not thread-safe")
        self._busy = True
        return 0

    # ---- heavy-hitter heap (all nogil, cannot fail) -----------------------------------------
    cdef inline uint64_t _hh_find(self, uint64_t key, uint64_t h) noexcept nogil:
        """Slot holding ``key``, or the empty slot where it would go."""
        cdef uint64_t s = h & self._hmask
        cdef int32_t e
        while True:
            e = self._ht[s]
            if e < 0 or self._hk[e] == key:
                return s
            s = (s + 1) & self._hmask

    cdef void _hh_delete_slot(self, uint64_t s) noexcept nogil:
        cdef uint64_t mask = self._hmask
        cdef uint64_t j = s
        cdef uint64_t home
        cdef int32_t e
        self._ht[s] = -1
        while True:
            j = (j + 1) & mask
            e = self._ht[j]
            if e < 0:
                return
            home = splitmix64(self._hk[e] ^ self._skey) & mask
            if ((j - home) & mask) >= ((j - s) & mask):  # hole s lies in [home, j): move back
                self._ht[s] = e
                self._hs[e] = s
                self._ht[j] = -1
                s = j

    cdef inline void _hh_swap(self, Py_ssize_t i, Py_ssize_t j) noexcept nogil:
        cdef uint64_t k = self._hk[i]
        cdef uint32_t e = self._he[i]
        cdef uint64_t s = self._hs[i]
        self._hk[i] = self._hk[j]
        self._he[i] = self._he[j]
        self._hs[i] = self._hs[j]
        self._hk[j] = k
        self._he[j] = e
        self._hs[j] = s
        self._ht[self._hs[i]] = <int32_t>i
        self._ht[self._hs[j]] = <int32_t>j

    cdef void _hh_sift_up(self, Py_ssize_t i) noexcept nogil:
        cdef Py_ssize_t p
        while i > 0:
            p = (i - 1) >> 1
            if self._he[i] < self._he[p]:
                self._hh_swap(i, p)
                i = p
            else:
                return

    cdef void _hh_sift_down(self, Py_ssize_t i) noexcept nogil:
        cdef Py_ssize_t n = self._hn
        cdef Py_ssize_t small, left, right
        while True:
            small = i
            left = 2 * i + 1
            right = left + 1
            if left < n and self._he[left] < self._he[small]:
                small = left
            if right < n and self._he[right] < self._he[small]:
                small = right
            if small == i:
                return
            self._hh_swap(i, small)
            i = small

    cdef void _hh_offer(self, uint64_t key, uint64_t h, uint32_t est) noexcept nogil:
        cdef Py_ssize_t n = self._hn
        cdef uint64_t s
        cdef int32_t e
        if n == self.top_k and est <= self._he[0]:
            return
        s = self._hh_find(key, h)
        e = self._ht[s]
        if e >= 0:
            if est > self._he[e]:
                self._he[e] = est
                self._hh_sift_down(e)
            return
        if n < self.top_k:
            self._hk[n] = key
            self._he[n] = est
            self._hs[n] = s
            self._ht[s] = <int32_t>n
            self._hn = n + 1
            self._hh_sift_up(n)
        else:
            self._hh_delete_slot(self._hs[0])
            s = self._hh_find(key, h)
            self._hk[0] = key
            self._he[0] = est
            self._hs[0] = s
            self._ht[s] = 0
            self._hh_sift_down(0)

    cdef void _hh_reset(self) noexcept nogil:
        cdef uint64_t s
        for s in range(self._hmask + 1):
            self._ht[s] = -1
        self._hn = 0

    # ---- state changes (nogil kernels) -----------------------------------------------------
    cdef void _halve(self) noexcept nogil:
        cdef Py_ssize_t i
        cdef Py_ssize_t n = self.width * self.depth
        cdef uint32_t* t = self._t
        for i in range(n):
            t[i] = t[i] >> 1
        for i in range(self._hn):
            self._he[i] = self._he[i] >> 1
        self.total = self.total >> 1

    cdef void _add_general(self, const uint64_t* keys, const uint32_t* counts,
                           Py_ssize_t n) noexcept nogil:
        """Per-key path with heavy-hitter offers and the aging clock (same block offsets)."""
        cdef uint64_t hb[_BLOCK]
        cdef uint32_t off[QC_SK_MAX_DEPTH * _BLOCK]
        cdef Py_ssize_t s, j, m
        cdef uint64_t c
        cdef uint32_t est
        # Locals, so the compiler need not reload fields after every counter store.
        cdef uint32_t* t = self._t
        cdef const uint32_t* he = self._he
        cdef Py_ssize_t d = self.depth
        cdef Py_ssize_t top_k = self.top_k
        cdef bint cons = self.conservative
        cdef uint64_t window = self.aging_window
        s = 0
        while s < n:
            m = n - s if n - s < _BLOCK else _BLOCK
            _block_offsets(keys + s, m, self._skey, self._w, d, hb, off)
            for j in range(m):
                c = 1 if counts == NULL else counts[s + j]
                if c == 0:
                    continue
                est = _update_at(t, off + j, d, cons, c)
                # Inline pre-check of _hh_offer's early exit: most keys are below the heap root.
                if top_k and (self._hn < top_k or est > he[0]):
                    self._hh_offer(keys[s + j], hb[j], est)
                self.total = _sat_add64(self.total, c)
                if window:
                    self.since_aging = _sat_add64(self.since_aging, c)
                    if self.since_aging >= window:
                        self._halve()
                        self.since_aging = 0
            s += m

    cdef void _add_ptr(self, const uint64_t* keys, const uint32_t* counts, Py_ssize_t n) noexcept nogil:
        cdef Py_ssize_t done = 0
        cdef Py_ssize_t chunk
        cdef uint64_t left
        if self.top_k == 0 and self.aging_window == 0:
            _add_plain(self._t, self._w, self.depth, self._skey, self.conservative,
                       keys, counts, n, &self.total)
        elif self.top_k == 0 and counts == NULL:
            # Unit counts: the clock reaches the window after exactly (window - since) keys, so
            # run the plain kernel up to each halving point; same order as key-by-key aging.
            while done < n:
                # >= 1 always (since_aging < aging_window is kept), so every pass makes progress
                left = self.aging_window - self.since_aging if self.since_aging < self.aging_window else 1
                chunk = n - done if <uint64_t>(n - done) < left else <Py_ssize_t>left
                _add_plain(self._t, self._w, self.depth, self._skey, self.conservative,
                           keys + done, NULL, chunk, &self.total)
                done += chunk
                self.since_aging = self.since_aging + <uint64_t>chunk  # (+= on an attribute needs the GIL when nonecheck is on)
                if self.since_aging >= self.aging_window:
                    self._halve()
                    self.since_aging = 0
        else:
            self._add_general(keys, counts, n)

    # ---- Python-visible methods ------------------------------------------------------------
    def add(self, const uint64_t[::1] keys, const uint32_t[::1] counts=None):
        """Add ``keys`` (each once, or ``counts[i]`` times)."""
        cdef Py_ssize_t n = keys.shape[0]
        cdef const uint32_t* cp = NULL
        if counts is not None:
            if counts.shape[0] != n:
                raise ValueError(f"{n} keys but {counts.shape[0]} counts")
            if n:
                cp = &counts[0]
        if n == 0:
            return
        self._enter()
        try:
            with nogil:
                self._add_ptr(&keys[0], cp, n)
        finally:
            self._busy = False

    def add_one(self, uint64_t key, uint32_t count=1):
        self._enter()
        try:
            self._add_ptr(&key, &count, 1)
        finally:
            self._busy = False

    def estimate(self, const uint64_t[::1] keys):
        """Estimates (uint32) for ``keys``."""
        cdef Py_ssize_t n = keys.shape[0]
        cdef Py_ssize_t s, j, m
        cdef uint64_t hb[_BLOCK]
        cdef uint32_t off[QC_SK_MAX_DEPTH * _BLOCK]
        out = np.empty(n, dtype=np.uint32)
        cdef uint32_t[::1] ov = out
        if n == 0:
            return out
        with nogil:
            s = 0
            while s < n:
                m = n - s if n - s < _BLOCK else _BLOCK
                _block_offsets(&keys[s], m, self._skey, self._w, self.depth, hb, off)
                if self.depth == 5:
                    for j in range(m):
                        ov[s + j] = _query5_at(self._t, off + j)
                else:
                    for j in range(m):
                        ov[s + j] = _query_at(self._t, off + j, self.depth)
                s += m
        return out

    def estimate_one(self, uint64_t key):
        return _query_one(self._t, self._w, self.depth, splitmix64(key ^ self._skey))

    def halve(self):
        self._enter()
        try:
            with nogil:
                self._halve()
        finally:
            self._busy = False

    def clear(self):
        self._enter()
        try:
            self.table.fill(0)
            self.total = 0
            self.since_aging = 0
            self._hh_reset()
        finally:
            self._busy = False

    def merge(self, SketchCore other not None):
        """Add ``other``'s counters and total (saturating); re-rank the union of candidates."""
        cdef Py_ssize_t i
        cdef Py_ssize_t n = self.width * self.depth
        cdef uint32_t* a = self._t
        cdef const uint32_t* b = other._t
        cdef uint64_t s
        if (other.width, other.depth, other.seed, other.conservative) != (
                self.width, self.depth, self.seed, self.conservative):
            raise ValueError("merge needs equal width, depth, seed and update mode")
        cand = list(dict.fromkeys(self.heavy_keys().tolist() + other.heavy_keys().tolist()))
        self._enter()
        try:
            with nogil:
                for i in range(n):
                    s = <uint64_t>a[i] + b[i]
                    a[i] = <uint32_t>s if s < QC_SK_U32MAX else <uint32_t>QC_SK_U32MAX
                self.total = _sat_add64(self.total, other.total)
        finally:
            self._busy = False
        self.rebuild_heavy(np.asarray(cand, dtype=np.uint64))

    def rebuild_heavy(self, const uint64_t[::1] candidates):
        """Empty the heap, then offer each candidate in order with its current estimate."""
        cdef Py_ssize_t k
        cdef uint64_t h
        self._enter()
        try:
            with nogil:
                self._hh_reset()
                if self.top_k:
                    for k in range(candidates.shape[0]):
                        h = splitmix64(candidates[k] ^ self._skey)
                        self._hh_offer(candidates[k], h, _query_one(self._t, self._w, self.depth, h))
        finally:
            self._busy = False

    def heavy_keys(self):
        """Candidate keys in heap order (a copy)."""
        return self._hk_arr[: self._hn].copy()

    def heavy_stored(self):
        """Candidate estimates as recorded in the heap, heap order (a copy)."""
        return self._he_arr[: self._hn].copy()

    def load_state(self, const uint32_t[::1] counters, uint64_t total, uint64_t since_aging,
                   const uint64_t[::1] heap_keys, const uint32_t[::1] heap_est):
        """Restore a serialized state; refuses a heap that is malformed."""
        cdef Py_ssize_t i, n = heap_keys.shape[0]
        cdef uint64_t s
        if counters.shape[0] != self.width * self.depth:
            raise ValueError(f"{counters.shape[0]} counters; expected {self.width * self.depth}")
        if self.aging_window and since_aging >= self.aging_window:
            raise ValueError(f"aging clock {since_aging} must be below aging_window={self.aging_window}")
        if n != heap_est.shape[0] or n > self.top_k:
            raise ValueError(f"{n} heavy-hitter entries; expected at most top_k={self.top_k}")
        for i in range(1, n):
            if heap_est[i] < heap_est[(i - 1) >> 1]:
                raise ValueError(f"heavy-hitter entry {i} breaks the min-heap order")
        self._enter()
        try:
            self.table.reshape(-1)[:] = np.asarray(counters)
            self.total = total
            self.since_aging = since_aging
            self._hh_reset()
            for i in range(n):
                s = self._hh_find(heap_keys[i], splitmix64(heap_keys[i] ^ self._skey))
                if self._ht[s] >= 0:
                    self._hh_reset()
                    raise ValueError(f"heavy-hitter key {heap_keys[i]} appears twice")
                self._hk[i] = heap_keys[i]
                self._he[i] = heap_est[i]
                self._hs[i] = s
                self._ht[s] = <int32_t>i
                self._hn = i + 1
        finally:
            self._busy = False

    @property
    def nbytes(self):
        return (self.table.nbytes + self._hk_arr.nbytes + self._he_arr.nbytes
                + self._hs_arr.nbytes + self._ht_arr.nbytes)
