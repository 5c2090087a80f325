"""Numba kernel of the LRB-style learned policy (``quillcache.policies.lrb``).

Same replay definition and invariants as ``quillcache.hitrate.kernels``; the float operations
(dot products in feature order, the SGD step, ``ldexp``/``floor``) and the SplitMix64 draws are
those of the online class, in the same order, so the two agree hit for hit.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from quillcache._jitcache import guard_cache
from quillcache._mix import splitmix64_nb as mix64
from quillcache.hitrate._klib import _prefix_hits
from quillcache.hitrate.kernels_quillhd import bitlen

NF = 8
SCALE = 16.0
MAX_LOG_GAP = 40.0


@njit(cache=True, nogil=True)
def exp2_exact(x):
    f = math.floor(x)
    return math.ldexp(1.0 + (x - f), int(f))


@njit(cache=True, nogil=True)
def _train(w, x, y, lr):
    pred = 0.0
    for i in range(NF):
        pred += w[i] * x[i]
    step = lr * (y - pred)
    for i in range(NF):
        w[i] += step * x[i]


@njit(cache=True, nogil=True)
def lrb(off, blocks, u, cap, hits, input_tokens, block_tokens, sample_size, window_mult, lr, seed):
    incache = np.zeros(u, np.bool_)
    last = np.zeros(u, np.int64)
    refs = np.zeros(u, np.int64)
    gap1 = np.zeros(u, np.int64)
    gap2 = np.zeros(u, np.int64)
    labeled = np.zeros(u, np.bool_)
    nxt_t = np.zeros(u, np.float64)
    feats = np.zeros((u, NF), np.float64)
    slots = np.empty(cap, np.int32)
    slot_of = np.full(u, -1, np.int64)
    w = np.zeros(NF, np.float64)
    x = np.zeros(NF, np.float64)
    window = window_mult * cap
    y_exp = float(bitlen(2 * window))
    ctr = np.uint64(seed)
    one = np.uint64(1)
    n = 0
    t = 0
    exp_pos = 0
    total = 0
    for r in range(off.shape[0] - 1):
        k = _prefix_hits(off, blocks, r, incache)
        hits[r] = k
        total += k
        s, e = off[r], off[r + 1]
        partial = input_tokens[r] % block_tokens != 0
        for p in range(s, e):
            b = blocks[p]
            if not incache[b]:
                if n >= cap:
                    now = t + 1
                    best = -1
                    best_s = 0.0
                    for _ in range(sample_size):
                        z = mix64(ctr)
                        ctr += one
                        c = slots[np.int64(z % np.uint64(n))]
                        sc = max(nxt_t[c] - now, float(now - last[c]))
                        if best < 0 or sc > best_s:
                            best = c
                            best_s = sc
                    i = slot_of[best]
                    lastb = slots[n - 1]
                    slots[i] = lastb
                    slot_of[lastb] = i
                    slot_of[best] = -1
                    n -= 1
                    incache[best] = False
                slots[n] = b
                slot_of[b] = n
                n += 1
                incache[b] = True
            # the reference: learn from what has become known, then predict
            t += 1
            while exp_pos < p and t - (exp_pos + 1) > window:
                xb = blocks[exp_pos]
                if last[xb] == exp_pos + 1 and not labeled[xb]:
                    _train(w, feats[xb], y_exp, lr)
                    labeled[xb] = True
                exp_pos += 1
            if last[b] != 0:
                gap = t - last[b]
                if not labeled[b]:
                    _train(w, feats[b], float(bitlen(gap)), lr)
                gap2[b] = gap1[b]
                gap1[b] = gap
            refs[b] += 1
            j = p - s
            ln = e - s
            x[0] = 1.0
            x[1] = bitlen(j + 1) / SCALE
            x[2] = bitlen(ln) / SCALE
            x[3] = bitlen(gap1[b]) / SCALE
            x[4] = bitlen(gap2[b]) / SCALE
            x[5] = bitlen(refs[b]) / SCALE
            x[6] = 1.0 if (j == ln - 1 and partial) else 0.0
            x[7] = 1.0 if j < k else 0.0
            pred = 0.0
            for i in range(NF):
                pred += w[i] * x[i]
            pred = min(max(pred, 0.0), MAX_LOG_GAP)
            nxt_t[b] = t + exp2_exact(pred)
            for i in range(NF):
                feats[b, i] = x[i]
            labeled[b] = False
            last[b] = t
    return total


# flush this module's cached kernels when it or a dependency changed (quillcache._jitcache)
guard_cache(__name__, "quillcache._mix", "quillcache.hitrate._klib", "quillcache.hitrate.kernels_quillhd")
