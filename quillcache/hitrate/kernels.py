"""Numba simulators of the prefix-aware block cache, one per policy (hit-rate only, no bytes).

Definition (REFERENCE §5), shared by every kernel and by ``quillcache.hitrate.reference``:
for each request, its hits are its leading blocks that are cached, up to the first miss; then
every block of the request, in order, is touched if cached, else offered for admission and, if
admitted, inserted, evicting ONE victim first when the cache already holds ``cap`` blocks.
Each kernel fills ``hits[r]`` (int32, per request) and returns the total.

Invariants every kernel keeps (and the reference checks hit for hit):
- it reproduces the online policy class of the same name driven through the ``EvictionPolicy``
  protocol exactly: same victims, same order, same tie-breaks;
- every per-reference step is O(1) (linked lists in flat int32 arrays indexed by dense block id)
  or O(log n) (binary heaps with lazy deletion: an entry is live only while its stamp matches
  the block's current stamp; stale entries are dropped when they reach the top);
- inputs were validated by ``quillcache.hitrate.arrays.validate_arrays`` and ``cap >= 1``; the
  kernels do no bounds checks of their own.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from quillcache._jitcache import guard_cache
from quillcache.hitrate._klib import (
    NIL,
    _heap_compact,
    _heap_pop,
    _heap_push,
    _lists,
    _prefix_hits,
    _push,
    _unlink,
)

# the learned policies and the list-based baselines live in their own modules; re-exported so
# callers use one namespace
from quillcache.hitrate.kernels_classic import arc, lookahead, sieve, twoq
from quillcache.hitrate.kernels_lrb import lrb
from quillcache.hitrate.kernels_quillhd import (
    CLS_CHAIN,
    CLS_PREFIX,
    CLS_REUSE,
    NUM_BUCKETS,
    age_bucket,
    bucket_mid,
    quillhd,
)
from quillcache.hitrate.kernels_tinylfu import mix64, tinylfu

__all__ = ["CLS_CHAIN", "CLS_PREFIX", "CLS_REUSE", "NUM_BUCKETS", "age_bucket", "arc", "belady", "bucket_mid", "fifo",
           "lengthaware", "lfu", "lookahead", "lrb", "lru", "mix64", "quillhd", "s3fifo", "sieve", "tinylfu", "twoq"]

# ---------------------------------------------------------------- LRU and FIFO


@njit(cache=True, nogil=True)
def lru(off, blocks, u, cap, hits):
    """Evict the least recently inserted-or-touched block (``LruPolicy``)."""
    incache = np.zeros(u, np.bool_)
    prev, nxt, head, tail, size = _lists(u, 1)
    total = 0
    for r in range(off.shape[0] - 1):
        k = _prefix_hits(off, blocks, r, incache)
        hits[r] = k
        total += k
        for p in range(off[r], off[r + 1]):
            b = blocks[p]
            if incache[b]:
                _unlink(0, b, prev, nxt, head, tail, size)
            elif size[0] >= cap:
                v = head[0]
                _unlink(0, v, prev, nxt, head, tail, size)
                incache[v] = False
            _push(0, b, prev, nxt, head, tail, size)
            incache[b] = True
    return total


@njit(cache=True, nogil=True)
def fifo(off, blocks, u, cap, hits):
    """Evict the earliest inserted block; hits change nothing (``FifoPolicy``)."""
    incache = np.zeros(u, np.bool_)
    prev, nxt, head, tail, size = _lists(u, 1)
    total = 0
    for r in range(off.shape[0] - 1):
        k = _prefix_hits(off, blocks, r, incache)
        hits[r] = k
        total += k
        for p in range(off[r], off[r + 1]):
            b = blocks[p]
            if incache[b]:
                continue
            if size[0] >= cap:
                v = head[0]
                _unlink(0, v, prev, nxt, head, tail, size)
                incache[v] = False
            _push(0, b, prev, nxt, head, tail, size)
            incache[b] = True
    return total


# ---------------------------------------------------------------- heap-ordered policies


@njit(cache=True, nogil=True)
def _heap_policy(off, blocks, u, cap, hits, mode, bypass, next_use):
    """Shared driver of the heap-ordered policies; the victim is the live heap minimum.

    mode 0 = LFU with LRU tie-break: key (freq, seq of last insert/touch).
    mode 1 = length-aware: key (freq * 2**31 - depth, seq), depth = position in the request
             where the block was last referenced (later blocks of equal frequency go first).
    mode 2 = Belady: key (-next_use, 0); with ``bypass`` a new block whose next use is farther
             than every cached block's is not admitted when the cache is full.
    """
    incache = np.zeros(u, np.bool_)
    freq = np.zeros(u, np.int64)
    k1 = np.zeros(u, np.int64)
    k2 = np.zeros(u, np.int64)
    cap_heap = 2 * cap + 16
    h1 = np.empty(cap_heap + 1, np.int64)
    h2 = np.empty(cap_heap + 1, np.int64)
    hb = np.empty(cap_heap + 1, np.int32)
    n = 0
    size = 0
    seq = 0
    total = 0
    for r in range(off.shape[0] - 1):
        k = _prefix_hits(off, blocks, r, incache)
        hits[r] = k
        total += k
        s = off[r]
        for p in range(s, off[r + 1]):
            b = blocks[p]
            seq += 1
            if incache[b]:
                freq[b] += 1
            else:
                if size >= cap:
                    # peek the live minimum (drop stale tops)
                    while not (incache[hb[0]] and h1[0] == k1[hb[0]] and h2[0] == k2[hb[0]]):
                        n = _heap_pop(h1, h2, hb, n)
                    if mode == 2 and bypass and -h1[0] < next_use[p]:
                        continue
                    v = hb[0]
                    n = _heap_pop(h1, h2, hb, n)
                    incache[v] = False
                    size -= 1
                incache[b] = True
                freq[b] = 1
                size += 1
            if mode == 0:
                k1[b] = freq[b]
                k2[b] = seq
            elif mode == 1:
                k1[b] = freq[b] * 2147483648 - (p - s)
                k2[b] = seq
            else:
                k1[b] = -next_use[p]
                k2[b] = 0
            if n >= cap_heap:
                n = _heap_compact(h1, h2, hb, n, k1, k2, incache)
            n = _heap_push(h1, h2, hb, n, k1[b], k2[b], b)
    return total


@njit(cache=True, nogil=True)
def lfu(off, blocks, u, cap, hits):
    """Fewest hits first, LRU among equals; counts forgotten on eviction (``LfuPolicy``)."""
    return _heap_policy(off, blocks, u, cap, hits, 0, False, np.empty(0, np.int64))


@njit(cache=True, nogil=True)
def lengthaware(off, blocks, u, cap, hits):
    """Mooncake LengthAwareCache as read in ``quillcache.policies.lengthaware``."""
    return _heap_policy(off, blocks, u, cap, hits, 1, False, np.empty(0, np.int64))


@njit(cache=True, nogil=True)
def belady(off, blocks, u, cap, hits, next_use, bypass):
    """Belady/MIN: evict the cached block whose next use is farthest (``BeladyPolicy``)."""
    return _heap_policy(off, blocks, u, cap, hits, 2, bypass, next_use)


# ---------------------------------------------------------------- S3-FIFO

_S, _M, _G = 0, 1, 2


@njit(cache=True, nogil=True)
def s3fifo(off, blocks, u, cap, hits, small_ratio, ghost_ratio, move_threshold):
    """S3-FIFO exactly as ``S3FifoPolicy(capacity_bytes=cap)`` with unit sizes."""
    where = np.full(u, NIL, np.int8)  # _S, _M, _G or NIL
    freq = np.zeros(u, np.int8)
    prev, nxt, head, tail, size = _lists(u, 3)
    small_limit = small_ratio * cap
    ghost_limit = ghost_ratio * cap
    total = 0
    incache = np.zeros(u, np.bool_)
    for r in range(off.shape[0] - 1):
        k = _prefix_hits(off, blocks, r, incache)
        hits[r] = k
        total += k
        for p in range(off[r], off[r + 1]):
            b = blocks[p]
            if incache[b]:
                if freq[b] < 3:
                    freq[b] += 1
                continue
            if size[_S] + size[_M] >= cap:
                v = NIL
                first_small = size[_S] > 0 and size[_S] >= small_limit
                for attempt in range(2):
                    use_small = first_small if attempt == 0 else not first_small
                    if use_small:
                        for _ in range(size[_S]):
                            c = head[_S]
                            if freq[c] >= move_threshold:
                                _unlink(_S, c, prev, nxt, head, tail, size)
                                freq[c] = 0
                                _push(_M, c, prev, nxt, head, tail, size)
                                where[c] = _M
                            else:
                                v = c
                                break
                    else:
                        while size[_M] > 0:
                            c = head[_M]
                            if freq[c] > 0:
                                freq[c] -= 1
                                _unlink(_M, c, prev, nxt, head, tail, size)
                                _push(_M, c, prev, nxt, head, tail, size)
                            else:
                                v = c
                                break
                    if v != NIL:
                        break
                # evict v
                incache[v] = False
                if where[v] == _S:
                    _unlink(_S, v, prev, nxt, head, tail, size)
                    where[v] = NIL
                    if ghost_ratio > 0:
                        _push(_G, v, prev, nxt, head, tail, size)
                        where[v] = _G
                        while size[_G] > 0 and size[_G] > ghost_limit:
                            g = head[_G]
                            _unlink(_G, g, prev, nxt, head, tail, size)
                            where[g] = NIL
                else:
                    _unlink(_M, v, prev, nxt, head, tail, size)
                    where[v] = NIL
            freq[b] = 0
            incache[b] = True
            if where[b] == _G:
                _unlink(_G, b, prev, nxt, head, tail, size)
                _push(_M, b, prev, nxt, head, tail, size)
                where[b] = _M
            else:
                _push(_S, b, prev, nxt, head, tail, size)
                where[b] = _S
    return total


# flush this module's cached kernels when it or a dependency changed (quillcache._jitcache)
guard_cache(__name__,
            "quillcache.hitrate._klib",
            "quillcache.hitrate.kernels_classic",
            "quillcache.hitrate.kernels_lrb",
            "quillcache.hitrate.kernels_quillhd",
            "quillcache.hitrate.kernels_tinylfu")
