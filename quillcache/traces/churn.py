"""Residency churn from a Mooncake trace: the operation stream the storage study replays.

Blocks are placed on ``num_nodes`` nodes by prefix affinity on a request's second block id (its first
is, in Mooncake's traces, the trace-wide system prompt, which would put every request on one node; so
leading blocks shared across conversations are replicated on several nodes), each request is
issued by one of ``num_tenants`` tenants (so the same block hash lives under several identities,
as it does with content-only hashes), and every node keeps a DRAM tier and an SSD tier with LRU
order: a miss puts the block into DRAM, DRAM overflow demotes to SSD (remove + put), SSD overflow
removes, an SSD hit promotes back to DRAM. The trace is replayed in passes, each with a fresh
tenant assignment, until at least ``target_entries`` replicas are live and at least ``churn_factor`` times
that many puts were issued. Deterministic for a given seed.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

from quillcache._checks import check_float, check_int
from quillcache._mix import splitmix64
from quillcache.index.keys import ReplicaKey, ResidencyEntry
from quillcache.traces.loader import TraceRequest
from quillcache.types import CacheTier, Identity



def block_hash_of(block_id: int) -> int:
    """A stand-in 64-bit chained block hash for a trace id (splitmix64; ids are prefix-chained)."""
    return splitmix64(block_id)


@dataclass
class ChurnBatch:
    """Residency changes applied as one batch: puts, then removes. A request is one batch unless it
    touches a key twice in opposite directions; then it is split so the order is kept."""

    puts: list[ResidencyEntry] = field(default_factory=list)
    removes: list[ReplicaKey] = field(default_factory=list)


@dataclass
class ChurnWorkload:
    batches: list[ChurnBatch]
    live: dict[ReplicaKey, ResidencyEntry]
    num_puts: int
    num_removes: int


def residency_churn(
    trace: list[TraceRequest],
    target_entries: int,
    *,
    num_nodes: int = 8,
    num_tenants: int = 16,
    dram_share: float = 0.25,
    churn_factor: float = 1.5,
    block_bytes: int = 512 * 128 * 1024,
    seed: int = 0,
) -> ChurnWorkload:
    """The residency churn ``trace`` induces (see the module docstring).

    ``target_entries`` >= 1 live replicas wanted; ``num_nodes`` and ``num_tenants`` >= 1;
    ``dram_share`` in [0, 1] (each node's DRAM tier keeps at least one block, its SSD tier too);
    ``churn_factor`` >= 0 finite; ``block_bytes`` >= 1; ``seed`` >= 0. A bad value raises
    ``ValueError`` (``TypeError`` for a wrong type) naming the parameter; ``trace`` must be a list of
    :class:`TraceRequest`. Invariant: applying ``batches`` in order (each: puts, then removes) to an
    empty index gives exactly ``live``; after 200 passes over the trace it stops, targets met or not.
    """
    if not isinstance(trace, list) or not all(isinstance(r, TraceRequest) for r in trace):
        raise TypeError(f"trace must be a list of TraceRequest, got {type(trace).__name__}")
    for name, v, lo in (("target_entries", target_entries, 1), ("num_nodes", num_nodes, 1),
                        ("num_tenants", num_tenants, 1), ("block_bytes", block_bytes, 1), ("seed", seed, 0)):
        check_int(name, v, lo)
    check_float("dram_share", dram_share, 0.0, 1.0)
    check_float("churn_factor", churn_factor, 0.0)
    rng = random.Random(seed)
    per_node = max(2, int(1.15 * target_entries) // num_nodes)  # headroom: nodes fill unevenly
    dram_cap = max(1, int(per_node * dram_share))
    ssd_cap = max(1, per_node - dram_cap)
    identities = [Identity(model="llama-3-8b", tokenizer="llama3", tenant=f"tenant-{t}").digest() for t in range(num_tenants)]
    nodes = [f"node-{i}" for i in range(num_nodes)]
    dram = [OrderedDict() for _ in nodes]  # (hash, ident) -> offset
    ssd = [OrderedDict() for _ in nodes]
    live: dict[ReplicaKey, ResidencyEntry] = {}
    batches: list[ChurnBatch] = []
    next_off = [0] * num_nodes
    num_puts = num_removes = 0

    # A batch is applied as "puts, then removes", so an op that touches a key the open batch
    # already touched in the other direction closes the batch first (order is preserved).
    touched_put: set[ReplicaKey] = set()
    touched_rm: set[ReplicaKey] = set()

    def current() -> ChurnBatch:
        return batches[-1]

    def split_if(conflict: bool) -> None:
        if conflict:
            batches.append(ChurnBatch())
            touched_put.clear()
            touched_rm.clear()

    def place(n: int, h: int, ident: bytes, tier: CacheTier) -> None:
        nonlocal num_puts
        off = next_off[n]
        next_off[n] += block_bytes
        e = ResidencyEntry(h, nodes[n], tier, ident, int(tier), off, block_bytes)
        split_if(e.key in touched_rm)
        current().puts.append(e)
        touched_put.add(e.key)
        live[e.key] = e
        num_puts += 1

    def drop(n: int, h: int, ident: bytes, tier: CacheTier) -> None:
        nonlocal num_removes
        k = ReplicaKey(h, nodes[n], tier, ident)
        split_if(k in touched_put)
        current().removes.append(k)
        touched_rm.add(k)
        del live[k]
        num_removes += 1

    passes = 0
    while len(live) < target_entries or num_puts < churn_factor * target_entries:
        passes += 1
        if passes > 200:
            break
        tenant_of = [rng.randrange(num_tenants) for _ in range(len(trace))]
        for ri, req in enumerate(trace):
            if not req.hash_ids:
                continue
            ident = identities[tenant_of[ri]]
            n = block_hash_of(req.hash_ids[min(1, len(req.hash_ids) - 1)]) % num_nodes
            batches.append(ChurnBatch())
            touched_put.clear()
            touched_rm.clear()
            for bid in req.hash_ids:
                h = block_hash_of(bid)
                k = (h, ident)
                if k in dram[n]:
                    dram[n].move_to_end(k)
                    continue
                if k in ssd[n]:  # promote
                    del ssd[n][k]
                    drop(n, h, ident, CacheTier.SSD)
                dram[n][k] = True
                place(n, h, ident, CacheTier.DRAM)
                if len(dram[n]) > dram_cap:  # demote the LRU block
                    (vh, vi), _ = dram[n].popitem(last=False)
                    drop(n, vh, vi, CacheTier.DRAM)
                    ssd[n][(vh, vi)] = True
                    place(n, vh, vi, CacheTier.SSD)
                    if len(ssd[n]) > ssd_cap:
                        (sh, si), _ = ssd[n].popitem(last=False)
                        drop(n, sh, si, CacheTier.SSD)
            if len(live) >= target_entries and num_puts >= churn_factor * target_entries:
                break
    batches = [b for b in batches if b.puts or b.removes]
    return ChurnWorkload(batches, live, num_puts, num_removes)
