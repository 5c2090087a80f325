"""Numba kernel of QuillHD (``quillcache.policies.quillhd``): per-class LRU lists, ghost-learned
hit densities, and two metadata-only shadow caches that pick the eviction rule. The same kernel
runs its two relatives, which differ only in how a reference is classified and in the order of a
request's blocks: LHD (``classes=CLS_REUSE``, ``quillcache.policies.lhd``) and QuillChain
(``classes=CLS_CHAIN`` with ``leaf_first``, ``quillcache.policies.quillchain``).

Same replay definition and invariants as ``quillcache.hitrate.kernels``; the float operations are
those of the online class, in the same order, so the two agree hit for hit.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from quillcache._jitcache import guard_cache
from quillcache.hitrate._klib import NIL, _prefix_hits, _push, _unlink

HD_SUB = 8  # age buckets per octave above 16
NUM_BUCKETS = 320  # ages up to ~2**40 references


@njit(cache=True, nogil=True)
def age_bucket(a):
    """Quasi-logarithmic age bucket: exact below 16, then 8 buckets per octave."""
    if a < 16:
        return a
    e = math.frexp(float(a))[1] - 4  # bit_length(a) - 4; exact for a < 2**53
    return 16 + (e - 1) * HD_SUB + ((a >> e) - 8)


@njit(cache=True, nogil=True)
def bucket_mid(i):
    if i < 16:
        return float(i)
    e = (i - 16) // HD_SUB + 1
    m = (i - 16) % HD_SUB
    lo = (8 + m) << e
    return float(lo) + float(1 << e) * 0.5


@njit(cache=True, nogil=True)
def _hd_recompute(hh, ee, hd, mids, decay):
    ncls, nb = hh.shape
    for c in range(ncls):
        sh = 0.0
        st = 0.0
        sx = 0.0
        for i in range(nb - 1, -1, -1):
            tot = hh[c, i] + ee[c, i]
            sh += hh[c, i]
            st += tot
            sx += tot * mids[i]
            life = sx - mids[i] * st
            hd[c, i] = sh / life if life > 0.0 else 0.0
        for i in range(nb):
            hh[c, i] *= decay
            ee[c, i] *= decay


CLS_PREFIX = 0  # QuillHD: partial tail / prefix hit or not x reference count
CLS_REUSE = 1  # LHD: first reference, then the log-spaced gap since the previous reference
CLS_CHAIN = 2  # QuillChain: partial tail / prefix hits by references / turns seen on the request's chain


@njit(cache=True, nogil=True)
def bitlen(x):
    n = 0
    while x > 0:
        x >>= 1
        n += 1
    return n


@njit(cache=True, nogil=True)
def reuse_class(gap):
    """LHD's class of a reference: 0 = first reference, 1 = a gap below 128, then one class per
    factor of 4 of the gap (at most 7)."""
    if gap <= 0:
        return 0
    return min(7, 1 + max(0, bitlen(gap) - 6) // 2)


@njit(cache=True, nogil=True)
def turn_class(turns):
    """QuillChain's class of a request's blocks from the turns seen on its chain (1..6)."""
    if turns < 3:
        return 1 + turns
    if turns < 5:
        return 4
    if turns < 9:
        return 5
    return 6


CHAIN_CLASSES = 18  # QuillChain: partial tail, 5 prefix-hit reference-count classes, 6 turn classes x 2


@njit(cache=True, nogil=True)
def ref_class(refs):
    """QuillChain's class offset of a prefix-hit block by its references so far (>= 2): 2, 3,
    4-7, 8-15, >= 16 (0..4)."""
    if refs <= 2:
        return 0
    if refs == 3:
        return 1
    if refs < 8:
        return 2
    if refs < 16:
        return 3
    return 4


@njit(cache=True, nogil=True)
def chain_class(j, k, refs, tcls):
    """QuillChain's class of a full block at position ``j`` of a request with ``k`` prefix hits:
    1..5 a prefix hit seen before (by ``ref_class``), else 6 + 2 * (turn class - 1) + (seen
    before), 6..17."""
    if j < k and refs >= 2:
        return 1 + ref_class(refs)
    return 6 + 2 * (tcls - 1) + (1 if refs >= 2 else 0)


RATE_MIN_REFS = 4  # QuillChain's shared-prefix rate: a forked-from block with at least this many references
RATE_SILENCE_GAPS = 4.0  # ... is valued at its own rate, discounted by exp(-silence / (this many mean gaps))


@njit(cache=True, nogil=True)
def shared_rate(v, t, last, refs, first):
    """The value of a shared-prefix block ``v`` at time ``t`` from its own references: its rate
    while in use, ``r = (refs - 1) / (last - first)``, times ``exp(-age * r / RATE_SILENCE_GAPS)``
    (the longer it has been silent for its rate, the likelier it is no longer used)."""
    span = max(last[v] - first[v], 1)
    r = (refs[v] - 1) / span
    return r * math.exp(-((t - last[v]) * r) / RATE_SILENCE_GAPS)


@njit(cache=True, nogil=True)
def incoming_worth(b, c, t, hd, refs, first, fork, shared):
    """The worth of block ``b`` of class ``c`` being referenced at time ``t`` (``refs`` already
    counts this reference), as ``_qhd_victim`` would value it at age 0: its class's hit density at
    age 0 or, for a block that requests forked from with at least ``RATE_MIN_REFS`` references, its
    own rate ``(refs - 1) / (t - first)`` if that is higher. A shared prompt coming back after an
    eviction is valued by its own rate, not by the class that a block missing from a request's
    prefix falls into."""
    val = hd[c, 0]
    if shared and refs[b] >= RATE_MIN_REFS and fork[b] >= 1:
        r = (refs[b] - 1) / max(t - first[b], 1)
        if r > val:
            val = r
    return val


SECOND_CHANCE_TOKENS = 64 * 512  # QuillChain's LRU rule: second chances per eviction, in prompt tokens' worth


@njit(cache=True, nogil=True)
def second_chance_max(block_tokens):
    """The most second chances per eviction with ``block_tokens``-token blocks:
    ``SECOND_CHANCE_TOKENS // block_tokens`` (at least 1), the same span of a prompt whatever the
    block size (64 at 512-token blocks, 2,048 at 16-token blocks)."""
    return max(1, SECOND_CHANCE_TOKENS // block_tokens)


PERIOD_MIN_REFS = 512  # ``cap_period``: a learning period is at least this many references


@njit(cache=True, nogil=True)
def learning_period(period, capacity):
    """With ``cap_period``, a learning / challenger period lasts ``period`` references but at most
    the capacity in blocks (at least ``PERIOD_MIN_REFS``)."""
    return min(period, max(PERIOD_MIN_REFS, capacity))


RULE_LRU = 0  # evict partial tails (class 0) first, then the globally least recent block
RULE_HD = 1  # evict the class-list head with the lowest learned hit density (ties: older first)


@njit(cache=True, nogil=True)
def _qhd_victim(rule, t, last, head, hd, nb, refs, first, fork, shared):
    """(victim, its worth): under the HD rule a block's worth is its class's hit density at its
    age or, for a block that requests forked from (``shared``, ``fork >= 1``) with at least
    ``RATE_MIN_REFS`` references, its ``shared_rate`` if that is higher; the LRU rule reports 0."""
    ncls = head.shape[0]
    if rule == RULE_LRU:
        if head[0] != NIL:
            return head[0], 0.0
        best = NIL
        for q in range(1, ncls):
            h0 = head[q]
            if h0 != NIL and (best == NIL or last[h0] < last[best]):
                best = h0
        return best, 0.0
    best = NIL
    best_v = 0.0
    best_a = 0
    for q in range(ncls):
        h0 = head[q]
        if h0 != NIL:
            a = t - last[h0]
            bi = age_bucket(a)
            if bi >= nb:
                bi = nb - 1
            val = hd[q, bi]
            if shared and refs[h0] >= RATE_MIN_REFS and fork[h0] >= 1:
                rate = shared_rate(h0, t, last, refs, first)
                if rate > val:
                    val = rate
            if best == NIL or val < best_v or (val == best_v and a > best_a):
                best = h0
                best_v = val
                best_a = a
    return best, best_v


@njit(cache=True, nogil=True, inline="always")
def _qhd_access(b, c_old, c, cap, rule, t, last, lastc, incache, prev, nxt, head, tail, size, hd, nb, cnt, inst,
                admit, byp, refs, first, fork, shared, vis, second, sc_max):
    """One reference in one cache instance (real or shadow; ``cnt[inst]`` counts its blocks);
    returns +1 on insert, 0 on touch, -1 when the block is not admitted.

    ``second`` (second chance, the LRU rule only): a cached block touched when it has at least two
    references and a fork (a shared prefix used again while cached) is marked in ``vis[inst]``; a
    marked victim is unmarked and re-queued at the tail of its class instead, up to
    ``sc_max`` (``second_chance_max``) times per eviction.

    ``admit`` (the HD rule only): a new block worth less than its victim is not stored, and neither
    is any later uncached block of the same request in this instance (``byp[inst]``; it could not
    be a prefix hit without this one). Worth is measured the same way on both sides: the victim's
    is ``_qhd_victim``'s, the new block's is ``incoming_worth``."""
    if incache[b]:
        _unlink(c_old, b, prev, nxt, head, tail, size)
        _push(c, b, prev, nxt, head, tail, size)
        if second and refs[b] >= 2 and fork[b] >= 1:
            vis[inst, b] = True
        return 0
    if byp[inst]:
        return -1
    if cnt[inst] >= cap:
        v, worth = _qhd_victim(rule, t, last, head, hd, nb, refs, first, fork, shared)
        if second and rule == RULE_LRU:
            for _ in range(sc_max):
                if v == NIL or not vis[inst, v]:
                    break
                vis[inst, v] = False
                _unlink(lastc[v], v, prev, nxt, head, tail, size)
                _push(lastc[v], v, prev, nxt, head, tail, size)
                v, worth = _qhd_victim(rule, t, last, head, hd, nb, refs, first, fork, shared)
        if admit and rule == RULE_HD:
            if incoming_worth(b, c, t, hd, refs, first, fork, shared) < worth:
                byp[inst] = True
                return -1
        _unlink(lastc[v], v, prev, nxt, head, tail, size)
        incache[v] = False
        vis[inst, v] = False
    else:
        cnt[inst] += 1
    incache[b] = True
    _push(c, b, prev, nxt, head, tail, size)
    return 1


@njit(cache=True, nogil=True)
def _quantile_age(rd, q):
    tot = 0.0
    for i in range(rd.shape[0]):
        tot += rd[i]
    if tot <= 0.0:
        return 0
    acc = 0.0
    for i in range(rd.shape[0]):
        acc += rd[i]
        if acc >= q * tot:
            return int(bucket_mid(i))
    return int(bucket_mid(rd.shape[0] - 1))


@njit(cache=True, nogil=True)
def quillhd(off, blocks, u, cap, hits, input_tokens, block_tokens, period, decay, nb, quantile, che_mult, mode,
            classes, leaf_first, admit, shared, second, cap_period, start_lru):
    """QuillHD (``quillcache.policies.quillhd``). mode 0 = adaptive (follow the better of two
    metadata-only shadow caches), 1 = hit-density rule only, 2 = tail-first LRU rule only,
    3 = challenger (one shadow runs the rule the real cache does not; the two swap when the shadow
    had more decayed prefix hits over a period).
    ``classes``: CLS_PREFIX, CLS_REUSE or CLS_CHAIN; ``leaf_first``: after each request, its cached
    blocks are re-queued deepest first, so within a class a chain loses its leaves before its root;
    ``admit``: the HD rule refuses a new block worth less than its victim (see ``_qhd_access``);
    ``shared`` (CLS_CHAIN only): a block that requests forked from is worth at least its
    ``shared_rate``; ``second`` (CLS_CHAIN only): the LRU rule gives a second chance to shared
    prefixes used again while cached (``_qhd_access``), at most
    ``second_chance_max(block_tokens)`` per eviction; ``cap_period``: a period lasts at most as many
    references as the cache holds blocks (``learning_period``), so learned densities remember a few
    cache lifetimes; ``start_lru`` (modes 0 and 3): the real cache starts on the LRU rule (in mode 3
    the shadow on the HD rule) instead of the HD rule, whose densities are not learned yet."""
    ncls = CHAIN_CLASSES if classes == CLS_CHAIN else 8
    sc_max = second_chance_max(block_tokens)
    byp = np.zeros(3, np.bool_)  # per instance: a block of the current request was not admitted
    ends = np.zeros(u, np.int32)  # requests whose last full block was this block (CLS_CHAIN)
    last = np.zeros(u, np.int64)  # time of last reference (0 = never)
    lastc = np.zeros(u, np.int8)
    refs = np.zeros(u, np.int64)
    first = np.zeros(u, np.int64)  # time of the first reference
    fork = np.zeros(u, np.int32)  # requests that branched off a known prefix through this block (shared)
    expired = np.zeros(u, np.bool_)
    vis = np.zeros((3, u), np.bool_)  # per instance: second chance earned (``second``)
    n_inst = 3
    incache = np.zeros((n_inst, u), np.bool_)
    prev = np.full((n_inst, u), NIL, np.int32)
    nxt = np.full((n_inst, u), NIL, np.int32)
    head = np.full((n_inst, ncls), NIL, np.int32)
    tail = np.full((n_inst, ncls), NIL, np.int32)
    size = np.zeros((n_inst, ncls), np.int64)
    hh = np.zeros((ncls, nb), np.float64)
    ee = np.zeros((ncls, nb), np.float64)
    hd = np.zeros((ncls, nb), np.float64)
    rd = np.zeros(nb, np.float64)
    mids = np.empty(nb, np.float64)
    for i in range(nb):
        mids[i] = bucket_mid(i)
    # row views made once (making them per reference costs reference-count traffic)
    inc0, inc1, inc2 = incache[0], incache[1], incache[2]
    prev0, prev1, prev2 = prev[0], prev[1], prev[2]
    nxt0, nxt1, nxt2 = nxt[0], nxt[1], nxt[2]
    head0, head1, head2 = head[0], head[1], head[2]
    tail0, tail1, tail2 = tail[0], tail[1], tail[2]
    size0, size1, size2 = size[0], size[1], size[2]
    cnt = np.zeros(3, np.int64)  # blocks held by the real cache and the two shadows
    score = np.zeros(3, np.float64)  # decayed prefix hits of shadow LRU (1), shadow HD (2)
    horizon = 2 * cap
    hb = min(age_bucket(horizon), nb - 1)  # the age bucket of the horizon (expired lifetimes)
    rule = RULE_LRU if mode == 2 or (start_lru and (mode == 0 or mode == 3)) else RULE_HD
    shadow_rule = RULE_HD if rule == RULE_LRU else RULE_LRU  # mode 3: the rule the one shadow runs
    t = 0
    exp_pos = 0
    plen = learning_period(period, cap) if cap_period else period  # the capacity is fixed here
    next_upd = plen
    n_ins = 0
    total = 0
    for r in range(off.shape[0] - 1):
        k = _prefix_hits(off, blocks, r, inc0)
        hits[r] = k
        total += k
        if mode == 0:
            score[1] += _prefix_hits(off, blocks, r, inc1)
            score[2] += _prefix_hits(off, blocks, r, inc2)
        elif mode == 3:
            score[0] += k
            score[1] += _prefix_hits(off, blocks, r, inc1)
        byp[0] = False
        byp[1] = False
        byp[2] = False
        s, e = off[r], off[r + 1]
        partial = input_tokens[r] % block_tokens != 0
        tcls = 0
        if classes == CLS_CHAIN:
            turns = 0
            m = 0
            for p in range(s, e):
                if last[blocks[p]] == 0:
                    break
                turns += min(ends[blocks[p]], 1)
                m += 1
            tcls = turn_class(turns)
            # a fork: the known prefix ends inside the request, where no earlier request ended
            # (a new branch of a shared prefix, not the next turn of a conversation)
            if (shared or second) and 0 < m < e - s and ends[blocks[s + m - 1]] == 0:
                for p in range(s, s + m):
                    fork[blocks[p]] += 1
        for p in range(s, e):
            b = blocks[p]
            t += 1
            while exp_pos < p and t - (exp_pos + 1) > horizon:
                x = blocks[exp_pos]
                if last[x] == exp_pos + 1 and not expired[x]:
                    ee[lastc[x], hb] += 1.0
                    expired[x] = True
                exp_pos += 1
            gap = t - last[b] if last[b] != 0 else 0
            if last[b] != 0:
                bi = age_bucket(t - last[b])
                if bi >= nb:
                    bi = nb - 1
                rd[bi] += 1.0
                if not expired[b]:
                    hh[lastc[b], bi] += 1.0
            expired[b] = False
            refs[b] += 1
            if refs[b] == 1:
                first[b] = t
            j = p - s
            if classes == CLS_REUSE:
                c = reuse_class(gap)
            elif j == e - s - 1 and partial:
                c = 0
            elif classes == CLS_CHAIN:
                c = chain_class(j, k, refs[b], tcls)
            else:
                n = min(4, refs[b])
                c = n if j >= k else 3 + n
            c_old = lastc[b]
            if _qhd_access(b, c_old, c, cap, rule, t, last, lastc, inc0, prev0, nxt0, head0, tail0, size0, hd, nb,
                           cnt, 0, admit, byp, refs, first, fork, shared, vis, second, sc_max) > 0:
                n_ins += 1
            if mode == 0:
                _qhd_access(b, c_old, c, cap, RULE_LRU, t, last, lastc, inc1, prev1, nxt1, head1, tail1, size1, hd, nb,
                            cnt, 1, admit, byp, refs, first, fork, shared, vis, second, sc_max)
                _qhd_access(b, c_old, c, cap, RULE_HD, t, last, lastc, inc2, prev2, nxt2, head2, tail2, size2, hd, nb,
                            cnt, 2, admit, byp, refs, first, fork, shared, vis, second, sc_max)
            elif mode == 3:
                _qhd_access(b, c_old, c, cap, shadow_rule, t, last, lastc, inc1, prev1, nxt1, head1, tail1, size1, hd,
                            nb, cnt, 1, admit, byp, refs, first, fork, shared, vis, second, sc_max)
            last[b] = t
            lastc[b] = c
            if t >= next_upd:
                next_upd += plen
                che = che_mult * cap * plen / max(n_ins, 1)
                n_ins = 0
                qa = _quantile_age(rd, quantile)
                horizon = int(max(che, qa, 1.0))
                hb = min(age_bucket(horizon), nb - 1)
                _hd_recompute(hh, ee, hd, mids, decay)
                for i in range(nb):
                    rd[i] *= decay
                if mode == 0:
                    rule = RULE_HD if score[2] >= score[1] else RULE_LRU
                    score[1] *= decay
                    score[2] *= decay
                elif mode == 3:
                    if score[1] > score[0]:  # the shadow's rule did better: swap the rules, start over
                        rule, shadow_rule = shadow_rule, rule
                        score[0] = 0.0
                        score[1] = 0.0
                    else:
                        score[0] *= decay
                        score[1] *= decay
        if classes == CLS_CHAIN:
            lf = e - 2 if partial else e - 1
            if lf >= s:
                ends[blocks[lf]] += 1
        if leaf_first:
            for p in range(e - 1, s - 1, -1):
                b = blocks[p]
                c = lastc[b]
                if inc0[b]:
                    _unlink(c, b, prev0, nxt0, head0, tail0, size0)
                    _push(c, b, prev0, nxt0, head0, tail0, size0)
    return total


guard_cache(__name__, "quillcache.hitrate._klib")  # flush this module's cached kernels when a dependency changed
