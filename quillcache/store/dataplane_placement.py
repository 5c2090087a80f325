"""Moving one node's blocks between its tiers: ``Placement``, the data plane's placement component.

A ``Placement`` is given, in its constructor, everything it moves bytes between and reports to:
the node's DRAM store, its SSD tier (or None), the GPU capacity in blocks, the residency index
(or None), one eviction policy per tier, the pin/lease table and the counters. It owns the GPU
hold table (accounting only: key -> size in bytes) and the set of keys being moved.
``quillcache.store.dataplane.StoreDataPlane`` holds one and calls only its public methods; it
does the input validation and locking, so nothing here validates or locks.

Every operation keeps the residency invariants stated in ``quillcache.store.dataplane``:

- each move between tiers is written once: ``demote_dram_to_ssd`` (used by the public demotion
  and by DRAM pressure eviction), ``promote_ssd_to_dram`` (used by the public promotion and by an
  SSD read hit), ``release_gpu`` (used by the public demotion, deletion and GPU pressure);
- a placement first tries the tier; only when the tier reports ``StoreFullError`` does it plan
  victims (``_plan``: policy order, skipping pinned, leased and protected keys, soft-pinned keys
  only in a second pass) whose footprints cover the need. If no plan exists, nothing has been
  changed yet and the placement fails; otherwise the victims are evicted and the placement
  retried (more victims are planned if the free space stayed fragmented). A ``DiskFullError`` (the
  file system under the SSD tier is full) is not a capacity shortage: no victim is evicted for it;
- bytes leave DRAM for SSD only after they pass their DRAM crc32c (when the DRAM store keeps
  checksums): a block that fails is dropped as corrupt, never copied under a fresh SSD crc;
- nothing is moved into or out of an unhealthy SSD tier (it refuses writes and deletes): an SSD
  hit is then served without promotion, and a delete of a block with SSD bytes is refused before
  anything changes;
- a DRAM victim is demoted to SSD when the SSD tier is healthy, its policy admits the block and
  SSD room can be made (which may evict SSD victims), else dropped from the node (also when the
  disk is full or the tier turns unhealthy during the demotion); an SSD victim is dropped; a GPU
  victim loses its GPU hold;
- a residency change is reported to the index as soon as it happens: a new location is put
  before the old one is removed, and an SSD entry is removed before the SSD bytes are deleted
  (``quillcache.store.reconcile``'s order), so a crash leaves at worst entries that reconcile fixes;
- keys being moved by the operation in progress are never chosen as victims;
- a tier's policy learns ``evict`` for a pressure eviction and ``remove`` for any other departure;
- ``on_evict(key, tier)`` is told of every pressure victim that leaves its tier without being moved: a
  dropped DRAM victim (also one dropped because its bytes failed their crc32c when it was to be
  demoted; counted in ``corrupt_blocks``, not ``evictions_dram``), an SSD victim, a released GPU hold.
  A corrupt block found by an operation the caller asked for (read, promotion, demotion) is reported to
  that caller by its ``CorruptBlockError`` instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

from quillcache.index import IndexBackend, ReplicaKey, ResidencyEntry
from quillcache.policies import EvictionPolicy
from quillcache.store.dram import LocalKvStore
from quillcache.store.errors import (
    BlockExistsError,
    BlockTooLargeError,
    CorruptBlockError,
    DiskFullError,
    StoreFullError,
    TierUnhealthyError,
)
from quillcache.store.keys import StoreKey
from quillcache.store.leases import HoldTable
from quillcache.store.reconcile import reconcile_index
from quillcache.store.ssd import SsdTier
from quillcache.types import CacheTier

__all__ = ["DataPlaneStats", "EvictCallback", "Placement"]

GPU, DRAM, SSD = CacheTier.GPU, CacheTier.DRAM, CacheTier.SSD
EvictCallback = Callable[[StoreKey, CacheTier], None]


@dataclass(slots=True)
class DataPlaneStats:
    """Counters since the data plane was opened (``StoreDataPlane.stats()`` returns a copy)."""

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


class Placement:
    """The tier moves, victim planning and index reporting of one node (module docstring)."""

    def __init__(self, node: str, *, dram: LocalKvStore, ssd: SsdTier | None, gpu_capacity_blocks: int,
                 index: IndexBackend | None, policies: dict[CacheTier, EvictionPolicy], holds: HoldTable,
                 stats: DataPlaneStats, on_evict: EvictCallback | None) -> None:
        assert set(policies) == {GPU, DRAM, SSD}, "one policy per tier"
        self.node = node
        self.gpu_capacity_blocks = gpu_capacity_blocks
        self._dram = dram
        self._ssd = ssd
        self._index = index
        self._policies = policies
        self._holds = holds
        self._stats = stats
        self._on_evict = on_evict
        self._verify_demotions = dram.config.checksum  # DRAM crcs exist: check them before bytes go to SSD
        self._gpu: dict[StoreKey, int] = {}  # GPU-held key -> size_bytes
        self._protected: set[StoreKey] = set()  # keys the operation in progress is moving

    # ------------------------------------------------------------------ residency
    def __contains__(self, key: object) -> bool:
        return key in self._gpu or key in self._dram or (self._ssd is not None and key in self._ssd)

    def in_gpu(self, key: StoreKey) -> bool:
        return key in self._gpu

    def gpu_keys(self) -> list[StoreKey]:
        """The GPU-held keys, in the order they were held."""
        return list(self._gpu)

    @property
    def num_gpu_blocks(self) -> int:
        return len(self._gpu)

    def byte_tier(self, key: StoreKey) -> CacheTier | None:
        """The tier holding the block's bytes (DRAM or SSD; they are exclusive), or None."""
        if key in self._dram:
            return DRAM
        if self._ssd is not None and key in self._ssd:
            return SSD
        return None

    def tiers_of(self, key: StoreKey) -> frozenset[CacheTier]:
        return frozenset(t for t, held in ((GPU, key in self._gpu), (DRAM, key in self._dram),
                                           (SSD, self._ssd is not None and key in self._ssd)) if held)

    def keys(self) -> Iterator[StoreKey]:
        """Every block on the node (any tier), each once."""
        seen = dict.fromkeys(self._gpu)
        seen.update(dict.fromkeys(self._dram.keys()))
        if self._ssd is not None:
            seen.update(dict.fromkeys(self._ssd.keys()))
        return iter(list(seen))

    def residency(self) -> list[ResidencyEntry]:
        """What the index should hold for this node, computed from the tiers themselves."""
        out = [self._entry(k, GPU) for k in self._gpu]
        out += [self._entry(k, DRAM) for k in self._dram]
        if self._ssd is not None:
            out += [self._entry(k, SSD) for k in self._ssd.keys()]  # noqa: SIM118 (SsdTier is not iterable)
        return out

    def recover(self) -> None:
        """Opening is recovery: DRAM and GPU hold nothing after a restart, so every GPU/DRAM entry of
        this node (and every SSD entry when there is no SSD tier) leaves the index; the SSD tier's
        recovered blocks enter the SSD policy and the index is reconciled against them."""
        if self._index is not None:
            gone = (GPU, DRAM) if self._ssd is not None else (GPU, DRAM, SSD)
            stale = [e.key for e in self._index.entries_on_node(self.node) if e.tier in gone]
            self._index.remove(stale)
        if self._ssd is not None:
            live = self._ssd.locations()
            for key, (_, _, size) in live.items():
                self._policies[SSD].insert(key, size)
            if self._index is not None:
                reconcile_index(self._index, self.node, SSD, live)

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
        assert self._ssd is not None
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

    # ------------------------------------------------------------------ making room
    def _place(self, tier: CacheTier, key: StoreKey, data: memoryview, *, required: bool) -> bool:
        """Put the bytes in DRAM or SSD, evicting that tier's victims for room while ``key`` is
        protected. False (or the error when ``required``) if no room can be made."""
        store = self._dram if tier == DRAM else self._ssd
        assert store is not None
        evict = self._evict_from_dram if tier == DRAM else self._evict_from_ssd
        size = data.nbytes
        changed = False
        self._protected.add(key)
        try:
            while True:
                try:
                    store.put(key, data)
                    return True
                except BlockTooLargeError:
                    if required:
                        raise
                    return False
                except DiskFullError as exc:  # evicting blocks frees no disk space (DiskFullError)
                    if required:
                        after = " (blocks evicted for capacity before stay evicted)" if changed else ""
                        raise DiskFullError(f"block {key.hex()} ({size} bytes) was not stored in {tier.name} on node "
                                            f"{self.node!r}: {exc}; no block was evicted for it{after}") from exc
                    return False
                except StoreFullError as exc:
                    plan = self._plan(tier, self._footprint(tier, size), store.free_bytes)
                    if plan is None:
                        if required:
                            raise self._full_error(tier, key, size, changed) from exc
                        return False
                for victim in plan:
                    evict(victim)
                changed = True
        finally:
            self._protected.discard(key)

    def _evict_from_dram(self, key: StoreKey) -> None:
        """Pressure eviction of a DRAM block: demote it to SSD if possible, else drop it (module
        docstring); a block whose DRAM bytes fail their crc32c is dropped as corrupt."""
        size = self._dram.size_of(key)
        if self._ssd is not None and self._ssd.healthy and self._policies[SSD].admit(key, size):
            try:
                if self.demote_dram_to_ssd(key, required=False, pressure=True):
                    return
            except CorruptBlockError:  # already dropped everywhere (drop_corrupt, counted there): its room
                self._notify_evict(key, DRAM)  # is freed; the victim left the node, like any dropped one
                return
            except TierUnhealthyError:
                pass  # the SSD tier failed during the demotion (nothing of this block changed): drop it
        self._policies[DRAM].evict(key)
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
        self._notify_evict(key, tier)

    def _notify_evict(self, key: StoreKey, tier: CacheTier) -> None:
        if self._on_evict is not None:
            try:
                self._on_evict(key, tier)
            except Exception as exc:  # noqa: BLE001 - a listener must not break an eviction half-way
                warnings.warn(f"on_evict({key.hex()}, {tier.name}) raised {exc!r}", RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------ the moves (each written once)
    def store(self, key: StoreKey, data: memoryview, tier: CacheTier) -> CacheTier | None:
        """Store new bytes in ``tier`` (DRAM or SSD; the caller checked they are not on the node).
        A DRAM admission refusal falls through to SSD; None if the policies refused the block.
        StoreFullError (nothing changed) if no room can be made."""
        size = data.nbytes
        if tier == DRAM and not self._policies[DRAM].admit(key, size):
            if self._ssd is None:
                self._stats.admission_refusals += 1
                return None
            tier = SSD
        if tier == SSD and not self._policies[SSD].admit(key, size):
            self._stats.admission_refusals += 1
            return None
        self._place(tier, key, data, required=True)
        self._policies[tier].insert(key, size)
        self._report_put(key, tier)
        if tier == DRAM:
            self._stats.puts_dram += 1
            self._stats.bytes_put_dram += size
        else:
            self._stats.puts_ssd += 1
            self._stats.bytes_put_ssd += size
        return tier

    def hold_gpu(self, key: StoreKey, size: int) -> CacheTier | None:
        """Record that the engine holds the block in GPU memory, releasing the GPU policy's victim
        when full. None if the GPU policy refused it; StoreFullError (nothing changed) if every
        GPU block is in use."""
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
            self.release_gpu(plan[0], pressure=True)
        self._gpu[key] = size
        pol.insert(key, size)
        self._report_put(key, GPU)
        return GPU

    def release_gpu(self, key: StoreKey, *, pressure: bool) -> None:
        """The engine no longer holds the block in GPU memory (its bytes stay where they are).
        ``pressure``: a GPU eviction (counted and reported to ``on_evict``), else a release."""
        pol = self._policies[GPU]
        pol.evict(key) if pressure else pol.remove(key)
        self._report_remove(key, GPU)
        del self._gpu[key]
        if pressure:
            self._dropped(key, GPU, 0)
        else:
            self._stats.gpu_releases += 1
            self._forget_if_gone(key)

    def demote_dram_to_ssd(self, key: StoreKey, *, required: bool, pressure: bool = False) -> bool:
        """Move a block's bytes from DRAM to SSD, evicting SSD victims for room. False (or
        StoreFullError / DiskFullError when ``required``; nothing of this block changed) if no room
        can be made; TierUnhealthyError (nothing of this block changed) from an unhealthy SSD tier.
        CorruptBlockError if the DRAM bytes fail their crc32c (checked whenever the DRAM store keeps
        checksums): the block is then dropped everywhere and nothing is written to SSD.
        ``pressure``: the move is a DRAM eviction (the DRAM policy learns ``evict``)."""
        assert self._ssd is not None
        size = self._dram.size_of(key)
        try:
            data = self._dram.get(key, verify=self._verify_demotions)
        except CorruptBlockError:
            self.drop_corrupt(key, DRAM)
            raise
        if not self._place(SSD, key, data, required=required):
            return False
        pol = self._policies[DRAM]
        pol.evict(key) if pressure else pol.remove(key)
        self._policies[SSD].insert(key, size)
        self._report_put(key, SSD)
        self._report_remove(key, DRAM)
        self._dram.delete(key)
        self._stats.demotions_dram_to_ssd += 1
        self._stats.bytes_dram_to_ssd += size
        return True

    def promote_ssd_to_dram(self, key: StoreKey, *, required: bool) -> bytes:
        """Read a block from SSD and move its bytes to DRAM, evicting DRAM victims for room; returns
        the bytes. Not ``required`` (a read hit): when the DRAM policy refuses it or no room can be
        made, or the SSD tier is or turns unhealthy (its copy could not be deleted), the bytes stay on SSD
        (counted in ``promotions_skipped``). ``required``: BlockTooLargeError / StoreFullError /
        TierUnhealthyError instead (the block unchanged on SSD; DRAM victims evicted for it stay evicted).
        CorruptBlockError if the SSD copy failed its check (the block is then forgotten everywhere)."""
        assert self._ssd is not None
        unhealthy = not self._ssd.healthy
        if required and unhealthy:
            raise TierUnhealthyError(f"cannot promote block {key.hex()} on node {self.node!r}: the SSD tier "
                                     f"{self._ssd.directory} is unhealthy and refuses deletes; nothing was changed")
        try:
            data = self._ssd.get(key)
        except CorruptBlockError:
            self.drop_corrupt(key, SSD)
            raise
        size = len(data)
        too_large = size > self._dram.max_block_bytes
        if not required and (unhealthy or too_large or not self._policies[DRAM].admit(key, size)):
            moved = False
        else:
            if too_large:
                raise BlockTooLargeError(f"block {key.hex()} ({size} bytes) is larger than any DRAM segment "
                                         f"({self._dram.max_block_bytes} bytes)")
            moved = self._place(DRAM, key, memoryview(data), required=required)
            if moved and not self._ssd.healthy:  # a victim's demotion turned the tier unhealthy: the SSD copy
                self._dram.delete(key)  # cannot be deleted, so the DRAM copy goes (one tier per block)
                moved = False
                if required:
                    raise TierUnhealthyError(f"cannot promote block {key.hex()} on node {self.node!r}: the SSD "
                                             f"tier {self._ssd.directory} turned unhealthy while DRAM room was "
                                             f"made; the block stays on SSD")
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

    def delete(self, key: StoreKey) -> None:
        """Remove the block from every tier of this node (the caller checked it is not in use).
        TierUnhealthyError, before anything changes, if its bytes are on an unhealthy SSD tier."""
        if self._ssd is not None and key in self._ssd and not self._ssd.healthy:
            raise TierUnhealthyError(f"cannot delete block {key.hex()} on node {self.node!r}: its bytes are on the "
                                     f"SSD tier {self._ssd.directory}, which is unhealthy and refuses deletes; "
                                     f"nothing was changed")
        if key in self._gpu:
            self._policies[GPU].remove(key)
            self._report_remove(key, GPU)
            del self._gpu[key]
        if key in self._dram:
            self._policies[DRAM].remove(key)
            self._report_remove(key, DRAM)
            self._dram.delete(key)
        if self._ssd is not None and key in self._ssd:
            self._policies[SSD].remove(key)
            self._report_remove(key, SSD)
            self._ssd.delete(key)
        self._holds.forget(key)

    def drop_corrupt(self, key: StoreKey, tier: CacheTier) -> None:
        """The tier already dropped a block that failed its crc32c: forget it everywhere else."""
        self._stats.corrupt_blocks += 1
        self._policies[tier].remove(key)
        self._report_remove(key, tier)
        self._forget_if_gone(key)
