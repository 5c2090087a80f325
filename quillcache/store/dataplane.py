"""The tiered data plane of one node: GPU accounting, DRAM bytes, SSD bytes, one residency view.

``StoreDataPlane`` owns a ``LocalKvStore`` (DRAM) and optionally an ``SsdTier``; it decides
placement, promotion, demotion and eviction, and reports every residency change to the
residency index (``ResidencyEntry``/``ReplicaKey`` with this node, the tier and the real
``(segment_id, offset_bytes, size_bytes)``).

Residency model (invariants, checked after every step by tests/test_dataplane.py):
- Bytes are exclusive between DRAM and SSD: a stored block's bytes are in exactly one of them.
  Promotion (SSD → DRAM) and demotion (DRAM → SSD) move the real bytes.
- GPU is accounting only: the set of blocks an engine on this node holds in GPU memory (capacity
  in blocks, no bytes here). A block may be GPU-held with or without bytes in DRAM/SSD.
- For every block and tier it is in, the index holds exactly one entry for this node with the
  tier's real location (GPU entries: segment 0, offset 0, the block's size), and nothing else for
  this node.
- Each tier has its own instance of the eviction policy (``policy`` by name, from
  ``quillcache.policies``), which tracks exactly that tier's blocks.
- A leased or pinned block (``quillcache.store.leases``) is never evicted, deleted or demoted;
  soft-pinned blocks are evicted only after every other evictable one.

Eviction under pressure: a DRAM placement that does not fit evicts DRAM victims (policy order,
skipping blocks in use); each victim is demoted to SSD if the SSD tier is healthy, admits it and
can hold it (evicting SSD victims for room), else dropped from the node. A full disk under the SSD
tier (``DiskFullError``) is not a shortage of SSD capacity: no SSD block is evicted for it.
Bytes demoted from a DRAM store with ``checksum=True`` are checked against their crc32c first
(whatever ``verify_dram_reads`` says): a block that fails is dropped as corrupt, never written to
SSD under a fresh checksum. A GPU hold beyond capacity drops
the GPU policy's victim. Before evicting anything, the victims are planned: if evicting every
block that may be evicted would still not free enough bytes, ``StoreFullError`` is raised and
nothing changed. (If the bytes suffice but the free space stays fragmented, more victims are
taken; if none remain, the error comes after the planned demotions, which keep every block's
contents.)

Reads: ``get`` returns a zero-copy read-only view for a DRAM hit (valid until the block leaves
DRAM: take a lease to keep it, ``get(key, lease_ttl_s=...)``), and the bytes for an SSD hit,
which is promoted to DRAM if that is possible without failing the read (never from an unhealthy
SSD tier: it refuses the delete that ends a promotion, so the bytes are served from SSD).

Opening is recovery: DRAM is empty after a restart, so every GPU/DRAM entry of this node is
removed from the index; the SSD tier recovered itself when it was opened, and the index is
reconciled against it with ``quillcache.store.reconcile.reconcile_index``. Pins and leases do not
survive a restart.

Restart: ``close()``, reopen the ``SsdTier`` on the same directory, and construct a new
``StoreDataPlane`` with a fresh ``LocalKvStore`` and the same index.

This module is the facade: input validation, locking, recovery on open, queries, pins and leases.
It holds a ``quillcache.store.dataplane_placement.Placement``, given the tiers, policies, pin table
and counters in its constructor, which moves bytes between tiers (each move written once there);
pins and leases live in ``quillcache.store.leases``.
Not re-entrant from callbacks; public methods take one lock, so threads may share an instance.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Self

from quillcache._checks import check_int
from quillcache.index import IndexBackend, ResidencyEntry
from quillcache.policies import EvictionPolicy, make_policy
from quillcache.store.dataplane_placement import (
    DRAM,
    GPU,
    SSD,
    DataPlaneStats,
    EvictCallback,
    Placement,
)
from quillcache.store.dram import LocalKvStore, as_byte_view
from quillcache.store.errors import (
    BlockExistsError,
    BlockInUseError,
    BlockNotFoundError,
    BlockTooLargeError,
    CorruptBlockError,
    StoreClosedError,
    StoreFullError,
)
from quillcache.store.keys import StoreKey
from quillcache.store.leases import HoldTable, check_ttl
from quillcache.store.ssd import SsdTier
from quillcache.types import CacheTier

__all__ = ["DataPlaneStats", "StoreDataPlane"]


def _check_key(key: object) -> StoreKey:
    if not isinstance(key, StoreKey):
        raise TypeError(f"key must be a StoreKey, got {type(key).__name__} {key!r:.80}")
    return key


def _check_tier(tier: object) -> CacheTier:
    if isinstance(tier, bool) or not isinstance(tier, int):
        raise TypeError(f"tier must be a CacheTier, got {type(tier).__name__} {tier!r}")
    try:
        t = CacheTier(tier)
    except ValueError:
        raise ValueError(f"tier={tier!r} is not a CacheTier") from None
    if t not in (GPU, DRAM, SSD):
        raise ValueError(f"tier={t.name} is not a tier of this node (GPU, DRAM or SSD)")
    return t


class StoreDataPlane:
    """GPU/DRAM/SSD residency of one node (see the module docstring for the contract)."""

    def __init__(self, node: str, *, dram: LocalKvStore, ssd: SsdTier | None = None, gpu_capacity_blocks: int = 0,
                 index: IndexBackend | None = None, policy: str = "lru", policy_options: dict | None = None,
                 clock: Callable[[], float] = time.monotonic, soft_pin_ttl_s: float = 1800.0,
                 verify_dram_reads: bool = False, on_evict: EvictCallback | None = None) -> None:
        if not isinstance(node, str) or not node:
            raise ValueError(f"node must be a non-empty str, got {node!r}")
        if not isinstance(dram, LocalKvStore):
            raise TypeError(f"dram must be a LocalKvStore, got {type(dram).__name__}")
        if dram.closed or len(dram):
            raise ValueError(f"dram must be a fresh, open LocalKvStore (DRAM does not survive a restart); got {dram!r}")
        if ssd is not None and not isinstance(ssd, SsdTier):
            raise TypeError(f"ssd must be an SsdTier or None, got {type(ssd).__name__}")
        gpu_capacity_blocks = check_int("gpu_capacity_blocks", gpu_capacity_blocks, 0)
        if index is not None and not isinstance(index, IndexBackend):
            raise TypeError(f"index must be an IndexBackend or None, got {type(index).__name__}")
        if on_evict is not None and not callable(on_evict):
            raise TypeError(f"on_evict must be callable or None, got {type(on_evict).__name__}")
        if verify_dram_reads and not dram.config.checksum:
            raise ValueError("verify_dram_reads=True needs a LocalKvStore created with checksum=True")
        options = dict(policy_options or {})
        self._policies: dict[CacheTier, EvictionPolicy] = {t: make_policy(policy, **options) for t in (GPU, DRAM, SSD)}
        self.node = node
        self.policy_name = policy
        self._dram = dram
        self._ssd = ssd
        self._index = index
        self._holds = HoldTable(clock, soft_pin_ttl_s=soft_pin_ttl_s)
        self._verify = bool(verify_dram_reads)
        self._stats = DataPlaneStats()
        self._placement = Placement(node, dram=dram, ssd=ssd, gpu_capacity_blocks=gpu_capacity_blocks, index=index,
                                    policies=self._policies, holds=self._holds, stats=self._stats, on_evict=on_evict)
        self._lock = threading.RLock()
        self._closed = False
        self._placement.recover()  # opening is recovery (module docstring)

    @property
    def gpu_capacity_blocks(self) -> int:
        """GPU KV capacity of this node's engine, in blocks (0: no GPU tier)."""
        return self._placement.gpu_capacity_blocks

    def residency(self) -> list[ResidencyEntry]:
        """What the index should hold for this node, computed from the tiers themselves."""
        with self._lock:
            return self._placement.residency()

    # ------------------------------------------------------------------ queries
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"data plane of node {self.node!r} is closed")

    def tiers_of(self, key: StoreKey) -> frozenset[CacheTier]:
        """Every tier holding the block (empty if none)."""
        _check_key(key)
        with self._lock:
            self._check_open()
            return self._placement.tiers_of(key)

    def tier_of(self, key: StoreKey) -> CacheTier:
        """The fastest tier holding the block; BlockNotFoundError if none does."""
        tiers = self.tiers_of(key)
        if not tiers:
            raise BlockNotFoundError(f"block {key.hex()} is not on node {self.node!r}")
        return min(tiers)

    def keys(self) -> Iterator[StoreKey]:
        """Every block on the node (any tier), each once."""
        with self._lock:
            return self._placement.keys()

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._placement

    def __iter__(self) -> Iterator[StoreKey]:
        return self.keys()

    def __len__(self) -> int:
        return sum(1 for _ in self.keys())

    def stats(self) -> DataPlaneStats:
        with self._lock:
            return DataPlaneStats(**self._stats.as_dict())

    def policy(self, tier: CacheTier) -> EvictionPolicy:
        """The eviction policy instance of one tier (read it, do not drive it)."""
        return self._policies[_check_tier(tier)]

    @property
    def dram(self) -> LocalKvStore:
        return self._dram

    @property
    def ssd(self) -> SsdTier | None:
        return self._ssd

    def touch(self, key: StoreKey, tier: CacheTier | None = None) -> CacheTier:
        """Record a hit on ``key`` in ``tier`` (default: the fastest tier holding it) without moving
        any bytes, e.g. an engine reusing a block it holds on its GPU. Returns the tier touched;
        BlockNotFoundError if the key is not in that tier."""
        with self._lock:
            key = self._require(key)
            held = self.tiers_of(key)
            tier = min(held) if tier is None else _check_tier(tier)
            if tier not in held:
                raise BlockNotFoundError(f"block {key.hex()} is not in the {tier.name} tier of node {self.node!r}")
            self._policies[tier].touch(key)
            return tier

    def begin_request(self, keys: Sequence[StoreKey], num_hit: int, *, tier: CacheTier = GPU,
                      input_tokens: int | None = None) -> None:
        """Tell ``tier``'s policy which request's blocks come next, in order, and how many leading
        ones were prefix hits (QuillHD and the length-aware policy learn from it; other policies
        take no hints and this does nothing). Changes no residency."""
        with self._lock:
            self._check_open()
            hint = getattr(self._policies[_check_tier(tier)], "begin_request", None)
            if hint is not None:
                hint([_check_key(k) for k in keys], num_hit, input_tokens)

    # ------------------------------------------------------------------ pins and leases
    def pin(self, key: StoreKey, hard: bool = True) -> None:
        """Pin a block on this node: hard pins count up, a soft pin lasts ``soft_pin_ttl_s``."""
        with self._lock:
            self._require(key)
            self._holds.pin(key, hard=bool(hard))

    def unpin(self, key: StoreKey, hard: bool = True) -> None:
        with self._lock:
            self._require(key)
            self._holds.unpin(key, hard=bool(hard))

    def lease(self, key: StoreKey, ttl_s: float) -> float:
        """Read lease: ``lease_end = max(old, now + ttl_s)``; returns lease_end."""
        with self._lock:
            self._require(key)
            return self._holds.lease(key, ttl_s)

    def in_use_reason(self, key: StoreKey) -> str | None:
        with self._lock:
            return self._holds.in_use_reason(_check_key(key))

    def _require(self, key: object) -> StoreKey:
        self._check_open()
        key = _check_key(key)
        if key not in self._placement:
            raise BlockNotFoundError(f"block {key.hex()} is not on node {self.node!r}")
        return key

    def _refuse_if_in_use(self, key: StoreKey, action: str) -> None:
        why = self._holds.in_use_reason(key)
        if why is not None:
            raise BlockInUseError(f"cannot {action} block {key.hex()} on node {self.node!r}: it is {why}")

    # ------------------------------------------------------------------ public operations
    def put(self, key: StoreKey, data: object, *, tier: CacheTier = DRAM) -> CacheTier | None:
        """Store a block in ``tier``; returns where it went, or None if the policies refused it.

        DRAM (default) or SSD store the bytes; a DRAM admission refusal falls through to SSD.
        GPU records that the engine holds the block (``data`` is its bytes or just its size as an
        int; only the size is kept). Errors: TypeError/ValueError, BlockExistsError (the bytes
        are already on this node, or the GPU already holds it), BlockTooLargeError,
        StoreFullError (nothing changed)."""
        key = _check_key(key)
        tier = _check_tier(tier)
        with self._lock:
            self._check_open()
            if tier == GPU:
                if isinstance(data, int) and not isinstance(data, bool):
                    if data <= 0:
                        raise ValueError(f"GPU block size {data} must be positive")
                    size = data
                else:
                    size = as_byte_view(data).nbytes
                placed = self._placement.hold_gpu(key, size)
                self._stats.puts_gpu += placed is not None
                return placed
            view = as_byte_view(data)
            size = view.nbytes
            where = self._placement.byte_tier(key)
            if where is not None:
                raise BlockExistsError(f"block {key.hex()} is already stored in {where.name} on node {self.node!r}")
            if tier == SSD and self._ssd is None:
                raise ValueError(f"node {self.node!r} has no SSD tier")
            if size > self._dram.max_block_bytes and tier == DRAM:
                raise BlockTooLargeError(f"block {key.hex()} is {size} bytes; DRAM on node {self.node!r} holds "
                                         f"blocks of at most {self._dram.max_block_bytes} bytes")
            return self._placement.store(key, view, tier)

    def get(self, key: StoreKey, *, lease_ttl_s: float | None = None) -> memoryview | bytes:
        """The block's bytes: a zero-copy read-only view on a DRAM hit, ``bytes`` on an SSD hit
        (promoted to DRAM when room can be made). ``lease_ttl_s`` grants a read lease first.
        BlockNotFoundError if no bytes are on this node (GPU-only blocks included)."""
        key = _check_key(key)
        if lease_ttl_s is not None:
            check_ttl(lease_ttl_s, "lease_ttl_s")
        with self._lock:
            self._check_open()
            st = self._stats
            if key in self._dram:
                try:
                    view = self._dram.get(key, verify=self._verify)
                except CorruptBlockError:
                    self._placement.drop_corrupt(key, DRAM)
                    raise
                if lease_ttl_s is not None:
                    self._holds.lease(key, lease_ttl_s)
                self._policies[DRAM].touch(key)
                st.dram_hits += 1
                st.bytes_read_dram += view.nbytes
                return view
            st.dram_misses += 1
            if self._ssd is None or key not in self._ssd:
                if self._ssd is not None:
                    st.ssd_misses += 1
                gpu_only = self._placement.in_gpu(key)
                where = " (held only in GPU by the engine: no bytes on this node)" if gpu_only else ""
                raise BlockNotFoundError(f"block {key.hex()} is not stored on node {self.node!r}{where}")
            if lease_ttl_s is not None:
                self._holds.lease(key, lease_ttl_s)
            st.ssd_hits += 1
            data = self._placement.promote_ssd_to_dram(key, required=False)
            st.bytes_read_ssd += len(data)
            return data

    def promote(self, key: StoreKey) -> CacheTier:
        """Move a block up one tier: SSD bytes → DRAM, or DRAM → GPU hold. Returns the new tier.
        ValueError if it is already as high as it can go; StoreFullError (nothing changed) if
        no room can be made; TierUnhealthyError (nothing changed) for SSD bytes on an unhealthy tier."""
        with self._lock:
            key = self._require(key)
            where = self._placement.byte_tier(key)
            if where == SSD:
                self._placement.promote_ssd_to_dram(key, required=True)
                return DRAM
            if where == DRAM and not self._placement.in_gpu(key) and self.gpu_capacity_blocks:
                if self._placement.hold_gpu(key, self._dram.size_of(key)) is None:
                    raise StoreFullError(f"the GPU policy of node {self.node!r} refused to admit block {key.hex()}")
                self._stats.promotions_dram_to_gpu += 1
                return GPU
            raise ValueError(f"block {key.hex()} on node {self.node!r} is already in its highest tier "
                             f"({', '.join(t.name for t in sorted(self.tiers_of(key)))})")

    def demote(self, key: StoreKey) -> CacheTier | None:
        """Move a block down one tier: a GPU hold is released (the bytes stay where they are),
        DRAM bytes move to SSD. Returns the block's tier afterwards (None if a GPU-only block
        left the node). BlockInUseError if pinned or leased; ValueError if it is in the lowest
        tier; StoreFullError / DiskFullError / TierUnhealthyError (nothing changed) if SSD has no
        room, its disk is full or it is unhealthy; CorruptBlockError if the DRAM bytes fail their
        crc32c (DRAM store with ``checksum=True``): the block is then dropped from the node."""
        with self._lock:
            key = self._require(key)
            self._refuse_if_in_use(key, "demote")
            if self._placement.in_gpu(key):
                self._placement.release_gpu(key, pressure=False)
                return self._placement.byte_tier(key)
            if key in self._dram and self._ssd is not None:
                self._placement.demote_dram_to_ssd(key, required=True)
                return SSD
            raise ValueError(f"block {key.hex()} on node {self.node!r} is already in its lowest tier "
                             f"({self.tier_of(key).name})")

    def delete(self, key: StoreKey) -> None:
        """Remove the block from every tier of this node. BlockInUseError if pinned or leased;
        TierUnhealthyError (nothing changed) if its bytes are on an unhealthy SSD tier."""
        with self._lock:
            key = self._require(key)
            self._refuse_if_in_use(key, "delete")
            self._placement.delete(key)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the SSD tier (committing what is pending) and release DRAM; the index stays
        open (it is shared) but gets a flush. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._ssd is not None:
                    self._ssd.close()
            finally:
                self._dram.close()
                if self._index is not None:
                    self._index.flush()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        gpu = f"{self._placement.num_gpu_blocks}/{self.gpu_capacity_blocks}"
        return (f"StoreDataPlane({self.node!r}, gpu={gpu} blocks, "
                f"dram={self._dram!r}, ssd={self._ssd!r}, policy={self.policy_name!r})")
