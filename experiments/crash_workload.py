"""The crash workloads, defined once: the crash study and the tests both drive these.

- Block content is derived from the key alone (:func:`block_content`), so anyone can check a read.
- :func:`tier_workload`: random ``put`` / ``put_many`` / ``put_async`` / ``delete`` / ``flush``
  through an :class:`~quillcache.store.ssd.SsdTier` on a given FileSystem; the ``acked`` dict
  gets every acknowledged block (``put``/``put_many`` returned, or the ``put_async`` callback fired
  without error) and loses a block as soon as its delete is *asked* (from then on it may or may
  not come back after a crash, but if it does it must be bit-exact), or once a check counted it
  lost or wrong (so a later round neither deletes it nor counts it again).
- :func:`tier_index_workload`: the SSD tier AND an on-disk ART index on the same FileSystem, in the
  order :mod:`quillcache.store.reconcile` prescribes: bytes durable first, then the index entry;
  on delete, the index entry removed and flushed first, then the bytes. ``IndexModel.index_acked``
  holds every index entry whose ``put`` a returned ``flush()`` covered and whose removal was not
  asked since.
- :func:`check_tier` / :func:`check_tier_index` reopen on the disk a crash left and *count*
  (never assume) what went wrong: acknowledged blocks lost, reads that returned wrong bytes,
  acknowledged index entries lost, and dangling index entries (an entry of this node whose block
  the tier does not hold at that location) before and after ``reconcile_index``. Each fault is
  counted once (:func:`forget_faults`), however many rounds a trial runs.

Shapes (:class:`TierShape`) are parameters, so a test runs the same workload smaller and faster.
"""

from __future__ import annotations

import os
import random
from collections.abc import Collection
from dataclasses import dataclass, field

from quillcache.durability.fs import FileSystem
from quillcache.index import IndexBackend, ResidencyEntry, open_index
from quillcache.store.errors import BlockNotFoundError, CorruptBlockError, StoreFullError
from quillcache.store.keys import StoreKey
from quillcache.store.reconcile import reconcile_index
from quillcache.store.ssd import SsdTier
from quillcache.types import CacheTier

NODE = "node-crash"
IDENTITY = b"\x42" * 16


def block_key(block_hash: int) -> StoreKey:
    return StoreKey(block_hash, IDENTITY)


def block_content(key: StoreKey, size_bytes: int) -> bytes:
    """The bytes of ``key`` when written ``size_bytes`` long. The size is part of the seed: a block cut
    short (or grown) is never the content of its own length, so a check against ``len(data)`` catches it
    (``randbytes(n)`` alone is a prefix of ``randbytes(m)`` whenever ``n`` is a multiple of 4)."""
    return random.Random(key.to_bytes() + size_bytes.to_bytes(8, "little")).randbytes(size_bytes)


@dataclass(frozen=True, kw_only=True)
class TierShape:
    """Sizes of one crash workload (tier geometry and the block sizes it draws)."""

    capacity_bytes: int
    slab_bytes: int
    log_rotate_bytes: int
    group_commit_blocks: int = 4
    max_put_bytes: int  # a single put draws 1..max_put_bytes
    max_batch_block_bytes: int  # each block of put_many / put_async draws 1..this
    max_batch_blocks: int  # put_many draws 1..this blocks
    # small, so that power losses also land inside index checkpoints
    index_checkpoint_min_wal_bytes: int = 1 << 10
    index_checkpoint_wal_ratio: float = 0.05

    def open_tier(self, fs: FileSystem, directory: str, layout: str | None = None, **kw) -> SsdTier:
        parent = os.path.dirname(directory.rstrip("/"))
        if parent not in ("", "/", ".") and not fs.exists(parent):  # the mount point, which an operator prepares
            fs.mkdir(parent)
        if layout is not None:
            kw["layout"] = layout
        return SsdTier(directory, capacity_bytes=self.capacity_bytes, fs=fs, slab_bytes=self.slab_bytes,
                       log_rotate_bytes=self.log_rotate_bytes, group_commit_blocks=self.group_commit_blocks, **kw)

    def open_index(self, fs: FileSystem, directory: str) -> IndexBackend:
        return open_index("art", directory, fs=fs, checkpoint_min_wal_bytes=self.index_checkpoint_min_wal_bytes,
                          checkpoint_wal_ratio=self.index_checkpoint_wal_ratio)


STUDY_SHAPE = TierShape(capacity_bytes=2 << 20, slab_bytes=512 << 10, log_rotate_bytes=8 << 10,
                        max_put_bytes=60_000, max_batch_block_bytes=20_000, max_batch_blocks=5)
TEST_SHAPE = TierShape(capacity_bytes=1 << 20, slab_bytes=256 << 10, log_rotate_bytes=4 << 10,
                       max_put_bytes=30_000, max_batch_block_bytes=9_000, max_batch_blocks=4)


# ------------------------------------------------------------------ the tier alone
def tier_workload(fs: FileSystem, layout: str, rng: random.Random, acked: dict[int, int], ops: int,
                  shape: TierShape, *, directory: str, first: int = 1) -> None:
    """``ops`` random operations, then ``close`` (a power loss may stop it anywhere)."""
    t = shape.open_tier(fs, directory, layout)
    nxt = first
    for _ in range(ops):
        r = rng.random()
        if r < 0.4:
            n = rng.randint(1, shape.max_put_bytes)
            try:
                t.put(block_key(nxt), block_content(block_key(nxt), n))
                acked[nxt] = n
            except StoreFullError:
                pass
            nxt += 1
        elif r < 0.55:
            items = {nxt + j: rng.randint(1, shape.max_batch_block_bytes)
                     for j in range(rng.randint(1, shape.max_batch_blocks))}
            nxt += len(items)
            try:
                t.put_many([(block_key(i), block_content(block_key(i), n)) for i, n in items.items()])
                acked.update(items)
            except StoreFullError:
                pass
        elif r < 0.7:
            n = rng.randint(1, shape.max_batch_block_bytes)

            def cb(k: StoreKey, err: BaseException | None, n: int = n) -> None:
                if err is None:
                    acked[k.block_hash] = n
            try:
                t.put_async(block_key(nxt), block_content(block_key(nxt), n), cb)
            except StoreFullError:
                pass
            nxt += 1
        elif r < 0.9 and acked:
            i = rng.choice(sorted(acked))
            del acked[i]  # once asked to delete, the block may or may not come back
            t.delete(block_key(i))
        else:
            t.flush()
    t.close()


@dataclass(frozen=True)
class TierFaults:
    """What one check of a tier found wrong: the keys, so that each fault is counted once."""

    lost: frozenset[int]  # acknowledged block hashes missing (or detected corrupt, so not served)
    corrupt: frozenset[StoreKey]  # keys whose read returned wrong bytes


def tier_faults(t: SsdTier, acked: dict[int, int], known: Collection[StoreKey] = ()) -> TierFaults:
    """Every acknowledged block must be present and bit-exact (at its acknowledged size); whatever
    else survived must be bit-exact too (at the length it came back with: :func:`block_content`
    depends on the size, so a block cut short does not pass). Each block is reported once; keys in
    ``known`` (wrong reads an earlier check of this tier already reported) are skipped."""
    lost: set[int] = set()
    corrupt: set[StoreKey] = set()
    for i, n in acked.items():
        k = block_key(i)
        if k in known:
            continue
        try:
            if t.get(k) != block_content(k, n):
                corrupt.add(k)
        except (BlockNotFoundError, CorruptBlockError):
            lost.add(i)
    for k in list(t.keys()):
        if k in known or (k.block_hash in acked and k.identity == IDENTITY):
            continue  # reported before, or checked above at its acknowledged size
        try:
            data = t.get(k)
        except CorruptBlockError:
            continue  # detected, not served
        if data != block_content(k, len(data)):
            corrupt.add(k)
    return TierFaults(frozenset(lost), frozenset(corrupt))


def count_tier(t: SsdTier, acked: dict[int, int], known: Collection[StoreKey] = ()) -> tuple[int, int]:
    """``(acknowledged blocks lost, reads that returned wrong bytes)``: :func:`tier_faults`, counted."""
    faults = tier_faults(t, acked, known)
    return len(faults.lost), len(faults.corrupt)


def forget_faults(faults: TierFaults, acked: dict[int, int], known: set[StoreKey]) -> None:
    """After ``faults`` were counted: the blocks found lost or wrong leave ``acked`` (a next round
    neither deletes nor expects them: deleting a lost block raises BlockNotFoundError, expecting it
    counts the same loss again) and the wrong reads join ``known`` (a next check skips them)."""
    for i in faults.lost:
        acked.pop(i, None)
    for k in faults.corrupt:
        if k.identity == IDENTITY:
            acked.pop(k.block_hash, None)
    known.update(faults.corrupt)


def check_tier(disk: FileSystem, layout: str, acked: dict[int, int], shape: TierShape, *,
               directory: str, known: set[StoreKey] | None = None) -> tuple[SsdTier, int, int]:
    """Reopen the tier on ``disk``: ``(tier, acknowledged blocks lost, wrong reads)``. Each fault is
    counted once: afterwards ``acked`` and ``known`` are as :func:`forget_faults` leaves them (pass
    the same ``known`` to every check of one tier)."""
    known = set() if known is None else known
    t = shape.open_tier(disk, directory, layout)
    faults = tier_faults(t, acked, known)
    forget_faults(faults, acked, known)
    return t, len(faults.lost), len(faults.corrupt)


# ------------------------------------------------------------------ the tier and its index
@dataclass
class IndexModel:
    """What the tier + index workload acknowledged so far (see the module docstring)."""

    acked: dict[int, int] = field(default_factory=dict)  # block hash -> size
    index_acked: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # hash -> (seg, off, size)
    next_hash: int = 1
    known_faults: set[StoreKey] = field(default_factory=set)  # wrong reads a check already counted


def _entry(key: StoreKey, loc: tuple[int, int, int]) -> ResidencyEntry:
    return ResidencyEntry(key.block_hash, NODE, CacheTier.SSD, key.identity, *loc)


def tier_index_workload(fs: FileSystem, layout: str, rng: random.Random, model: IndexModel, ops: int,
                        shape: TierShape, *, root: str) -> None:
    """``ops`` random puts / deletes / flushes through a tier at ``root/t`` and an ART index at
    ``root/ix`` on the same ``fs``, then ``close`` both (a power loss may stop it anywhere)."""
    tier = shape.open_tier(fs, f"{root}/t", layout)
    index = shape.open_index(fs, f"{root}/ix")
    live = sorted(tier.keys(), key=lambda k: k.block_hash)
    unflushed: dict[int, tuple[int, int, int]] = {}
    for _ in range(ops):
        r = rng.random()
        if r < 0.2 and live:
            key = live.pop(rng.randrange(len(live)))
            model.acked.pop(key.block_hash, None)  # asked to delete: may or may not come back
            model.index_acked.pop(key.block_hash, None)
            unflushed.pop(key.block_hash, None)
            index.remove([_entry(key, (0, 0, 0)).key])
            index.flush()  # the entry goes first ...
            tier.delete(key)  # ... then the bytes
        elif r < 0.3:
            index.flush()
            model.index_acked.update(unflushed)
            unflushed.clear()
        else:
            n = 1 if r < 0.75 else rng.randint(2, shape.max_batch_blocks)
            top = shape.max_put_bytes if n == 1 else shape.max_batch_block_bytes
            batch = [(block_key(model.next_hash + j), rng.randint(1, top)) for j in range(n)]
            model.next_hash += n
            data = [(k, block_content(k, size)) for k, size in batch]
            try:
                if n == 1:
                    tier.put(*data[0])
                else:
                    tier.put_many(data)
            except StoreFullError:
                continue
            model.acked.update((k.block_hash, size) for k, size in batch)
            locs = {k.block_hash: tier.location_of(k) for k, _ in batch}
            index.put([_entry(k, locs[k.block_hash]) for k, _ in batch])  # bytes durable, then the entry
            unflushed.update(locs)
            live.extend(k for k, _ in batch)
            if rng.random() < 0.3:
                index.flush()
                model.index_acked.update(unflushed)
                unflushed.clear()
    index.close()
    model.index_acked.update(unflushed)
    tier.close()


@dataclass(frozen=True)
class IndexCrashCheck:
    """What reopening tier + index after one power loss found (every field must be 0 but the
    informational ``dangling_before`` / ``reconcile_changes`` / ``recovered_blocks``)."""

    acked_lost: int
    corrupt_served: int
    index_acked_lost: int  # acknowledged index entries missing or different after reopen
    dangling_before: int  # entries pointing at missing/different bytes right after reopen
    dangling_after: int  # the same, after reconcile_index
    unindexed_after: int  # blocks the tier holds without an (exact) entry, after reconcile_index
    reconcile_changes: int
    recovered_blocks: int
    dropped_at_recovery: int


def _index_view(index: IndexBackend) -> dict[int, tuple[int, int, int]]:
    return {e.block_hash: (e.segment_id, e.offset_bytes, e.size_bytes)
            for e in index.entries_on_node(NODE) if e.tier == CacheTier.SSD}


def check_tier_index(disk: FileSystem, layout: str, model: IndexModel, shape: TierShape, *,
                     root: str) -> tuple[SsdTier, IndexBackend, IndexCrashCheck]:
    """Reopen tier and index on ``disk``, count, reconcile, count again. Afterwards the model
    holds what the reconciled (flushed) index holds, so a next round can build on it, and the
    blocks found lost or wrong are out of ``model.acked`` (:func:`forget_faults`)."""
    tier = shape.open_tier(disk, f"{root}/t", layout)
    faults = tier_faults(tier, model.acked, model.known_faults)
    forget_faults(faults, model.acked, model.known_faults)  # counted once
    lost, corrupt = len(faults.lost), len(faults.corrupt)
    index = shape.open_index(disk, f"{root}/ix")
    seen = _index_view(index)
    index_lost = sum(1 for h, loc in model.index_acked.items() if seen.get(h) != loc)
    live = {k.block_hash: loc for k, loc in tier.locations().items()}

    def dangling(view: dict[int, tuple[int, int, int]]) -> int:
        return sum(1 for h, loc in view.items() if live.get(h) != loc)

    before = dangling(seen)
    rep = reconcile_index(index, NODE, CacheTier.SSD, tier.locations())
    after_view = _index_view(index)
    unindexed = sum(1 for h, loc in live.items() if after_view.get(h) != loc)
    model.index_acked = dict(after_view)
    check = IndexCrashCheck(lost, corrupt, index_lost, before, dangling(after_view), unindexed, rep.changed,
                            len(tier), len(tier.recovery.dropped))
    return tier, index, check
