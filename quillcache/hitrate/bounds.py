"""Information bounds: offline replays that know one part of the future, to say what part of the
LRU-to-Belady gap an online policy is missing.

Belady knows, at every reference, *when* each block will be referenced next. ``reuse_oracle``
knows only *whether* the block being referenced will be referenced again (ever), and uses nothing
else: it is LRU that never admits a block with no future reference and, when it must evict,
takes a block whose references are over (least recent first) before any other (least recent
first). On a prefix-chained trace "referenced again" is a property of a request's conversation
(does it get another turn, is its prompt shared), so the gap between LRU and ``reuse_oracle`` is
the value of predicting *which* sessions come back, and the gap between ``reuse_oracle`` and
Belady the value of predicting *when*.

``flip_rate`` makes the oracle a predictor with errors: for a request drawn with probability
``flip_rate`` (``numpy.random.default_rng(seed)``, one draw per request, so a prediction is wrong
about a whole request, as a per-request classifier would be), every one of its reuse bits is
inverted. The hit rate as a function of ``flip_rate`` says how accurate an online predictor of
reuse must be to close a given share of the gap.

``timing_oracle`` is the other half: Belady itself (with bypass), but its knowledge of *when* is
wrong by a factor. It knows exactly which blocks are referenced again, and for each request
``q`` a factor ``exp(sigma * Z_q)`` (``Z_q`` standard normal, ``numpy.random.default_rng(seed)``,
one draw per request) stretches or shrinks the distance to every next use that falls in ``q``:
the whole return of a conversation is early or late together, as a predictor of the next turn's
arrival would be. ``sigma = 0`` is Belady. The hit rate as a function of ``sigma`` says how much
of the gap knowing *when* is worth once *which* is known.

Both at once (``joint_oracle``): the timing oracle made wrong about *which* as well
(``noisy_next_use(..., flip_rate=f)``). For a request drawn with probability ``f`` (its own
stream, independent of the timing factors: ``numpy.random.default_rng([seed, 1])``) every block
*new* in it (its first reference in the trace) is believed the other way, as a per-request
predictor of "does this request's new content come back" would get it wrong; blocks it shares with
earlier requests keep their true future (generous to the oracle). A new block that is referenced
again is believed never to be (key ``NEVER + p``), and one that is not is believed to come back
after a distance drawn from the trace's own reuse distances (``false_return_distances``, stream
``[seed, 2]``): the return a predictor that expects one would assume (``f = 0`` draws nothing). A
belief in a return that does not come is not kept for ever, as a key in the past would be by
Belady (the nearest of all): the joint oracle gives up on a block once it is ``GIVE_UP_SIGMAS`` of
its own log-errors overdue (the believed distance times ``exp(2 sigma)``; ``give_up_positions``).
Victims (``_expiring_belady``): a block believed never to come back first (and such a block is
never stored into a full cache), then the blocks given up on, earliest first, then Belady with
bypass on the keys. So at ``f = 0`` it is the timing oracle except for the returns it believed more
than that much earlier (about 2% of requests, ``Z < -2``), and at ``f = 0`` and ``sigma = 0`` no
key passes and it is Belady. It says what share of the gap a policy could close that commits to a
reuse predictor of a given per-request accuracy and a timing predictor of a given spread.

Rounded keys can collide; collisions are
broken by position without reordering distinct keys (``noisy_next_use``), so every key is distinct
as in ``TraceArrays.next_use`` and ``timing_oracle`` agrees with its plain-Python specification
``timing_oracle_reference`` (``BeladyPolicy`` through ``quillcache.hitrate.reference``) hit for hit.

These are not online policies (they read ``TraceArrays.next_use``) and are not in the policy
registry; they are reported apart from online results, like Belady.

Capacity: every bound takes ``capacity_blocks`` >= 1 and, as ``simulate`` does, runs a capacity at
or above the trace's distinct blocks as exactly that many (``clamp_capacity``): such a cache never
evicts, so the hits are the same, and the heaps sized by the capacity stay O(distinct blocks).

Definition of a replay step (REFERENCE §5, as ``quillcache.hitrate.kernels``): a request's hits
are its leading cached blocks; then each block in order is touched if cached (moved to the most
recent end of the "live" or "dead" list by its reuse bit), else, if its bit says it is reused,
inserted at the most recent end of the live list after evicting the head of the dead list, or
the head of the live list when the dead list is empty, if the cache holds ``capacity_blocks``.
``reuse_oracle_reference`` is the plain-Python specification; the Numba kernel agrees with it hit
for hit (tested).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
from numba import njit

from quillcache._jitcache import guard_cache
from quillcache._checks import check_float, check_int
from quillcache.hitrate._klib import (NIL, _heap_compact, _heap_pop, _heap_push, _lists, _prefix_hits, _push,
                                      _unlink)
from quillcache.hitrate.arrays import TraceArrays, clamp_capacity, validate_arrays
from quillcache.hitrate.kernels import belady
from quillcache.hitrate.reference import replay

__all__ = ["NEVER", "false_return_distances", "flips", "give_up_positions", "joint_flips", "joint_oracle",
           "joint_oracle_reference", "noisy_next_use", "noisy_next_use_reference", "reuse_oracle",
           "reuse_oracle_reference", "timing_factors", "timing_oracle", "timing_oracle_reference"]

_DEAD, _LIVE = 0, 1


def flips(num_requests: int, flip_rate: float, seed: int) -> np.ndarray:
    """bool[R]: the requests whose reuse bits the noisy oracle inverts."""
    check_float("flip_rate", flip_rate, 0.0, 1.0)
    check_int("seed", seed, 0)
    if flip_rate == 0.0:
        return np.zeros(num_requests, np.bool_)
    return np.random.default_rng(seed).random(num_requests) < flip_rate


@njit(cache=True, nogil=True)
def _reuse_oracle(off, blocks, u, cap, hits, next_use, flip):
    n = blocks.shape[0]
    incache = np.zeros(u, np.bool_)
    where = np.zeros(u, np.int8)
    prev, nxt, head, tail, size = _lists(u, 2)
    held = 0
    total = 0
    for r in range(off.shape[0] - 1):
        k = _prefix_hits(off, blocks, r, incache)
        hits[r] = k
        total += k
        for p in range(off[r], off[r + 1]):
            b = blocks[p]
            reused = next_use[p] < n
            if flip[r]:
                reused = not reused
            if incache[b]:
                _unlink(where[b], b, prev, nxt, head, tail, size)
            elif not reused:
                continue
            else:
                if held >= cap:
                    v = head[_DEAD] if head[_DEAD] != NIL else head[_LIVE]
                    _unlink(where[v], v, prev, nxt, head, tail, size)
                    incache[v] = False
                    held -= 1
                incache[b] = True
                held += 1
            where[b] = _LIVE if reused else _DEAD
            _push(where[b], b, prev, nxt, head, tail, size)
    return total


def reuse_oracle(arrs: TraceArrays, capacity_blocks: int, flip_rate: float = 0.0, seed: int = 0) -> np.ndarray:
    """Per-request prefix hits (int32[R]) of the reuse oracle at ``capacity_blocks`` blocks."""
    cap = clamp_capacity(validate_arrays(arrs), capacity_blocks)
    flip = flips(arrs.num_requests, flip_rate, seed)
    hits = np.zeros(arrs.num_requests, np.int32)
    _reuse_oracle(arrs.req_offsets, arrs.blocks, arrs.num_unique, cap, hits, arrs.next_use, flip)
    return hits


def reuse_oracle_reference(arrs: TraceArrays, capacity_blocks: int, flip_rate: float = 0.0,
                           seed: int = 0) -> np.ndarray:
    """The same replay in plain Python (OrderedDicts): the specification of ``reuse_oracle``."""
    cap = clamp_capacity(validate_arrays(arrs), capacity_blocks)
    flip = flips(arrs.num_requests, flip_rate, seed).tolist()
    off, blocks, next_use = arrs.req_offsets.tolist(), arrs.blocks.tolist(), arrs.next_use.tolist()
    n = len(blocks)
    lists: tuple[OrderedDict[int, None], OrderedDict[int, None]] = (OrderedDict(), OrderedDict())  # dead, live
    where: dict[int, int] = {}
    hits = np.zeros(arrs.num_requests, np.int32)
    for r in range(arrs.num_requests):
        keys = blocks[off[r]:off[r + 1]]
        k = 0
        for b in keys:
            if b not in where:
                break
            k += 1
        hits[r] = k
        for j, b in enumerate(keys):
            reused = (next_use[off[r] + j] < n) != flip[r]
            if b in where:
                del lists[where[b]][b]
            elif not reused:
                continue
            elif len(where) >= cap:
                victims = lists[_DEAD] if lists[_DEAD] else lists[_LIVE]
                v, _ = victims.popitem(last=False)
                del where[v]
            where[b] = _LIVE if reused else _DEAD
            lists[where[b]][b] = None
    return hits


# ---------------------------------------------------------------- timing oracle

NEVER = np.iinfo(np.int64).max // 4  # a reference at position p with no next use has key NEVER + p
FAR = 1 << 60  # the farthest noisy distance to a next use (exact as a float64): such a key stays below NEVER


def timing_factors(num_requests: int, sigma: float, seed: int) -> np.ndarray:
    """float64[R]: ``exp(sigma * Z_q)`` per request ``q`` (all 1.0 when ``sigma`` is 0)."""
    check_float("sigma", sigma, 0.0, 10.0)
    check_int("seed", seed, 0)
    if sigma == 0.0:
        return np.ones(num_requests, np.float64)
    return np.exp(sigma * np.random.default_rng(seed).standard_normal(num_requests))


def joint_flips(num_requests: int, flip_rate: float, seed: int) -> np.ndarray:
    """bool[R]: the requests whose new blocks the joint oracle believes the other way (stream
    ``[seed, 1]``, independent of ``timing_factors(..., seed)``; none drawn at ``flip_rate`` 0)."""
    check_float("flip_rate", flip_rate, 0.0, 1.0)
    check_int("seed", seed, 0)
    if flip_rate == 0.0:
        return np.zeros(num_requests, np.bool_)
    return np.random.default_rng([seed, 1]).random(num_requests) < flip_rate


def false_return_distances(arrs: TraceArrays, seed: int) -> np.ndarray:
    """int64[N]: for each reference, a distance drawn uniformly (stream ``[seed, 2]``) from the
    trace's reuse distances ``next_use[p] - p`` over every reference that has a next use: where the
    joint oracle, wrong about a block that is not referenced again, believes it comes back. All -1
    when no block is referenced twice (nothing to draw from: such a belief is "never")."""
    n = arrs.num_refs
    pos = np.arange(n, dtype=np.int64)
    nu = arrs.next_use.astype(np.int64)
    pool = np.sort(nu[nu < n] - pos[nu < n])
    if not len(pool):
        return np.full(n, -1, np.int64)
    return pool[np.random.default_rng([seed, 2]).integers(0, len(pool), size=n)]


def noisy_next_use(arrs: TraceArrays, sigma: float, seed: int = 0, flip_rate: float = 0.0) -> np.ndarray:
    """int64[N]: the next use of each reference as the timing (or joint) oracle sees it, all distinct.

    The noisy key of the reference at position ``p`` is ``NEVER + p`` if the block is not referenced
    again; else ``p + max(1, min(rint((q - p) * f[request of q]), FAR))`` for its next use at ``q``
    (``timing_factors``), so a next use is always in the future. With ``flip_rate`` > 0, for a block
    new in a request of ``joint_flips`` (its first reference in the trace) the key is ``NEVER + p``
    if the block *is* referenced again, and ``p + false_return_distances[p]`` if it is not
    (``NEVER + p`` when there is no distance to draw). Rounded keys can collide, and
    Belady's victim among equal keys would be up to its heap's shape, so the keys are then made
    distinct without reordering any two that differ: in order of (noisy key, ``p``), each key is
    ``max(noisy key, previous key + 1)``. Hence a key is never below its noisy key, the order of
    keys is the order of (noisy key, ``p``) (of two equal noisy keys the later reference's counts
    as farther, as ``N + p`` orders last references in ``TraceArrays.next_use``), where no two noisy
    keys are equal nothing changes (at ``sigma = 0`` every key is ``next_use`` itself or ``NEVER + p``),
    and a key is ``>= NEVER`` exactly when the oracle believes the block is not referenced again (at
    ``flip_rate`` 0: exactly when it is not)."""
    validate_arrays(arrs)
    f = timing_factors(arrs.num_requests, sigma, seed)
    wrong = joint_flips(arrs.num_requests, flip_rate, seed)
    n = arrs.num_refs
    pos = np.arange(n, dtype=np.int64)
    nu = arrs.next_use.astype(np.int64)
    noisy = NEVER + pos
    has = nu < n
    req = np.searchsorted(arrs.req_offsets, nu[has], side="right") - 1  # the request holding each next use
    # capped at FAR so that the conversion cannot overflow (a factor above ~1e13 only at huge sigma)
    dist = np.minimum(np.rint((nu[has] - pos[has]).astype(np.float64) * f[req]), FAR).astype(np.int64)
    noisy[has] = pos[has] + np.maximum(dist, 1)
    if wrong.any():
        first = np.zeros(n, np.bool_)  # the block's first reference: new in its request
        first[np.unique(arrs.blocks, return_index=True)[1]] = True
        flipped = np.repeat(wrong, np.diff(arrs.req_offsets)) & first  # believed wrong: new blocks of wrong requests
        noisy[flipped & has] = NEVER + pos[flipped & has]
        fake = false_return_distances(arrs, seed)
        believed = flipped & ~has & (fake > 0)
        noisy[believed] = pos[believed] + fake[believed]
    order = np.lexsort((pos, noisy))  # by noisy key, then position
    i = np.arange(n, dtype=np.int64)  # rank in that order
    out = np.empty(n, np.int64)
    # the i-th key in that order is max over j <= i of noisy_j + (i - j), i.e. max(noisy_i, key_{i-1} + 1)
    out[order] = np.maximum.accumulate(noisy[order] - i) + i
    return out


def noisy_next_use_reference(arrs: TraceArrays, sigma: float, seed: int = 0, flip_rate: float = 0.0) -> list[int]:
    """The same keys from a plain-Python walk of the trace (the specification)."""
    validate_arrays(arrs)
    f = timing_factors(arrs.num_requests, sigma, seed).tolist()
    wrong = joint_flips(arrs.num_requests, flip_rate, seed).tolist()
    fake = false_return_distances(arrs, seed).tolist() if any(wrong) else []
    off, next_use = arrs.req_offsets.tolist(), arrs.next_use.tolist()
    n = len(next_use)
    owner = [r for r in range(arrs.num_requests) for _ in range(off[r + 1] - off[r])]
    noisy = []
    blocks = arrs.blocks.tolist()
    seen: set[int] = set()
    for p, q in enumerate(next_use):
        new = blocks[p] not in seen
        seen.add(blocks[p])
        if wrong[owner[p]] and new:  # a new block of a wrong request: believed the other way
            noisy.append(NEVER + p if q < n or fake[p] < 1 else p + fake[p])
        elif q >= n:
            noisy.append(NEVER + p)
        else:
            noisy.append(p + max(1, min(round((q - p) * f[owner[q]]), FAR)))  # half to even, as numpy.rint
    out = [0] * n
    key = None
    for p in sorted(range(n), key=lambda p: (noisy[p], p)):
        key = noisy[p] if key is None else max(noisy[p], key + 1)
        out[p] = key
    return out


def timing_oracle(arrs: TraceArrays, capacity_blocks: int, sigma: float, seed: int = 0) -> np.ndarray:
    """Per-request prefix hits (int32[R]) of Belady with bypass on ``noisy_next_use`` keys at
    ``capacity_blocks`` blocks. The keys are distinct, so no victim is a tie-break: the kernel
    agrees hit for hit with ``timing_oracle_reference`` (tested)."""
    cap = clamp_capacity(validate_arrays(arrs), capacity_blocks)
    keys = noisy_next_use(arrs, sigma, seed)
    hits = np.zeros(arrs.num_requests, np.int32)
    belady(arrs.req_offsets, arrs.blocks, arrs.num_unique, cap, hits, keys, True)
    return hits


def timing_oracle_reference(arrs: TraceArrays, capacity_blocks: int, sigma: float, seed: int = 0) -> np.ndarray:
    """The same replay in plain Python: ``BeladyPolicy`` (bypass on) through the reference harness,
    its next-use oracle returning ``noisy_next_use_reference`` keys: the specification of
    ``timing_oracle``."""
    cap = clamp_capacity(validate_arrays(arrs), capacity_blocks)
    keys = np.asarray(noisy_next_use_reference(arrs, sigma, seed), np.int64)
    return replay(arrs, "belady", cap, next_use=keys)


# ---------------------------------------------------------------- joint oracle

GIVE_UP_SIGMAS = 2.0  # the joint oracle gives up on a return this many of its own log-errors overdue


def give_up_positions(keys: np.ndarray, sigma: float) -> np.ndarray:
    """int64[N]: where the joint oracle gives up on the block of each reference: ``p +
    max(1, rint((keys[p] - p) * exp(GIVE_UP_SIGMAS * sigma)))``, at or after its believed return (at
    ``sigma`` 0: the believed return itself), and ``NEVER`` where it believes in none
    (``keys[p] >= NEVER``)."""
    keys = np.asarray(keys, np.int64)
    pos = np.arange(len(keys), dtype=np.int64)
    out = np.full(len(keys), NEVER, np.int64)
    has = keys < NEVER
    slack = math.exp(GIVE_UP_SIGMAS * sigma)
    dist = np.minimum(np.rint((keys[has] - pos[has]).astype(np.float64) * slack), FAR).astype(np.int64)
    out[has] = pos[has] + np.maximum(dist, 1)
    return out


@njit(cache=True, nogil=True)
def _expiring_belady(off, blocks, u, cap, hits, keys, give_up, bypass):
    """Belady with bypass on ``keys``, where a cached block whose give-up position has passed
    (``give_up < p`` at the reference at position ``p`` that must evict) is given up on. The victim
    is: a block believed never to come back (key ``>= NEVER``), the farthest, if one is cached (the
    new block is not stored if its key is farther still); else nothing when the new block is
    believed never to come back (not stored); else the block given up on first, in (give-up, key)
    order; else the farthest key (Belady, with bypass). Two lazy heaps (farthest key; nearest
    (give-up, key)) and a queue of given-up blocks, which is in (give-up, key) order because
    positions pass in increasing order and a give-up position pushed at ``p`` is above ``p``."""
    n = blocks.shape[0]
    incache = np.zeros(u, np.bool_)
    gone = np.zeros(u, np.bool_)  # given up on while cached
    key = np.zeros(u, np.int64)
    neg = np.zeros(u, np.int64)
    until = np.zeros(u, np.int64)
    zero = np.zeros(u, np.int64)
    cap_heap = 2 * cap + 16
    a1, a2, ab = np.empty(cap_heap + 1, np.int64), np.empty(cap_heap + 1, np.int64), np.empty(cap_heap + 1, np.int32)
    e1, e2, eb = np.empty(cap_heap + 1, np.int64), np.empty(cap_heap + 1, np.int64), np.empty(cap_heap + 1, np.int32)
    qb, qk = np.empty(n + 1, np.int32), np.empty(n + 1, np.int64)
    qh = qt = 0
    na = ne = 0
    size = 0
    total = 0
    for r in range(off.shape[0] - 1):
        k = _prefix_hits(off, blocks, r, incache)
        hits[r] = k
        total += k
        for p in range(off[r], off[r + 1]):
            b = blocks[p]
            if not incache[b]:
                if size >= cap:
                    while ne > 0:  # give up on every cached block whose give-up position has passed
                        c = eb[0]
                        if not (incache[c] and e1[0] == until[c] and e2[0] == key[c]):
                            ne = _heap_pop(e1, e2, eb, ne)
                        elif e1[0] < p:
                            gone[c] = True
                            qb[qt], qk[qt] = c, key[c]
                            qt += 1
                            ne = _heap_pop(e1, e2, eb, ne)
                        else:
                            break
                    while qh < qt and not (incache[qb[qh]] and gone[qb[qh]] and key[qb[qh]] == qk[qh]):
                        qh += 1
                    while not (incache[ab[0]] and a1[0] == neg[ab[0]]):
                        na = _heap_pop(a1, a2, ab, na)
                    m = ab[0]  # the farthest key
                    if key[m] >= NEVER:  # a block believed never to come back: the farthest of all
                        if bypass and key[m] < keys[p]:
                            continue
                        v = m
                        na = _heap_pop(a1, a2, ab, na)
                    elif bypass and keys[p] >= NEVER:  # the new block is believed never to come back
                        continue
                    elif qh < qt:  # a block given up on
                        v = qb[qh]
                        qh += 1
                    else:
                        if bypass and key[m] < keys[p]:
                            continue
                        v = m
                        na = _heap_pop(a1, a2, ab, na)
                    incache[v] = False
                    size -= 1
                incache[b] = True
                size += 1
            key[b], neg[b], until[b], gone[b] = keys[p], -keys[p], give_up[p], False
            if na >= cap_heap:
                na = _heap_compact(a1, a2, ab, na, neg, zero, incache)
            na = _heap_push(a1, a2, ab, na, neg[b], 0, b)
            if ne >= cap_heap:
                ne = _heap_compact(e1, e2, eb, ne, until, key, incache)
            ne = _heap_push(e1, e2, eb, ne, until[b], key[b], b)
    return total


def joint_oracle(arrs: TraceArrays, capacity_blocks: int, sigma: float, flip_rate: float, seed: int = 0
                 ) -> np.ndarray:
    """Per-request prefix hits (int32[R]) of the joint oracle (module docstring): wrong about *when*
    by ``exp(sigma * Z)`` per request, about *which* for a ``flip_rate`` share of requests, giving up
    on blocks ``GIVE_UP_SIGMAS`` of its log-errors overdue. Agrees hit for hit with
    ``joint_oracle_reference`` (tested)."""
    cap = clamp_capacity(validate_arrays(arrs), capacity_blocks)
    keys = noisy_next_use(arrs, sigma, seed, flip_rate)
    hits = np.zeros(arrs.num_requests, np.int32)
    _expiring_belady(arrs.req_offsets, arrs.blocks, arrs.num_unique, cap, hits, keys, give_up_positions(keys, sigma),
                     True)
    return hits


def joint_oracle_reference(arrs: TraceArrays, capacity_blocks: int, sigma: float, flip_rate: float,
                           seed: int = 0) -> np.ndarray:
    """The same replay in plain Python (a scan of the cache per eviction): the specification of
    ``joint_oracle``. At a miss with the cache full: if the cached block with the largest key is
    believed never to come back (key ``>= NEVER``) it is the victim, unless the new block's key is
    larger still (then the new block is not stored); else a new block believed never to come back is
    not stored; else the victim is, of the cached blocks whose give-up position is below the current
    position, the one with the smallest (give-up, key); if there is none, the one with the largest
    key, and then only if that key is not below the new block's (bypass)."""
    cap = clamp_capacity(validate_arrays(arrs), capacity_blocks)
    keys = noisy_next_use_reference(arrs, sigma, seed, flip_rate)
    slack = math.exp(GIVE_UP_SIGMAS * sigma)
    until = [NEVER if k >= NEVER else p + max(1, min(round((k - p) * slack), FAR)) for p, k in enumerate(keys)]
    off, blocks = arrs.req_offsets.tolist(), arrs.blocks.tolist()
    cached: dict[int, tuple[int, int]] = {}  # block -> (give-up position, key)
    hits = np.zeros(arrs.num_requests, np.int32)
    for r in range(arrs.num_requests):
        k = 0
        for b in blocks[off[r]:off[r + 1]]:
            if b not in cached:
                break
            k += 1
        hits[r] = k
        for p in range(off[r], off[r + 1]):
            b = blocks[p]
            if b not in cached and len(cached) >= cap:
                far = max(cached, key=lambda c: cached[c][1])
                passed = [c for c, (g, _) in cached.items() if g < p]
                if cached[far][1] >= NEVER:  # believed never to come back
                    if cached[far][1] < keys[p]:
                        continue  # bypass: the new block's key is farther still
                    v = far
                elif keys[p] >= NEVER:
                    continue  # the new block is believed never to come back: not stored
                elif passed:
                    v = min(passed, key=cached.__getitem__)
                else:
                    v = far
                    if cached[v][1] < keys[p]:
                        continue  # bypass: the new block's key is the farthest
                del cached[v]
            cached[b] = (until[p], keys[p])
    return hits


# flush this module's cached kernels when it or a dependency changed (quillcache._jitcache)
guard_cache(__name__, "quillcache.hitrate._klib", "quillcache.hitrate.kernels")
