"""Numba kernels of the planner's hot path (the plain-Python specification is
:mod:`quillcache.planner.reference`; tests check both make the same plans).

Inputs are the columnar ``LocateResult`` of the request's own blocks, viewed as raw key bytes
``keys[r, 0:30]`` = ``b"B" | block_hash u64 BE | node_no u32 BE | identity 16 B | tier u8``, with
block ``j``'s replicas in rows ``offsets[j]:offsets[j+1]``.

The identity guard is part of the scan: a replica is considered only if its 16 identity bytes
equal a row of ``allowed`` (the request's own digest, and its public scope's digest when the policy
shares one); a public-scope match also needs the block hash in ``public_sorted`` (binary search).
With ``guard`` false every replica is considered (the naive baseline of the same planner).
"""

from __future__ import annotations

import numba
import numpy as np

from quillcache._jitcache import guard_cache
from quillcache.routing.dynamo import _logits as _dyn_logits
from quillcache.routing.dynamo import _select as _dyn_select

_ID0 = 13  # identity offset in a primary key
_TIER = 29
_NONE = 127


@numba.njit(cache=True, nogil=True, inline="always")
def _node_no(keys, r):  # pragma: no cover - jitted
    return (np.int64(keys[r, 9]) << 24) | (np.int64(keys[r, 10]) << 16) | (np.int64(keys[r, 11]) << 8) | np.int64(keys[r, 12])


@numba.njit(cache=True, nogil=True)
def _in_sorted(arr, x):  # pragma: no cover - jitted
    lo, hi = 0, arr.shape[0]
    while lo < hi:
        mid = (lo + hi) >> 1
        if arr[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo < arr.shape[0] and arr[lo] == x


@numba.njit(cache=True, nogil=True)
def _scan(keys, offsets, b0, b1, hashes, node_worker, allowed, public_slot, public_sorted, guard, overlaps,
          ok):  # pragma: no cover
    """``ok[r - offsets[b0]]`` is set to whether replica ``r`` passed the guard (when ``guard``)."""
    n = b1 - b0
    n_workers = overlaps.shape[1]
    best = np.full((n, n_workers), _NONE, dtype=np.int8)
    missing = -1
    base = offsets[b0]
    na = allowed.shape[0]
    for j in range(n):
        h = hashes[b0 + j]
        for r in range(offsets[b0 + j], offsets[b0 + j + 1]):
            if guard:
                # the guard, inline rather than a call per replica (this loop is the planner's hot
                # path; results/microbench_planner): first identity byte, then the rest
                match = -1
                for a in range(na):
                    if keys[r, _ID0] != allowed[a, 0]:
                        continue
                    same = True
                    for i in range(1, 16):
                        if keys[r, _ID0 + i] != allowed[a, i]:
                            same = False
                            break
                    if same:
                        match = a
                        break
                if match < 0 or (match == public_slot and not _in_sorted(public_sorted, h)):
                    ok[r - base] = False
                    continue
                ok[r - base] = True
            no = _node_no(keys, r)
            if no >= node_worker.shape[0]:
                missing = max(missing, no)
                continue
            w = node_worker[no]
            if w < 0:
                continue
            t = np.int8(keys[r, _TIER])
            best[j, w] = min(best[j, w], t)
    if missing >= 0:
        return missing
    for w in range(n_workers):
        j = 0
        while j < n and best[j, w] == 0:
            j += 1
        overlaps[0, w] = j
        j0 = j
        while j < n and best[j, w] <= 1:
            j += 1
        overlaps[1, w] = j - j0
        j0 = j
        while j < n and best[j, w] <= 2:
            j += 1
        overlaps[2, w] = j - j0
    return -1


@numba.njit(cache=True, nogil=True)
def _choose(keys, offsets, b0, b1, node_worker, guard, ok, worker,
            per_block_s, latency_s, kind_action, a_coef, c_coef, isl, bs, queue_s, actions, kinds, rows):  # pragma: no cover
    n = b1 - b0
    # the engine computes at least the prompt's last token: a full-hit aligned prompt reuses all but its last block
    avail = min(n, (isl - 1) // bs)
    base = offsets[b0]
    for j in range(avail):
        bk = 127
        br = -1
        bc = np.inf
        for r in range(offsets[b0 + j], offsets[b0 + j + 1]):
            if guard and not ok[r - base]:
                continue
            no = _node_no(keys, r)
            t = np.int64(keys[r, _TIER])
            local = no < node_worker.shape[0] and node_worker[no] == worker
            if t >= 3:
                kind = 6
            elif local:
                kind = t
            else:
                kind = 3 + t
            cost = per_block_s[kind] + latency_s[kind]
            if cost < bc or (cost == bc and kind < bk):
                bc = cost
                bk = kind
                br = r
        if br < 0:
            avail = j
            break
        kinds[j] = bk
        rows[j] = br
    # cumulative TTFT over k = 0..avail; ties keep the smaller k (fewer transfers)
    seen = np.zeros(per_block_s.shape[0], dtype=np.bool_)
    fetch = 0.0
    best_k = 0
    best_fetch = 0.0
    best_t = np.inf
    for k in range(avail + 1):
        if k > 0:
            kd = kinds[k - 1]
            fetch += per_block_s[kd]
            if not seen[kd]:
                seen[kd] = True
                fetch += latency_s[kd]
        s = k * bs
        s = min(s, isl - 1)
        prefill = a_coef * (isl - s) + c_coef * (isl * (isl - 1) / 2 - s * (s - 1) / 2)
        t = queue_s + fetch + prefill
        if t < best_t:
            best_t = t
            best_k = k
            best_fetch = fetch
    fetched = 0
    for j in range(n):
        if j < best_k:
            actions[j] = kind_action[kinds[j]]
            if kinds[j] > 0:
                fetched += 1
        else:
            actions[j] = 4  # RECOMPUTE
            kinds[j] = -1
            rows[j] = -1
    return best_k, fetched, best_fetch, best_t


@numba.njit(cache=True, nogil=True)
def scan_overlaps(keys, offsets, b0, b1, hashes, node_worker, allowed, public_slot, public_sorted, guard, overlaps,
                  ok):  # pragma: no cover
    """Fill ``overlaps`` (3, n_workers) with each worker's consecutive device / host / disk
    prefix overlap over blocks ``b0:b1`` (host counted beyond the device prefix, disk beyond the
    host prefix) and, when ``guard``, ``ok[i]`` with whether replica row ``offsets[b0] + i`` passed
    the guard. Returns -1, or the largest node number missing from ``node_worker`` (the caller
    refreshes its map and retries)."""
    return _scan(keys, offsets, b0, b1, hashes, node_worker, allowed, public_slot, public_sorted, guard, overlaps, ok)


@numba.njit(cache=True, nogil=True)
def choose_actions(keys, offsets, b0, b1, node_worker, guard, ok, worker, per_block_s, latency_s, kind_action,
                   a_coef, c_coef, isl, bs, queue_s, actions, kinds, rows):  # pragma: no cover - jitted
    """Pick each block's cheapest allowed source (``ok`` from ``scan_overlaps``) for ``worker`` and
    the reuse length ``k <= (isl - 1) // bs`` that minimises predicted TTFT (see cost_model). Fills
    ``actions``/``kinds``/``rows`` (rows index ``keys``); returns ``(k, fetched_blocks, fetch_s, ttft_s)``."""
    return _choose(keys, offsets, b0, b1, node_worker, guard, ok, worker, per_block_s, latency_s, kind_action,
                   a_coef, c_coef, isl, bs, queue_s, actions, kinds, rows)


@numba.njit(cache=True, nogil=True)
def plan_dynamo(keys, offsets, b0, b1, hashes, node_worker, allowed, public_slot, public_sorted, guard,
                apt, dec, elig, isl, bs, fparams, per_block_s, latency_s, kind_action,
                overlaps, logits, actions, kinds, rows, out_i, out_f):  # pragma: no cover - jitted
    """scan + Dynamo routing + actions in one call (the default router's fast path).

    ``fparams`` = (prefill_load_scale, credit_device, credit_host, credit_disk, temperature,
    uniform draw, a_coef, c_coef). Returns -1 and fills ``out_i`` = (worker, k, fetched) and
    ``out_f`` = (fetch_s, ttft_s); or the missing node number (nothing decided); or -2 when no
    worker is eligible."""
    ok = np.empty(offsets[b1] - offsets[b0] if guard else 0, dtype=np.bool_)
    missing = _scan(keys, offsets, b0, b1, hashes, node_worker, allowed, public_slot, public_sorted, guard, overlaps, ok)
    if missing >= 0:
        return missing
    _dyn_logits(overlaps, apt, dec, isl, bs, fparams[0], fparams[1], fparams[2], fparams[3], logits)
    w = _dyn_select(logits, elig, fparams[4], fparams[5])
    if w < 0:
        return -2
    k, fetched, fetch, t = _choose(keys, offsets, b0, b1, node_worker, guard, ok, w, per_block_s, latency_s, kind_action, fparams[6], fparams[7], isl, bs,
                                   fparams[6] * apt[w], actions, kinds, rows)
    out_i[0] = w
    out_i[1] = k
    out_i[2] = fetched
    out_f[0] = fetch
    out_f[1] = t
    return -1


guard_cache(__name__, "quillcache.routing.dynamo")  # flush this module's cached kernels when a dependency changed
