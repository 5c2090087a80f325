"""``ClusterPool``: the replay's ``BytePool`` over a real pool (``PooledStore`` and node processes).

Each (node, block) pair the replay offloads becomes one pool object named
:func:`~quillcache.harness.bytepool.pool_key`, holding :func:`~quillcache.harness.bytepool.block_payload`
(``block_bytes`` deterministic pseudo-random bytes of that name; the replay's blocks are scaled down
from the model's KV size to ``block_bytes`` so a trace fits this machine). Per replay event:

- ``offload``: ONE ``put_many`` (``replicas`` copies, 1 by default: the replay's data planes hold one
  copy per node, and the pool mirrors them); a put the pool refuses counts in ``offload_failures``;
- ``drop``: ``remove(force=True)`` of each pair (a drop means the bytes left the node, even while a
  read lease is held); a remove that fails counts in ``drop_failures``;
- ``fetch``: ONE ``get_many`` (``local_cache_bytes=0`` in the store :func:`cluster_replay` makes, so
  every fetch is a remote READ over the transfer engine); each payload is compared byte for byte with
  the expected bytes: ``None`` counts in ``misses``, a difference in ``corrupt`` (both must stay 0).

Measured times are the wall time of the ``put_many`` / ``get_many`` calls (master RPCs and transfers;
not the payload generation or the comparison); ``measured_transfer_s`` is the transfer engine's part
(``PoolStats.transfer_s``). Predictions are the engine model's for the same ``block_bytes``
(``quillcache.harness.bytepool``). ``cluster_replay`` sizes the nodes' DRAM so the pool never has to
evict: ``pool_objects_bound`` (the offloads a replay can make: every full prompt block of every
request, at most the host tiers' capacity) framed objects, at most ``FILL`` of each node's segment.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from quillcache.harness.bytepool import PoolBlock, PoolReport, _Predictor, block_payload, pool_key
from quillcache.harness.config import ReplayConfig
from quillcache.planner.cost_model import CostModel
from quillcache.pool.cluster import MAX_NODES
from quillcache.store.tier_codec import FP16

__all__ = ["DEFAULT_BLOCK_BYTES", "FILL", "MAX_BLOCK_BYTES", "MAX_CLUSTER_NODES", "ClusterPlan", "ClusterPool", "cluster_replay", "plan_cluster",
           "pool_objects_bound"]

DEFAULT_BLOCK_BYTES = 16 << 10  # a 512-token Llama-3-8B block (64 MiB) scaled 1/4096
FILL = 0.8  # of a node's segment, below the master's 0.90 eviction watermark
MAX_BLOCK_BYTES = 64 << 20
MAX_CLUSTER_NODES = MAX_NODES  # LocalCluster's bound, the one `quillcache cluster up --nodes` has too
_ALIGN_BYTES = 64  # MasterConfig.alignment_bytes
_MiB = 1 << 20


class ClusterPool:
    """A ``BytePool`` moving real bytes through a ``PooledStore`` (module docstring)."""

    name = "cluster"

    def __init__(self, store, *, block_bytes: int = DEFAULT_BLOCK_BYTES, nodes: int = 0, replicas: int = 1) -> None:
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or not 1 <= block_bytes <= MAX_BLOCK_BYTES:
            raise ValueError(f"block_bytes={block_bytes!r} must be an int in [1, {MAX_BLOCK_BYTES}]")
        self.store = store
        self.block_bytes = block_bytes
        self.replicas = replicas
        self._r = PoolReport(pool=self.name, real_bytes=True, nodes=nodes, block_bytes=block_bytes, replicas=replicas,
                             measured_offload_s=0.0, measured_fetch_s=0.0, measured_transfer_s=0.0)
        self._p = _Predictor(None, block_bytes)
        self._stats0 = store.stats()

    def bind(self, cost_model: CostModel, model_block_bytes: int) -> None:  # noqa: ARG002 - predicts at block_bytes
        self._p = _Predictor(cost_model, self.block_bytes)

    def offload(self, blocks: Sequence[PoolBlock]) -> None:
        from quillcache.pool import PoolError

        names = list(dict.fromkeys(pool_key(b) for b in blocks))
        items = [(k, block_payload(k, self.block_bytes)) for k in names]
        r = self._r
        t0 = time.perf_counter()
        try:
            outs = self.store.put_many(items, replicas=self.replicas)
        except PoolError:  # the master unreachable: nothing of the batch is in the pool
            outs = [None] * len(items)
        r.measured_offload_s += time.perf_counter() - t0
        r.predicted_offload_s += self._p.offload_s(len(items))
        for o in outs:
            if o is None or isinstance(o, BaseException):
                r.offload_failures += 1
                continue
            r.blocks_offloaded += 1
            r.bytes_written += 0 if o.existing else self.block_bytes * o.replicas_written

    def drop(self, blocks: Sequence[PoolBlock]) -> None:
        from quillcache.master.errors import MasterError
        from quillcache.pool import PoolError

        r = self._r
        for k in dict.fromkeys(pool_key(b) for b in blocks):
            try:
                gone = self.store.remove(k, force=True)
            except (PoolError, MasterError):  # the master unreachable or refusing: the object stays
                gone = False
            r.blocks_dropped += gone
            r.drop_failures += not gone

    def fetch(self, blocks: Sequence[PoolBlock]) -> int:
        from quillcache.pool import PoolError

        names = [pool_key(b) for b in blocks]
        r = self._r
        t0 = time.perf_counter()
        try:
            views = self.store.get_many(names)
        except PoolError:
            views = [None] * len(names)
        r.measured_fetch_s += time.perf_counter() - t0
        r.predicted_fetch_s += self._p.fetch_s([b.kind for b in blocks])
        found = 0
        for k, v in zip(names, views):
            r.blocks_fetched += 1
            if v is None:
                r.misses += 1
                continue
            r.bytes_read += v.nbytes
            if v.nbytes != self.block_bytes or v != block_payload(k, self.block_bytes):
                r.corrupt += 1
                continue
            found += 1
        del views
        return found

    def report(self) -> PoolReport:
        out = self._r.copy()
        st, s0 = self.store.stats(), self._stats0
        out.fallbacks = st.fallbacks - s0.fallbacks
        out.measured_transfer_s = st.transfer_s - s0.transfer_s
        out.extra = {"lease_expired_discards": float(st.lease_expired_discards - s0.lease_expired_discards),
                     "corrupt_discarded": float(st.corrupt_discarded - s0.corrupt_discarded)}
        return out

    def close(self) -> None:
        self.store.close()


def pool_objects_bound(requests: Sequence, cfg: ReplayConfig) -> int:
    """At most how many (node, block) pairs a replay's host tiers hold at once: every offload comes
    from a full prompt block of a request (each placed on a GPU at most once per request), and, when
    the tiers are sized in 16-bit blocks, no node holds more than its DRAM + SSD blocks."""
    full = sum(r.input_tokens // r.block_tokens for r in requests)
    if cfg.kv_codec == FP16 and cfg.dram_capacity_bytes is None and cfg.ssd_capacity_bytes is None:
        full = min(full, cfg.engines * (cfg.dram_capacity_blocks + cfg.ssd_capacity_blocks))
    return max(1, full)


@dataclass(frozen=True)
class ClusterPlan:
    nodes: int
    block_bytes: int
    objects_bound: int
    dram_bytes_per_node: int

    @property
    def total_dram_bytes(self) -> int:
        return self.nodes * self.dram_bytes_per_node


def plan_cluster(objects_bound: int, *, nodes: int, block_bytes: int) -> ClusterPlan:
    """Each node's DRAM so ``objects_bound`` framed objects of ``block_bytes`` fill at most ``FILL`` of
    the pool (one replica each), rounded up to whole MiB (at least 16 MiB)."""
    from quillcache.pool.frame import TRAILER_BYTES

    foot = -(-(block_bytes + TRAILER_BYTES) // _ALIGN_BYTES) * _ALIGN_BYTES
    per = math.ceil(objects_bound * foot / nodes / FILL) + 2 * foot
    per = max(16 * _MiB, -(-per // _MiB) * _MiB)
    return ClusterPlan(nodes, block_bytes, objects_bound, per)


def cluster_replay(requests: Sequence, cfg: ReplayConfig, *, nodes: int, block_bytes: int = DEFAULT_BLOCK_BYTES,
                   progress=None, base_dir=None, on_start=None):
    """Replay ``requests`` with a :class:`ClusterPool` over a fresh ``LocalCluster`` of ``nodes`` node
    processes (stopped before returning, whatever happens). ``on_start(plan, cluster)`` is called once
    the cluster serves. Raises ``ReplayResourceError`` before starting anything when the nodes' DRAM
    would not fit this machine."""
    from quillcache.harness.replay import ReplayResourceError, available_ram_bytes, replay
    from quillcache.pool.cluster import LocalCluster

    reqs = list(requests)[: cfg.limit] if cfg.limit is not None else list(requests)
    plan = plan_cluster(pool_objects_bound(reqs, cfg), nodes=nodes, block_bytes=block_bytes)
    have = available_ram_bytes()
    if have and plan.total_dram_bytes > 0.5 * have:
        gib = 1 << 30
        raise ReplayResourceError(
            f"--cluster {nodes} would pre-touch {plan.total_dram_bytes / gib:,.1f} GiB of node DRAM "
            f"({plan.objects_bound:,} blocks of {block_bytes:,} bytes) but this machine has {have / gib:,.1f} GiB "
            f"available; lower --block-bytes or --limit")
    with LocalCluster(nodes=nodes, dram_bytes=plan.dram_bytes_per_node, base_dir=base_dir,
                      client_ttl_s=10.0, lease_ttl_s=10.0) as cluster:
        if on_start is not None:
            on_start(plan, cluster)
        store = cluster.store(local_cache_bytes=0, staging_bytes=max(64 * _MiB, 256 * block_bytes), replicas=1,
                              persist=False, timeout_s=30.0)
        pool = ClusterPool(store, block_bytes=block_bytes, nodes=nodes, replicas=1)
        try:
            return replay(reqs, cfg, progress=progress, pool=pool), plan
        finally:
            pool.close()
