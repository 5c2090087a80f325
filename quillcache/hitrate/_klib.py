"""Shared Numba building blocks of the hit-rate kernels: flat-array doubly linked lists, a
binary min-heap over (k1, k2) int64 pairs with lazy deletion, and the prefix-hit count.

Lists: ``prev``/``nxt`` are int32[U] indexed by dense block id (one block is in at most one list
of a given set); ``head``/``tail`` int32[K] and ``size`` int64[K] describe K lists; NIL = -1.
Heap: parallel arrays ``h1``, ``h2`` (keys) and ``hb`` (block); an entry is live while its keys
equal the block's current keys (callers keep those), stale entries are dropped lazily.
"""

from __future__ import annotations

import numpy as np
from numba import njit

NIL = -1

# ---------------------------------------------------------------- shared helpers


@njit(cache=True, nogil=True)
def _prefix_hits(off, blocks, r, incache):
    s, e = off[r], off[r + 1]
    k = 0
    for p in range(s, e):
        if incache[blocks[p]]:
            k += 1
        else:
            break
    return k


@njit(cache=True, nogil=True)
def _push(q, b, prev, nxt, head, tail, size):
    """Append b at the tail (most recent end) of list q."""
    t = tail[q]
    prev[b] = t
    nxt[b] = NIL
    if t == NIL:
        head[q] = b
    else:
        nxt[t] = b
    tail[q] = b
    size[q] += 1


@njit(cache=True, nogil=True)
def _unlink(q, b, prev, nxt, head, tail, size):
    p, n = prev[b], nxt[b]
    if p == NIL:
        head[q] = n
    else:
        nxt[p] = n
    if n == NIL:
        tail[q] = p
    else:
        prev[n] = p
    prev[b] = NIL
    nxt[b] = NIL
    size[q] -= 1


@njit(cache=True, nogil=True)
def _lists(u, k):
    prev = np.full(u, NIL, np.int32)
    nxt = np.full(u, NIL, np.int32)
    head = np.full(k, NIL, np.int32)
    tail = np.full(k, NIL, np.int32)
    size = np.zeros(k, np.int64)
    return prev, nxt, head, tail, size


# -- a binary min-heap over (k1, k2) int64 pairs with a block payload; lazy deletion by caller --


@njit(cache=True, nogil=True)
def _less(a1, a2, b1, b2):
    return a1 < b1 or (a1 == b1 and a2 < b2)


@njit(cache=True, nogil=True)
def _heap_push(h1, h2, hb, n, k1, k2, b):
    i = n
    h1[i], h2[i], hb[i] = k1, k2, b
    while i > 0:
        p = (i - 1) >> 1
        if _less(h1[i], h2[i], h1[p], h2[p]):
            h1[i], h1[p] = h1[p], h1[i]
            h2[i], h2[p] = h2[p], h2[i]
            hb[i], hb[p] = hb[p], hb[i]
            i = p
        else:
            break
    return n + 1


@njit(cache=True, nogil=True)
def _heap_pop(h1, h2, hb, n):
    n -= 1
    h1[0], h2[0], hb[0] = h1[n], h2[n], hb[n]
    i = 0
    while True:
        lft = 2 * i + 1
        if lft >= n:
            break
        c = lft
        if lft + 1 < n and _less(h1[lft + 1], h2[lft + 1], h1[lft], h2[lft]):
            c = lft + 1
        if _less(h1[c], h2[c], h1[i], h2[i]):
            h1[i], h1[c] = h1[c], h1[i]
            h2[i], h2[c] = h2[c], h2[i]
            hb[i], hb[c] = hb[c], hb[i]
            i = c
        else:
            break
    return n


@njit(cache=True, nogil=True)
def _heap_compact(h1, h2, hb, n, live1, live2, incache):
    """Drop stale entries and re-heapify (keeps the heap within 2x the live entries)."""
    m = 0
    for i in range(n):
        b = hb[i]
        if incache[b] and h1[i] == live1[b] and h2[i] == live2[b]:
            h1[m], h2[m], hb[m] = h1[i], h2[i], b
            m += 1
    # heapify bottom-up
    for start in range((m - 2) // 2, -1, -1):
        i = start
        while True:
            lft = 2 * i + 1
            if lft >= m:
                break
            c = lft
            if lft + 1 < m and _less(h1[lft + 1], h2[lft + 1], h1[lft], h2[lft]):
                c = lft + 1
            if _less(h1[c], h2[c], h1[i], h2[i]):
                h1[i], h1[c] = h1[c], h1[i]
                h2[i], h2[c] = h2[c], h2[i]
                hb[i], hb[c] = hb[c], hb[i]
                i = c
            else:
                break
    return m
