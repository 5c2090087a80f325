"""Conversation turns of a prefix-chained trace, and how well "the same gap as last time" predicts
when a conversation comes back.

A request's *last full block* is its last block, or the one before it when its prompt ends in a
partial block (``input_tokens % block_tokens != 0``: the next turn re-sends those tokens with more,
so that block is never a prefix of anything). A request's *previous turn* is the request that
created (first referenced) and ended on the deepest block of its known prefix that a request
created and ended on: the next turn of a conversation extends its chain exactly where the previous
request left it. A request that merely ends on a shared system prompt (a block someone else
created) is nobody's previous turn: otherwise every conversation that starts with that prompt
would look like one conversation.

Everything here reads only the past of each request except ``turn_gap_log_ratios``, which is an
offline measurement (it reads ``TraceArrays.next_use``) of an online predictor's error.
"""

from __future__ import annotations

import math

import numpy as np

from quillcache.hitrate.arrays import TraceArrays
from quillcache.traces.schemas import MOONCAKE_BLOCK_TOKENS

__all__ = ["last_full_positions", "previous_turns", "robust_sigma", "turn_gap_log_ratios"]


def last_full_positions(arrs: TraceArrays, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> np.ndarray:
    """int64[R]: the position (in ``arrs.blocks``) of each request's last full block, -1 if none."""
    off = arrs.req_offsets
    partial = (arrs.input_tokens % block_tokens) != 0
    last = off[1:] - 1 - partial.astype(np.int64)
    return np.where(last >= off[:-1], last, -1)


def previous_turns(arrs: TraceArrays, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> np.ndarray:
    """int64[R]: each request's previous turn (module docstring), -1 when there is none."""
    off, blocks = arrs.req_offsets.tolist(), arrs.blocks.tolist()
    pos = last_full_positions(arrs, block_tokens).tolist()
    seen = np.zeros(arrs.num_unique, np.bool_)
    made_end = np.full(arrs.num_unique, -1, np.int64)  # the request that created the block and ended on it
    out = np.full(arrs.num_requests, -1, np.int64)
    for r in range(arrs.num_requests):
        for b in blocks[off[r]:off[r + 1]]:
            if not seen[b]:
                break
            if made_end[b] >= 0:
                out[r] = made_end[b]
        if pos[r] >= 0 and not seen[blocks[pos[r]]]:
            made_end[blocks[pos[r]]] = r
        seen[blocks[off[r]:off[r + 1]]] = True
    return out


def turn_gap_log_ratios(arrs: TraceArrays, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> np.ndarray:
    """float64[M]: ``log((q - r) / (r - p))``, in requests, for every request ``r`` with a previous
    turn ``p`` whose last full block is referenced again, first in a later request ``q``: the error
    of predicting that the conversation comes back after the same gap as last time (0 = exact)."""
    prev = previous_turns(arrs, block_tokens)
    pos = last_full_positions(arrs, block_tokens)
    ok = (prev >= 0) & (pos >= 0)
    ok[ok] = arrs.next_use[pos[ok]] < arrs.num_refs
    r = np.flatnonzero(ok)
    q = np.searchsorted(arrs.req_offsets, arrs.next_use[pos[r]], side="right") - 1
    later = q > r  # a block repeated inside one request is not a next turn
    r, q = r[later], q[later]
    return np.log((q - r) / (r - prev[r]))


def robust_sigma(x: np.ndarray) -> float:
    """The interquartile range over 1.349: a normal distribution's sigma, robust to outliers
    (NaN when empty)."""
    if len(x) == 0:
        return math.nan
    q1, q3 = np.percentile(x, [25, 75])
    return float((q3 - q1) / 1.349)
