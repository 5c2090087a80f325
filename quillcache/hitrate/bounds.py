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
of the gap knowing *when* is worth once *which* is known. Rounded keys can collide; collisions are
broken by position without reordering distinct keys (``noisy_next_use``), so every key is distinct
as in ``TraceArrays.next_use`` and ``timing_oracle`` agrees with its plain-Python specification
``timing_oracle_reference`` (``BeladyPolicy`` through ``quillcache.hitrate.reference``) hit for hit.

These are not online policies (they read ``TraceArrays.next_use``) and are not in the policy
registry; they are reported apart from online results, like Belady.

Definition of a replay step (REFERENCE §5, as ``quillcache.hitrate.kernels``): a request's hits
are its leading cached blocks; then each block in order is touched if cached (moved to the most
recent end of the "live" or "dead" list by its reuse bit), else, if its bit says it is reused,
inserted at the most recent end of the live list after evicting the head of the dead list, or
the head of the live list when the dead list is empty, if the cache holds ``capacity_blocks``.
``reuse_oracle_reference`` is the plain-Python specification; the Numba kernel agrees with it hit
for hit (tested).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from numba import njit

from quillcache._checks import check_float, check_int
from quillcache.hitrate._klib import NIL, _lists, _prefix_hits, _push, _unlink
from quillcache.hitrate.arrays import TraceArrays, validate_arrays
from quillcache.hitrate.kernels import belady
from quillcache.hitrate.reference import replay

__all__ = ["NEVER", "flips", "noisy_next_use", "noisy_next_use_reference", "reuse_oracle", "reuse_oracle_reference",
           "timing_factors", "timing_oracle", "timing_oracle_reference"]

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
    validate_arrays(arrs)
    cap = check_int("capacity_blocks", capacity_blocks, 1)
    flip = flips(arrs.num_requests, flip_rate, seed)
    hits = np.zeros(arrs.num_requests, np.int32)
    _reuse_oracle(arrs.req_offsets, arrs.blocks, arrs.num_unique, cap, hits, arrs.next_use, flip)
    return hits


def reuse_oracle_reference(arrs: TraceArrays, capacity_blocks: int, flip_rate: float = 0.0,
                           seed: int = 0) -> np.ndarray:
    """The same replay in plain Python (OrderedDicts): the specification of ``reuse_oracle``."""
    validate_arrays(arrs)
    cap = check_int("capacity_blocks", capacity_blocks, 1)
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


def noisy_next_use(arrs: TraceArrays, sigma: float, seed: int = 0) -> np.ndarray:
    """int64[N]: the next use of each reference as the timing oracle sees it, all distinct.

    The noisy key of the reference at position ``p`` is ``NEVER + p`` if the block is not referenced
    again; else ``p + max(1, min(rint((q - p) * f[request of q]), FAR))`` for its next use at ``q``
    (``timing_factors``), so a next use is always in the future. Rounded keys can collide, and
    Belady's victim among equal keys would be up to its heap's shape, so the keys are then made
    distinct without reordering any two that differ: in order of (noisy key, ``p``), each key is
    ``max(noisy key, previous key + 1)``. Hence a key is never below its noisy key, the order of
    keys is the order of (noisy key, ``p``) (of two equal noisy keys the later reference's counts
    as farther, as ``N + p`` orders last references in ``TraceArrays.next_use``), where no two noisy
    keys are equal nothing changes (at ``sigma = 0`` every key is ``next_use`` itself or ``NEVER + p``),
    and a key is ``>= NEVER`` exactly when the block is not referenced again."""
    validate_arrays(arrs)
    f = timing_factors(arrs.num_requests, sigma, seed)
    n = arrs.num_refs
    pos = np.arange(n, dtype=np.int64)
    nu = arrs.next_use.astype(np.int64)
    noisy = NEVER + pos
    has = nu < n
    req = np.searchsorted(arrs.req_offsets, nu[has], side="right") - 1  # the request holding each next use
    # capped at FAR so that the conversion cannot overflow (a factor above ~1e13 only at huge sigma)
    dist = np.minimum(np.rint((nu[has] - pos[has]).astype(np.float64) * f[req]), FAR).astype(np.int64)
    noisy[has] = pos[has] + np.maximum(dist, 1)
    order = np.lexsort((pos, noisy))  # by noisy key, then position
    i = np.arange(n, dtype=np.int64)  # rank in that order
    out = np.empty(n, np.int64)
    # the i-th key in that order is max over j <= i of noisy_j + (i - j), i.e. max(noisy_i, key_{i-1} + 1)
    out[order] = np.maximum.accumulate(noisy[order] - i) + i
    return out


def noisy_next_use_reference(arrs: TraceArrays, sigma: float, seed: int = 0) -> list[int]:
    """The same keys from a plain-Python walk of the trace (the specification)."""
    validate_arrays(arrs)
    f = timing_factors(arrs.num_requests, sigma, seed).tolist()
    off, next_use = arrs.req_offsets.tolist(), arrs.next_use.tolist()
    n = len(next_use)
    owner = [r for r in range(arrs.num_requests) for _ in range(off[r + 1] - off[r])]
    noisy = []
    for p, q in enumerate(next_use):
        if q >= n:
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
    cap = check_int("capacity_blocks", capacity_blocks, 1)
    keys = noisy_next_use(arrs, sigma, seed)
    hits = np.zeros(arrs.num_requests, np.int32)
    belady(arrs.req_offsets, arrs.blocks, arrs.num_unique, cap, hits, keys, True)
    return hits


def timing_oracle_reference(arrs: TraceArrays, capacity_blocks: int, sigma: float, seed: int = 0) -> np.ndarray:
    """The same replay in plain Python: ``BeladyPolicy`` (bypass on) through the reference harness,
    its next-use oracle returning ``noisy_next_use_reference`` keys: the specification of
    ``timing_oracle``."""
    cap = check_int("capacity_blocks", capacity_blocks, 1)
    keys = np.asarray(noisy_next_use_reference(arrs, sigma, seed), np.int64)
    return replay(arrs, "belady", cap, next_use=keys)
