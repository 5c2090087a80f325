"""When SIEVE evicts a block it spared, and why until then it is in-cache LFU.

SIEVE (``quillcache.policies.sieve``) *spares* a cached block that was hit: the hand clears its visited
bit and passes it. The block is evicted only if the hand comes back to it (a lap of the queue) before
it is hit again. ``sieve_spared_evictions`` replays a trace through the online ``SievePolicy`` with the
prefix-aware harness of ``quillcache.hitrate.reference`` (the same rules: prefix hits first, then each
block of the request touched or inserted, evicting at capacity) and counts, among SIEVE's evictions,
those of a *spared* block (hit at least once since it was inserted).

Invariant (the reason SIEVE and LFU so often tie on prefix-chained traces):

    spared == 0   =>   SIEVE's victims are in-cache LFU's (``quillcache.policies.lfu``), so their
                       per-request hits are equal.

Why: every block the hand has passed since it last started from the oldest end was visited (hit) when
passed, and new blocks join the newest end, ahead of the hand; so the first unvisited block ahead of
the hand is either a spared block whose bit was cleared or the oldest never-hit block. With no spared
eviction it is always the oldest never-hit block, which is LFU's victim too: frequency 1 means never
hit since insertion, and among equal frequencies LFU takes the one that reached it first, i.e. the
oldest insert. Both caches then hold the same blocks after every step (induction). When no never-hit
block is cached, SIEVE's victim is spared, so the premise also says one always exists. The converse
does not hold: a spared eviction can happen to choose LFU's victim too.

``first_spared_request`` is the request during which the first spared eviction happened (-1: none),
so a caller can say how far into a trace the two policies are bound to agree. ``spared_resident`` and
``spared_idle_median_requests`` describe the cache after the last request: how many cached blocks are
spared, and the median number of requests since each was last hit (what keeping them costs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from quillcache._checks import check_int
from quillcache.hitrate.arrays import TraceArrays, validate_arrays
from quillcache.policies.sieve import SievePolicy

__all__ = ["SparedEvictions", "sieve_spared_evictions"]


@dataclass(frozen=True)
class SparedEvictions:
    """SIEVE's evictions on one trace at one capacity, and how many removed a spared block."""
    capacity_blocks: int
    evictions: int
    spared: int  # evictions of a block hit at least once since its insert
    first_spared_request: int  # request index of the first spared eviction, -1 if there was none
    hits_per_request: np.ndarray  # int32[R], SIEVE's prefix hits (equal to the kernel's)
    spared_resident: int  # spared blocks cached after the last request
    spared_idle_median_requests: float  # their median requests since the last hit (nan if none)

    @property
    def spared_share(self) -> float:
        return self.spared / self.evictions if self.evictions else 0.0


def sieve_spared_evictions(arrs: TraceArrays, capacity_blocks: int) -> SparedEvictions:
    """Replay ``arrs`` through ``SievePolicy`` at ``capacity_blocks`` and count spared evictions."""
    validate_arrays(arrs)
    cap = check_int("capacity_blocks", capacity_blocks, 1)
    pol = SievePolicy()
    last_hit: dict[int, int] = {}  # spared block -> request of its last hit (cached blocks only)
    off = arrs.req_offsets.tolist()
    blocks = arrs.blocks.tolist()
    hits = np.zeros(arrs.num_requests, dtype=np.int32)
    evictions = spared = 0
    first = -1
    for r in range(arrs.num_requests):
        keys = blocks[off[r]:off[r + 1]]
        k = 0
        for b in keys:
            if b not in pol:
                break
            k += 1
        hits[r] = k
        for b in keys:
            if b in pol:
                pol.touch(b)
                last_hit[b] = r
                continue
            if len(pol) >= cap:
                v = pol.victim()
                pol.evict(v)
                evictions += 1
                if last_hit.pop(v, None) is not None:
                    spared += 1
                    if first < 0:
                        first = r
            pol.insert(b, 1)
    idle = [arrs.num_requests - 1 - q for q in last_hit.values()]
    return SparedEvictions(capacity_blocks=cap, evictions=evictions, spared=spared, first_spared_request=first,
                           hits_per_request=hits, spared_resident=len(last_hit),
                           spared_idle_median_requests=float(np.median(idle)) if idle else float("nan"))
