"""Numba kernel of W-TinyLFU (``quillcache.policies.tinylfu``), with the count-min sketch and
doorkeeper hashed bit for bit as ``quillcache.sketch.reference`` (splitmix64 from
``quillcache._mix``, double hashing, multiply-shift columns). Same replay definition and
invariants as ``quillcache.hitrate.kernels``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from quillcache._jitcache import guard_cache
from quillcache._mix import splitmix64_nb as mix64
from quillcache.hitrate._klib import NIL, _lists, _prefix_hits, _push, _unlink

_MASK32 = np.uint64(0xFFFFFFFF)


@njit(cache=True, nogil=True)
def _columns(key, skey, width, depth, out):
    h = mix64(np.uint64(key) ^ skey)
    h1 = h & _MASK32
    h2 = h >> np.uint64(32)
    w = np.uint64(width)
    for i in range(depth):
        g = (h1 + np.uint64(i) * h2) & _MASK32
        out[i] = np.int64((g * w) >> np.uint64(32))


@njit(cache=True, nogil=True)
def _tl_freq(b, cms, cms_skey, dk, dk_skey, cols, dcols):
    width = cms.shape[1]
    depth = cms.shape[0]
    _columns(b, cms_skey, width, depth, cols)
    est = cms[0, cols[0]]
    for i in range(1, depth):
        est = min(est, cms[i, cols[i]])
    est = np.int64(est)
    if dk.shape[0] > 0:
        _columns(b, dk_skey, dk.shape[0], dcols.shape[0], dcols)
        ind = True
        for i in range(dcols.shape[0]):
            if dk[dcols[i]] == 0:
                ind = False
        if ind:
            est += 1
    return est


@njit(cache=True, nogil=True)
def tinylfu(off, blocks, u, cap, hits, window_cap, main_cap, protected_cap, sample_size, width, depth,
            cms_skey, dk_bits, dk_skey):
    """W-TinyLFU exactly as ``TinyLfuPolicy(capacity_keys=cap)`` (see that module)."""
    win, prob, prot = 0, 1, 2
    where = np.full(u, NIL, np.int8)
    prev, nxt, head, tail, size = _lists(u, 3)
    cms = np.zeros((depth, width), np.uint32)
    dk = np.zeros(dk_bits, np.uint8)
    cols = np.zeros(depth, np.int64)
    dcols = np.zeros(3, np.int64)
    since = 0
    total = 0
    incache = np.zeros(u, np.bool_)
    for r in range(off.shape[0] - 1):
        k = _prefix_hits(off, blocks, r, incache)
        hits[r] = k
        total += k
        for p in range(off[r], off[r + 1]):
            b = blocks[p]
            if not incache[b] and size[win] + size[prob] + size[prot] >= cap:
                # victim(): the window candidate duels main's victim
                v = NIL
                while size[win] > 0 and size[win] >= window_cap:
                    cand = head[win]
                    if size[prob] + size[prot] < main_cap:
                        _unlink(win, cand, prev, nxt, head, tail, size)
                        _push(prob, cand, prev, nxt, head, tail, size)
                        where[cand] = prob
                        continue
                    mv = head[prob] if head[prob] != NIL else head[prot]
                    if mv == NIL:
                        v = cand
                        break
                    if (_tl_freq(cand, cms, cms_skey, dk, dk_skey, cols, dcols)
                            > _tl_freq(mv, cms, cms_skey, dk, dk_skey, cols, dcols)):
                        _unlink(win, cand, prev, nxt, head, tail, size)
                        _push(prob, cand, prev, nxt, head, tail, size)
                        where[cand] = prob
                        v = mv
                    else:
                        v = cand
                    break
                if v == NIL:
                    v = head[prob] if head[prob] != NIL else head[prot]
                    if v == NIL:
                        v = head[win]
                _unlink(where[v], v, prev, nxt, head, tail, size)
                where[v] = NIL
                incache[v] = False
            # record the access (insert or touch)
            if dk_bits > 0:
                _columns(b, dk_skey, dk_bits, 3, dcols)
                seen = True
                for i in range(3):
                    if dk[dcols[i]] == 0:
                        seen = False
                if seen:
                    _columns(b, cms_skey, width, depth, cols)
                    m = cms[0, cols[0]]
                    for i in range(1, depth):
                        m = min(m, cms[i, cols[i]])
                    if m < np.uint32(0xFFFFFFFF):
                        m += np.uint32(1)
                    for i in range(depth):
                        cms[i, cols[i]] = max(cms[i, cols[i]], m)
                else:
                    for i in range(3):
                        dk[dcols[i]] = 1
            else:
                _columns(b, cms_skey, width, depth, cols)
                m = cms[0, cols[0]]
                for i in range(1, depth):
                    m = min(m, cms[i, cols[i]])
                if m < np.uint32(0xFFFFFFFF):
                    m += np.uint32(1)
                for i in range(depth):
                    cms[i, cols[i]] = max(cms[i, cols[i]], m)
            since += 1
            if since >= sample_size:
                for i in range(depth):
                    for j in range(width):
                        cms[i, j] >>= np.uint32(1)
                dk[:] = 0
                since = 0
            # membership
            if incache[b]:
                w = where[b]
                if w == win:
                    _unlink(win, b, prev, nxt, head, tail, size)
                    _push(win, b, prev, nxt, head, tail, size)
                elif w == prot:
                    _unlink(prot, b, prev, nxt, head, tail, size)
                    _push(prot, b, prev, nxt, head, tail, size)
                else:
                    _unlink(prob, b, prev, nxt, head, tail, size)
                    _push(prot, b, prev, nxt, head, tail, size)
                    where[b] = prot
                    if size[prot] > protected_cap:
                        d = head[prot]
                        _unlink(prot, d, prev, nxt, head, tail, size)
                        _push(prob, d, prev, nxt, head, tail, size)
                        where[d] = prob
            else:
                incache[b] = True
                _push(win, b, prev, nxt, head, tail, size)
                where[b] = win
    return total


# flush this module's cached kernels when it or a dependency changed (quillcache._jitcache)
guard_cache(__name__, "quillcache._mix", "quillcache.hitrate._klib")
