"""Numba kernels of the list-based baselines from the literature: SIEVE, ARC and 2Q; and the
semi-online lookahead-W LRU (``quillcache.policies.lookahead``), which sees the queued requests.

Same replay definition and invariants as ``quillcache.hitrate.kernels``: each reproduces, hit
for hit, the online class of the same name (``quillcache.policies.sieve``, ``.arc``, ``.twoq``)
driven by ``quillcache.hitrate.reference``; every step is O(1) amortised (flat-array linked
lists; SIEVE's hand clears each visited bit once per pass).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from quillcache._jitcache import guard_cache
from quillcache.hitrate._klib import NIL, _lists, _prefix_hits, _push, _unlink

__all__ = ["arc", "lookahead", "sieve", "twoq"]


@njit(cache=True, nogil=True)
def sieve(off, blocks, u, cap, hits):
    """SIEVE (``SievePolicy``): FIFO order, visited bits, a hand moving from old to new."""
    incache = np.zeros(u, np.bool_)
    visited = np.zeros(u, np.bool_)
    prev, nxt, head, tail, size = _lists(u, 1)
    hand = NIL
    total = 0
    for r in range(off.shape[0] - 1):
        k = _prefix_hits(off, blocks, r, incache)
        hits[r] = k
        total += k
        for p in range(off[r], off[r + 1]):
            b = blocks[p]
            if incache[b]:
                visited[b] = True
                continue
            if size[0] >= cap:
                cur = hand if hand != NIL else head[0]
                while visited[cur]:
                    visited[cur] = False
                    cur = nxt[cur]
                    if cur == NIL:
                        cur = head[0]
                hand = nxt[cur]
                _unlink(0, cur, prev, nxt, head, tail, size)
                incache[cur] = False
            _push(0, b, prev, nxt, head, tail, size)
            incache[b] = True
            visited[b] = False
    return total


_T1, _T2, _B1, _B2 = 0, 1, 2, 3
_NONE = -1


@njit(cache=True, nogil=True)
def arc(off, blocks, u, cap, hits):
    """ARC (``ArcPolicy``): T1/T2 with ghosts B1/B2 and the adaptive target p."""
    where = np.full(u, _NONE, np.int8)
    prev, nxt, head, tail, size = _lists(u, 4)
    c = float(cap)
    p_t = 0.0
    total = 0
    for r in range(off.shape[0] - 1):
        k = 0
        for q in range(off[r], off[r + 1]):
            w = where[blocks[q]]
            if w == _T1 or w == _T2:
                k += 1
            else:
                break
        hits[r] = k
        total += k
        for p in range(off[r], off[r + 1]):
            b = blocks[p]
            w = where[b]
            if w == _T1 or w == _T2:
                _unlink(w, b, prev, nxt, head, tail, size)
                _push(_T2, b, prev, nxt, head, tail, size)
                where[b] = _T2
                continue
            if w == _B1:
                p_t = min(c, p_t + max(1.0, size[_B2] / size[_B1]))
            elif w == _B2:
                p_t = max(0.0, p_t - max(1.0, size[_B1] / size[_B2]))
            if size[_T1] + size[_T2] >= cap:
                n1 = size[_T1]
                if n1 > 0 and (n1 > p_t or (w == _B2 and n1 == p_t) or size[_T2] == 0):
                    v = head[_T1]
                    _unlink(_T1, v, prev, nxt, head, tail, size)
                    _push(_B1, v, prev, nxt, head, tail, size)
                    where[v] = _B1
                else:
                    v = head[_T2]
                    _unlink(_T2, v, prev, nxt, head, tail, size)
                    _push(_B2, v, prev, nxt, head, tail, size)
                    where[v] = _B2
            w = where[b]  # the victim's move may not touch b (b is not cached), but read again for clarity
            if w == _B1 or w == _B2:
                _unlink(w, b, prev, nxt, head, tail, size)
                _push(_T2, b, prev, nxt, head, tail, size)
                where[b] = _T2
            else:
                _push(_T1, b, prev, nxt, head, tail, size)
                where[b] = _T1
            while size[_B1] > 0 and size[_T1] + size[_B1] > cap:
                g = head[_B1]
                _unlink(_B1, g, prev, nxt, head, tail, size)
                where[g] = _NONE
            while size[_B2] > 0 and size[_T1] + size[_T2] + size[_B1] + size[_B2] > 2 * cap:
                g = head[_B2]
                _unlink(_B2, g, prev, nxt, head, tail, size)
                where[g] = _NONE
    return total


_IN, _AM, _OUT = 0, 1, 2


@njit(cache=True, nogil=True)
def twoq(off, blocks, u, cap, hits, kin_ratio, kout_ratio):
    """2Q (``TwoQPolicy``): A1in FIFO, A1out ghost FIFO, Am LRU."""
    where = np.full(u, _NONE, np.int8)
    prev, nxt, head, tail, size = _lists(u, 3)
    kin = kin_ratio * cap
    kout = kout_ratio * cap
    total = 0
    for r in range(off.shape[0] - 1):
        k = 0
        for q in range(off[r], off[r + 1]):
            w = where[blocks[q]]
            if w == _IN or w == _AM:
                k += 1
            else:
                break
        hits[r] = k
        total += k
        for p in range(off[r], off[r + 1]):
            b = blocks[p]
            w = where[b]
            if w == _AM:
                _unlink(_AM, b, prev, nxt, head, tail, size)
                _push(_AM, b, prev, nxt, head, tail, size)
                continue
            if w == _IN:
                continue
            if size[_IN] + size[_AM] >= cap:
                if size[_IN] > kin or size[_AM] == 0:
                    v = head[_IN]
                    _unlink(_IN, v, prev, nxt, head, tail, size)
                    _push(_OUT, v, prev, nxt, head, tail, size)
                    where[v] = _OUT
                    while size[_OUT] > 0 and size[_OUT] > kout:
                        g = head[_OUT]
                        _unlink(_OUT, g, prev, nxt, head, tail, size)
                        where[g] = _NONE
                else:
                    v = head[_AM]
                    _unlink(_AM, v, prev, nxt, head, tail, size)
                    where[v] = _NONE
            if where[b] == _OUT:
                _unlink(_OUT, b, prev, nxt, head, tail, size)
                _push(_AM, b, prev, nxt, head, tail, size)
                where[b] = _AM
            else:
                _push(_IN, b, prev, nxt, head, tail, size)
                where[b] = _IN
    return total


@njit(cache=True, nogil=True)
def lookahead(off, blocks, u, cap, hits, next_use, window_requests):
    """Lookahead-W LRU (``LookaheadPolicy``): the least recent block no queued request references,
    else the one referenced last in the window. SEMI-ONLINE: it reads ``next_use`` only to compare
    it with the window's end. ``window_requests``: any int64 >= 0; every window that reaches the
    trace's last request is the same policy (``simulate`` passes at most the number of requests)."""
    incache = np.zeros(u, np.bool_)
    nxt_use = np.zeros(u, np.int64)
    prev, nxt, head, tail, size = _lists(u, 1)
    nreq = off.shape[0] - 1
    total = 0
    for r in range(nreq):
        k = _prefix_hits(off, blocks, r, incache)
        hits[r] = k
        total += k
        # the window ends at request r + 1 + window_requests, or at the trace's end; compared without
        # forming r + 1 + window_requests, which overflows int64 for a window near 2**63
        end = off[nreq] if window_requests >= nreq - r - 1 else off[r + 1 + window_requests]
        for p in range(off[r], off[r + 1]):
            b = blocks[p]
            if incache[b]:
                _unlink(0, b, prev, nxt, head, tail, size)
            elif size[0] >= cap:
                v = NIL
                best = NIL
                best_nu = -1
                c = head[0]
                while c != NIL:
                    if nxt_use[c] >= end:
                        v = c
                        break
                    if nxt_use[c] > best_nu:
                        best = c
                        best_nu = nxt_use[c]
                    c = nxt[c]
                if v == NIL:
                    v = best
                _unlink(0, v, prev, nxt, head, tail, size)
                incache[v] = False
            _push(0, b, prev, nxt, head, tail, size)
            incache[b] = True
            nxt_use[b] = next_use[p]
    return total


guard_cache(__name__, "quillcache.hitrate._klib")  # flush this module's cached kernels when a dependency changed
