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

__all__ = ["NEVER", "flips", "noisy_next_use", "noisy_next_use_reference", "reuse_oracle", "reuse_oracle_reference",
           "timing_factors", "timing_oracle"]

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

NEVER = np.iinfo(np.int64).max // 4  # the timing oracle's next use of a block never referenced again


def timing_factors(num_requests: int, sigma: float, seed: int) -> np.ndarray:
    """float64[R]: ``exp(sigma * Z_q)`` per request ``q`` (all 1.0 when ``sigma`` is 0)."""
    check_float("sigma", sigma, 0.0, 10.0)
    check_int("seed", seed, 0)
    if sigma == 0.0:
        return np.ones(num_requests, np.float64)
    return np.exp(sigma * np.random.default_rng(seed).standard_normal(num_requests))


def noisy_next_use(arrs: TraceArrays, sigma: float, seed: int = 0) -> np.ndarray:
    """int64[N]: the next use of each reference as the timing oracle sees it: ``NEVER`` where there
    is none; else ``p + max(1, rint((q - p) * f[request of q]))`` for the reference at position
    ``p`` whose next use is at ``q`` (``timing_factors``), so a next use is always in the future."""
    validate_arrays(arrs)
    f = timing_factors(arrs.num_requests, sigma, seed)
    n = arrs.num_refs
    pos = np.arange(n, dtype=np.int64)
    nu = arrs.next_use.astype(np.int64)
    out = np.full(n, NEVER, np.int64)
    has = nu < n
    req = np.searchsorted(arrs.req_offsets, nu[has], side="right") - 1  # the request holding each next use
    dist = np.rint((nu[has] - pos[has]).astype(np.float64) * f[req]).astype(np.int64)
    out[has] = pos[has] + np.maximum(dist, 1)
    return out


def noisy_next_use_reference(arrs: TraceArrays, sigma: float, seed: int = 0) -> list[int]:
    """The same keys from a plain-Python walk of the trace (the specification)."""
    validate_arrays(arrs)
    f = timing_factors(arrs.num_requests, sigma, seed).tolist()
    off, next_use = arrs.req_offsets.tolist(), arrs.next_use.tolist()
    n = len(next_use)
    owner = [r for r in range(arrs.num_requests) for _ in range(off[r + 1] - off[r])]
    out = []
    for p, q in enumerate(next_use):
        if q >= n:
            out.append(NEVER)
        else:
            out.append(p + max(1, round((q - p) * f[owner[q]])))  # half to even, as numpy.rint
    return out


def timing_oracle(arrs: TraceArrays, capacity_blocks: int, sigma: float, seed: int = 0) -> np.ndarray:
    """Per-request prefix hits (int32[R]) of Belady with bypass on ``noisy_next_use`` keys at
    ``capacity_blocks`` blocks."""
    cap = check_int("capacity_blocks", capacity_blocks, 1)
    keys = noisy_next_use(arrs, sigma, seed)
    hits = np.zeros(arrs.num_requests, np.int32)
    belady(arrs.req_offsets, arrs.blocks, arrs.num_unique, cap, hits, keys, True)
    return hits
