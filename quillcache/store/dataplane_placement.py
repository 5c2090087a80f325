"""Placement, planning and eviction machinery of the tiered data plane (``StoreDataPlane``).

``TierPlacement`` holds the internal operations that move bytes between tiers and keep the
policies, the index and the counters in step; ``quillcache.store.dataplane.StoreDataPlane`` is
the public facade built on it and sets every attribute annotated below. Each operation here keeps
the residency invariants stated in ``quillcache.store.dataplane``:

- a placement first tries the tier; only when the tier reports ``StoreFullError`` does it plan
  victims (``_plan``: policy order, skipping pinned, leased and protected keys, soft-pinned keys
  only in a second pass) whose footprints cover the need. If no plan exists, nothing has been
  changed yet and the placement fails; otherwise the victims are evicted and the placement
  retried (more victims are planned if the free space stayed fragmented);
- a DRAM victim is demoted to SSD when the SSD policy admits it and SSD room can be made (which
  may evict SSD victims), else dropped from the node; an SSD victim is dropped; a GPU victim
  loses its GPU hold;
- a residency change is reported to the index as soon as it happens: a new location is put
  before the old one is removed, and an SSD entry is removed before the SSD bytes are deleted
  (``quillcache.store.reconcile``'s order), so a crash leaves at worst entries that reconcile fixes;
- keys in ``_protected`` (being moved by the operation in progress) are never chosen as victims.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

from quillcache.index import IndexBackend, ReplicaKey, ResidencyEntry
from quillcache.policies import EvictionPolicy
from quillcache.store.dram import LocalKvStore
from quillcache.store.errors import (
    BlockExistsError,
    BlockTooLargeError,
    CorruptBlockError,
    StoreFullError,
)
from quillcache.store.keys import StoreKey
from quillcache.store.leases import HoldTable
from quillcache.store.ssd import SsdTier
from quillcache.types import CacheTier

__all__ = ["DataPlaneStats", "TierPlacement"]

GPU, DRAM, SSD = CacheTier.GPU, CacheTier.DRAM, CacheTier.SSD
EvictCallback = Callable[[StoreKey, CacheTier], None]


@dataclass(slots=True)
class DataPlaneStats:
    """Counters since the data plane was opened (``stats()`` returns a copy)."""

    dram_hits: int = 0
    dram_misses: int = 0
    ssd_hits: int = 0
    ssd_misses: int = 0
    puts_gpu: int = 0
    puts_dram: int = 0
    puts_ssd: int = 0
    admission_refusals: int = 0
    promotions_ssd_to_dram: int = 0
    promotions_skipped: int = 0  # SSD hits served without promotion (no room in DRAM)
    promotions_dram_to_gpu: int = 0
    demotions_dram_to_ssd: int = 0
    gpu_releases: int = 0
    evictions_gpu: int = 0
    evictions_dram: int = 0  # dropped from DRAM without an SSD copy
    evictions_ssd: int = 0
    corrupt_blocks: int = 0
    bytes_put_dram: int = 0
    bytes_put_ssd: int = 0
    bytes_read_dram: int = 0
    bytes_read_ssd: int = 0
    bytes_dram_to_ssd: int = 0
    bytes_ssd_to_dram: int = 0
    bytes_evicted: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class TierPlacement:
    """Internal base of ``StoreDataPlane``: tier moves, victim planning and index reporting."""

    node: str
    gpu_capacity_blocks: int
    _dram: LocalKvStore
    _ssd: SsdTier | None
    _gpu: dict[StoreKey, int]
    _index: IndexBackend | None
    _policies: dict[CacheTier, EvictionPolicy]
    _holds: HoldTable
    _on_evict: EvictCallback | None
    _protected: set[StoreKey]
    _stats: DataPlaneStats

    # ------------------------------------------------------------------ index reporting
    def _entry(self, key: StoreKey, tier: CacheTier) -> ResidencyEntry:
        if tier == GPU:
            seg, off, size = 0, 0, self._gpu[key]
        elif tier == DRAM:
            seg, off, size = self._dram.location_of(key)
        else:
            assert self._ssd is not None
            seg, off, size = self._ssd.location_of(key)
        return ResidencyEntry(key.block_hash, self.node, tier, key.identity, seg, off, size)

    def _report_put(self, key: StoreKey, tier: CacheTier) -> None:
        if self._index is not None:
            self._index.put([self._entry(key, tier)])

    def _report_remove(self, key: StoreKey, tier: CacheTier) -> None:
        if self._index is not None:
            self._index.remove([ReplicaKey(key.block_hash, self.node, tier, key.identity)])

    def _byte_tier(self, key: StoreKey) -> CacheTier | None:
        if key in self._dram:
            return DRAM
        if self._ssd is not None and key in self._ssd:
            return SSD
        return None

    def __contains__(self, key: object) -> bool:
        return key in self._gpu or key in self._dram or (self._ssd is not None and key in self._ssd)

    def _forget_if_gone(self, key: StoreKey) -> None:
        if key not in self:
            self._holds.forget(key)

    # ------------------------------------------------------------------ planning
    def _footprint(self, tier: CacheTier, size: int) -> int:
        """Bytes a block takes in a tier (GPU capacity is counted in blocks: 1)."""
        if tier == GPU:
            return 1
        if tier == DRAM:
            unit = self._dram.config.alignment_bytes
            return -(-size // unit) * unit
        return self._ssd.footprint_bytes(size)

    def _plan(self, tier: CacheTier, need_bytes: int, free_bytes: int) -> list[StoreKey] | None:
        """Victims whose eviction frees ``need_bytes`` (at least one victim), or None if even
        every evictable block would not do. First pass skips soft-pinned blocks."""
        pol = self._policies[tier]
        chosen: dict[StoreKey, None] = {}
        got = free_bytes
        holds, protected = self._holds, self._protected
        for allow_soft in (False, True):
            def ok(k: StoreKey, allow_soft: bool = allow_soft) -> bool:
                return k not in chosen and k not in protected and holds.evictable(k, allow_soft)

            while got < need_bytes or not chosen:
                v = pol.victim(ok)
                if v is None:
                    break
                chosen[v] = None
                got += self._footprint(tier, pol.size_of(v))
            if got >= need_bytes and chosen:
                return list(chosen)
        return None

    def _full_error(self, tier: CacheTier, key: StoreKey, size: int, changed: bool) -> StoreFullError:
        store = self._dram if tier == DRAM else self._ssd
        assert store is not None
        keys = list(self._policies[tier])
        in_use = sum(1 for k in keys if not self._holds.evictable(k, True) or k in self._protected)
        return StoreFullError(
            f"no room for block {key.hex()} ({size} bytes) in {tier.name} on node {self.node!r}: "
            f"{store.free_bytes} of {store.capacity_bytes} bytes free and evicting every block that may be "
            f"evicted would not make room ({in_use} of {len(keys)} blocks there are pinned, leased or being "
            f"moved); " + ("blocks evicted for room on the way stay evicted (the free space stayed fragmented)"
                           if changed else "nothing was changed")
        )

    # ------------------------------------------------------------------ placement (internal)
    def _place_dram(self, key: StoreKey, data: memoryview, *, required: bool) -> bool:
        """Put the bytes in DRAM, evicting DRAM victims for room. False (or StoreFullError when
        ``required``) if no room can be made."""
        size = data.nbytes
        changed = False
        while True:
            try:
                self._dram.put(key, data)
                return True
            except StoreFullError as exc:
                plan = self._plan(DRAM, self._footprint(DRAM, size), self._dram.free_bytes)
                if plan is None:
                    if required:
                        raise self._full_error(DRAM, key, size, changed) from exc
                    return False
            for victim in plan:
                self._evict_from_dram(victim)
            changed = True

    def _place_ssd(self, key: StoreKey, data: memoryview, *, required: bool) -> bool:
        """Put the bytes in SSD (durable), evicting SSD victims for room; like ``_place_dram``."""
        ssd = self._ssd
        assert ssd is not None
        size = data.nbytes
        changed = False
        while True:
            try:
                ssd.put(key, data)
                return True
            except BlockTooLargeError:
                if required:
                    raise
                return False
            except StoreFullError as exc:
                plan = self._plan(SSD, self._footprint(SSD, size), ssd.free_bytes)
                if plan is None:
                    if required:
                        raise self._full_error(SSD, key, size, changed) from exc
                    return False
            for victim in plan:
                self._evict_from_ssd(victim)
            changed = True

    def _evict_from_dram(self, key: StoreKey) -> None:
        """Pressure eviction of a DRAM block: demote it to SSD if possible, else drop it."""
        size = self._dram.size_of(key)
        ssd = self._ssd
        self._protected.add(key)
        try:
            moved = (ssd is not None and self._policies[SSD].admit(key, size)
                     and self._place_ssd(key, self._dram.get(key), required=False))
        finally:
            self._protected.discard(key)
        self._policies[DRAM].evict(key)
        if moved:
            self._policies[SSD].insert(key, size)
            self._report_put(key, SSD)
            self._report_remove(key, DRAM)
            self._dram.delete(key)
            self._stats.demotions_dram_to_ssd += 1
            self._stats.bytes_dram_to_ssd += size
            return
        self._report_remove(key, DRAM)
        self._dram.delete(key)
        self._dropped(key, DRAM, size)

    def _evict_from_ssd(self, key: StoreKey) -> None:
        assert self._ssd is not None
        size = self._ssd.size_of(key)
        self._policies[SSD].evict(key)
        self._report_remove(key, SSD)  # index first, then the block (SsdTier's delete contract)
        self._ssd.delete(key)
        self._dropped(key, SSD, size)

    def _dropped(self, key: StoreKey, tier: CacheTier, size: int) -> None:
        if tier == GPU:
            self._stats.evictions_gpu += 1
        elif tier == DRAM:
            self._stats.evictions_dram += 1
            self._stats.bytes_evicted += size
        else:
            self._stats.evictions_ssd += 1
            self._stats.bytes_evicted += size
        self._forget_if_gone(key)
        if self._on_evict is not None:
            try:
                self._on_evict(key, tier)
            except Exception as exc:  # noqa: BLE001 - a listener must not break an eviction half-way
                warnings.warn(f"on_evict({key.hex()}, {tier.name}) raised {exc!r}", RuntimeWarning, stacklevel=2)

    def _gpu_hold(self, key: StoreKey, size: int) -> CacheTier | None:
        if self.gpu_capacity_blocks == 0:
            raise ValueError(f"node {self.node!r} has no GPU tier (gpu_capacity_blocks=0)")
        if key in self._gpu:
            raise BlockExistsError(f"block {key.hex()} is already held in GPU on node {self.node!r}")
        pol = self._policies[GPU]
        if not pol.admit(key, size):
            self._stats.admission_refusals += 1
            return None
        if len(self._gpu) >= self.gpu_capacity_blocks:
            plan = self._plan(GPU, 1, 0)
            if plan is None:
                raise StoreFullError(
                    f"no room for block {key.hex()} in GPU on node {self.node!r}: all {len(self._gpu)} of "
                    f"{self.gpu_capacity_blocks} GPU blocks are pinned, leased or being moved; nothing was changed")
            victim = plan[0]
            pol.evict(victim)
            self._report_remove(victim, GPU)
            del self._gpu[victim]
            self._dropped(victim, GPU, 0)
        self._gpu[key] = size
        pol.insert(key, size)
        self._report_put(key, GPU)
        return GPU

    def _drop_corrupt(self, key: StoreKey, tier: CacheTier) -> None:
        """The tier already dropped a block that failed its crc32c: forget it everywhere else."""
        self._stats.corrupt_blocks += 1
        self._policies[tier].remove(key)
        self._report_remove(key, tier)
        self._forget_if_gone(key)

    def _promote_from_ssd(self, key: StoreKey, *, required: bool) -> bytes:
        assert self._ssd is not None
        try:
            data = self._ssd.get(key)
        except CorruptBlockError:
            self._drop_corrupt(key, SSD)
            raise
        size = len(data)
        if not required and (size > self._dram.max_block_bytes or not self._policies[DRAM].admit(key, size)):
            moved = False
        else:
            if size > self._dram.max_block_bytes:
                raise BlockTooLargeError(f"block {key.hex()} ({size} bytes) is larger than any DRAM segment "
                                         f"({self._dram.max_block_bytes} bytes)")
            self._protected.add(key)
            try:
                moved = self._place_dram(key, memoryview(data), required=required)
            finally:
                self._protected.discard(key)
        if not moved:
            self._policies[SSD].touch(key)
            self._stats.promotions_skipped += 1
            return data
        self._policies[SSD].remove(key)
        self._policies[DRAM].insert(key, size)
        self._report_put(key, DRAM)
        self._report_remove(key, SSD)
        self._ssd.delete(key)
        self._stats.promotions_ssd_to_dram += 1
        self._stats.bytes_ssd_to_dram += size
        return data
