"""LRU driven by a per-request reuse prediction: the reuse oracle's replay with a predictor's bits.

``quillcache.hitrate.bounds.reuse_oracle`` knows, for every referenced block, whether it will be
referenced again. ``predicted_reuse_lru`` is the same two-list LRU fed instead by one bit per
request - "this request's new blocks will be referenced again" - from any predictor, so a learned
model of reuse can be replayed and its bits compared, on the same cache, with the oracle's. With
the bits of a predictor that uses only the past (``experiments.hitrate_predictability``) it is an
online policy; it is not in the policy registry because the predictor is trained outside the
replay.

Definition of a replay step (REFERENCE §5, as ``quillcache.hitrate.kernels``): a request's hits
are its leading cached blocks; then each block in order:

- cached: it is touched - moved to the most recent end of the list it is in (a block keeps the
  prediction made when it entered the cache: a later request that reuses it is evidence it was
  live, not that it will be again);
- not cached: if the cache holds ``capacity_blocks`` the head of the "dead" list is evicted, or the
  head of the "live" list when the dead list is empty; the block enters the most recent end of the
  live list if its request's bit is set, else of the dead list. Nothing is bypassed: a wrong
  "dead" costs the block its place first, never its admission.

With every bit set this is LRU, hit for hit (tested). ``predicted_reuse_lru_reference`` is the
plain-Python specification; the Numba kernel agrees with it hit for hit (tested).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from numba import njit

from quillcache._jitcache import guard_cache
from quillcache.hitrate._klib import NIL, _lists, _prefix_hits, _push, _unlink
from quillcache.hitrate.arrays import TraceArrays, clamp_capacity, validate_arrays

__all__ = ["predicted_reuse_lru", "predicted_reuse_lru_reference"]

_DEAD, _LIVE = 0, 1


@njit(cache=True, nogil=True)
def _predicted_reuse_lru(off, blocks, u, cap, hits, bits):
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
            if incache[b]:
                _unlink(where[b], b, prev, nxt, head, tail, size)
            else:
                if held >= cap:
                    v = head[_DEAD] if head[_DEAD] != NIL else head[_LIVE]
                    _unlink(where[v], v, prev, nxt, head, tail, size)
                    incache[v] = False
                    held -= 1
                incache[b] = True
                held += 1
                where[b] = _LIVE if bits[r] else _DEAD
            _push(where[b], b, prev, nxt, head, tail, size)
    return total


def _checked_bits(arrs: TraceArrays, request_bits: np.ndarray) -> np.ndarray:
    bits = np.asarray(request_bits)
    if bits.dtype != np.bool_:
        raise TypeError(f"request_bits must be a bool array, got dtype {bits.dtype}")
    if bits.shape != (arrs.num_requests,):
        raise ValueError(f"request_bits must have one bit per request ({arrs.num_requests}), got shape {bits.shape}")
    return np.ascontiguousarray(bits)


def predicted_reuse_lru(arrs: TraceArrays, capacity_blocks: int, request_bits: np.ndarray) -> np.ndarray:
    """Per-request prefix hits (int32[R]) at ``capacity_blocks`` blocks; ``request_bits`` bool[R]
    is the prediction for each request's blocks that enter the cache."""
    validate_arrays(arrs)
    cap = clamp_capacity(arrs, capacity_blocks)
    bits = _checked_bits(arrs, request_bits)
    hits = np.zeros(arrs.num_requests, np.int32)
    _predicted_reuse_lru(arrs.req_offsets, arrs.blocks, arrs.num_unique, cap, hits, bits)
    return hits


def predicted_reuse_lru_reference(arrs: TraceArrays, capacity_blocks: int, request_bits: np.ndarray) -> list[int]:
    """The plain-Python specification of ``predicted_reuse_lru`` (module docstring)."""
    validate_arrays(arrs)
    cap = clamp_capacity(arrs, capacity_blocks)
    bits = _checked_bits(arrs, request_bits).tolist()
    lists: tuple[OrderedDict[int, None], OrderedDict[int, None]] = (OrderedDict(), OrderedDict())
    where: dict[int, int] = {}
    off, blocks = arrs.req_offsets.tolist(), arrs.blocks.tolist()
    out = []
    for r in range(arrs.num_requests):
        keys = blocks[off[r]:off[r + 1]]
        k = 0
        while k < len(keys) and keys[k] in where:
            k += 1
        out.append(k)
        for b in keys:
            if b in where:
                lists[where[b]].move_to_end(b)
                continue
            if len(where) >= cap:
                q = _DEAD if lists[_DEAD] else _LIVE
                v, _ = lists[q].popitem(last=False)
                del where[v]
            where[b] = _LIVE if bits[r] else _DEAD
            lists[where[b]][b] = None
    return out


guard_cache(__name__, "quillcache.hitrate._klib")  # flush this module's cached kernels when a dependency changed
