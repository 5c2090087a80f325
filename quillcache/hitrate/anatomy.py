"""Anatomy of the difference between two policies' hits on one trace: which block references one
policy hits and the other misses, by how often the block is used in the whole trace and by how
long ago (in requests) it was used before.

A reference is a *hit* of a policy when it lies within its request's prefix hits
(``HitRateResult.hits_per_request``: position in the request < hits of that request). Two runs on
the same trace and capacity are compared reference by reference; every reference falls into exactly
one (uses, previous use) cell, so summed over the cells ``a_only - b_only`` equals the difference
of the two runs' hit counts.

- *uses*: the block's references in the whole trace (an offline label for explaining a result,
  never an input to a policy): ``1``, ``2``, ``3``, ``4-7``, ``8-15``, ``16+``.
- *previous use*: requests since the block was last referenced: ``first`` (never before),
  ``same`` (earlier in the same request), ``1-9``, ``10-99``, ``100-999``, ``1000+``.

``anatomy`` is the vectorised version; ``anatomy_reference`` states the same thing one reference at
a time in plain Python, and the two agree (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from quillcache.hitrate.arrays import TraceArrays

__all__ = ["GAP_LABELS", "USES_LABELS", "AnatomyCell", "anatomy", "anatomy_reference", "hit_mask"]

USES_EDGES = (1, 2, 3, 4, 8, 16)  # lower edges of the uses buckets
USES_LABELS = ("1", "2", "3", "4-7", "8-15", "16+")
GAP_EDGES_REQUESTS = (1, 10, 100, 1000)  # lower edges of the previous-use buckets after "first" and "same"
GAP_LABELS = ("first", "same", "1-9", "10-99", "100-999", "1000+")


@dataclass(frozen=True)
class AnatomyCell:
    """References of one (uses, previous use) cell and how many of them each policy hit."""
    uses: str
    previous_use: str
    references: int
    a_hits: int
    b_hits: int
    a_only: int  # hit by a, missed by b
    b_only: int  # hit by b, missed by a


def _check(arrs: TraceArrays, hits: np.ndarray, name: str) -> np.ndarray:
    hits = np.asarray(hits)
    if hits.shape != (arrs.num_requests,):
        raise ValueError(f"{name} must hold one hit count per request ({arrs.num_requests}), got shape {hits.shape}")
    lengths = np.diff(arrs.req_offsets)
    if (hits < 0).any() or (hits > lengths).any():
        r = int(np.nonzero((hits < 0) | (hits > lengths))[0][0])
        raise ValueError(f"{name}[{r}] = {int(hits[r])} is not a prefix-hit count of request {r} "
                         f"(0..{int(lengths[r])} blocks)")
    return hits.astype(np.int64)


def hit_mask(arrs: TraceArrays, hits_per_request: np.ndarray) -> np.ndarray:
    """bool[num_refs]: whether each block reference is one of its request's prefix hits."""
    hits = _check(arrs, hits_per_request, "hits_per_request")
    lengths = np.diff(arrs.req_offsets)
    pos_in_request = np.arange(arrs.num_refs) - np.repeat(arrs.req_offsets[:-1], lengths)
    return pos_in_request < np.repeat(hits, lengths)


def _buckets(arrs: TraceArrays) -> tuple[np.ndarray, np.ndarray]:
    """(uses bucket, previous-use bucket) of every reference, as indices into the label tuples."""
    blocks = arrs.blocks
    req = np.repeat(np.arange(arrs.num_requests), np.diff(arrs.req_offsets))
    uses = np.bincount(blocks, minlength=arrs.num_unique)[blocks]
    u_idx = np.searchsorted(USES_EDGES, uses, side="right") - 1
    order = np.argsort(blocks, kind="stable")  # each block's references in trace order
    prev_req = np.full(arrs.num_refs, -1, np.int64)
    same_block = blocks[order[1:]] == blocks[order[:-1]]
    prev_req[order[1:][same_block]] = req[order[:-1][same_block]]
    gap = req - prev_req
    g_idx = np.where(prev_req < 0, 0, np.where(gap == 0, 1, 1 + np.searchsorted(GAP_EDGES_REQUESTS, gap,
                                                                                  side="right")))
    return u_idx, g_idx


def _cells(counts: np.ndarray) -> list[AnatomyCell]:
    out = []
    for i, ul in enumerate(USES_LABELS):
        for j, gl in enumerate(GAP_LABELS):
            n, ah, bh, ao, bo = (int(x) for x in counts[i, j])
            if n:
                out.append(AnatomyCell(ul, gl, n, ah, bh, ao, bo))
    return out


def anatomy(arrs: TraceArrays, hits_a: np.ndarray, hits_b: np.ndarray) -> list[AnatomyCell]:
    """Every non-empty (uses, previous use) cell of the trace, with the references policy a
    (``hits_a``, prefix hits per request) and policy b hit."""
    a, b = hit_mask(arrs, hits_a), hit_mask(arrs, hits_b)
    u_idx, g_idx = _buckets(arrs)
    flat = u_idx * len(GAP_LABELS) + g_idx
    size = len(USES_LABELS) * len(GAP_LABELS)
    counts = np.stack([np.bincount(flat, weights=w, minlength=size) for w in
                       (np.ones(arrs.num_refs), a, b, a & ~b, b & ~a)], axis=-1)
    return _cells(counts.reshape(len(USES_LABELS), len(GAP_LABELS), 5))


def anatomy_reference(arrs: TraceArrays, hits_a: np.ndarray, hits_b: np.ndarray) -> list[AnatomyCell]:
    """``anatomy`` one reference at a time (the specification the vectorised version is tested against)."""
    hits_a, hits_b = _check(arrs, hits_a, "hits_a"), _check(arrs, hits_b, "hits_b")
    off, blocks = arrs.req_offsets.tolist(), arrs.blocks.tolist()
    uses: dict[int, int] = {}
    for x in blocks:
        uses[x] = uses.get(x, 0) + 1
    counts = np.zeros((len(USES_LABELS), len(GAP_LABELS), 5), np.int64)
    last_req: dict[int, int] = {}
    for r in range(arrs.num_requests):
        for p in range(off[r], off[r + 1]):
            x = blocks[p]
            i = max(k for k, edge in enumerate(USES_EDGES) if uses[x] >= edge)
            if x not in last_req:
                j = 0
            elif last_req[x] == r:
                j = 1
            else:
                j = 1 + max(k + 1 for k, edge in enumerate(GAP_EDGES_REQUESTS) if r - last_req[x] >= edge)
            last_req[x] = r
            a, b = p - off[r] < hits_a[r], p - off[r] < hits_b[r]
            counts[i, j] += (1, a, b, a and not b, b and not a)
    return _cells(counts)
