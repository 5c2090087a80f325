"""Regression tests for the store review of 2026-11-28: each test reproduces one finding through the public
API and checks the invariant the finding broke.

S1. a block that fits a DRAM segment but not the smaller last one is "store full" (and the data plane
    evicts for it), not a raw allocator error;
S2. ``SsdTier.put_many`` reuses the room of pending deletes (both layouts), as ``put`` does;
S3. a promotion whose DRAM room-making turns the SSD tier unhealthy leaves the block on SSD only;
S4. running out of file descriptors while staging is a refusal of that block, not an unhealthy tier;
S5. a slab larger than 512 MiB holds a one-page block in every page;
S6. after a failed group commit, ``flush()`` does not report its deletes durable;
S7. the accounting SSD layout refuses the blocks the slab layout refuses as too large.
"""

from __future__ import annotations

import errno
import random

import pytest

from quillcache.durability.crashfs import CrashFs
from quillcache.durability.fs import RealFs
from quillcache.index import open_index
from quillcache.store.dataplane import StoreDataPlane
from quillcache.store.dram import LocalKvStore
from quillcache.store.errors import BlockTooLargeError, StoreError, StoreFullError, TierUnhealthyError
from quillcache.store.keys import StoreKey
from quillcache.store.ssd import SsdTier
from quillcache.types import CacheTier


def k(i: int) -> StoreKey:
    return StoreKey(i, bytes(16))


# --- S1 ---------------------------------------------------------------------------------------------------


def test_a_block_larger_than_the_last_dram_segment_is_store_full_when_the_others_are_full():
    s = LocalKvStore(6144, segment_bytes=4096, alignment_bytes=64)  # segments of 4096 and 2048 bytes
    s.put(k(1), b"a" * 4096)
    with pytest.raises(StoreFullError, match="no room for block"):
        s.put(k(2), b"b" * 3000)  # at most max_block_bytes (4096) but larger than the last segment
    assert s.used_bytes == 4096 and len(s) == 1
    s.put(k(3), b"c" * 2048)  # the last segment itself still serves what fits it
    s.delete(k(1))
    s.put(k(2), b"b" * 3000)  # and the freed first segment takes the larger one
    assert s.get(k(2)) == b"b" * 3000 and s.get(k(3)) == b"c" * 2048


def test_the_data_plane_evicts_to_place_a_block_larger_than_the_last_dram_segment():
    dp = StoreDataPlane("n0", dram=LocalKvStore(6144, segment_bytes=4096))
    dp.put(k(1), b"a" * 4096)
    assert dp.put(k(2), b"b" * 3000) == CacheTier.DRAM  # the LRU block made way
    assert k(1) not in dp.dram and dp.get(k(2)) == b"b" * 3000


# --- S2 ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["slab", "files"])
def test_put_many_reuses_the_room_of_pending_deletes(tmp_path, layout):
    blk = b"x" * (8192 - 64 if layout == "files" else 8192)  # one 8 KiB footprint either way
    t = SsdTier(str(tmp_path / "t"), capacity_bytes=4 * 8192, layout=layout, slab_bytes=4 * 8192)
    try:
        for i in range(4):
            t.put(k(i), blk)
        t.delete(k(0))
        t.delete(k(1))
        assert t.free_bytes == 2 * 8192
        t.put_many([(k(10), blk), (k(11), blk)])
        assert sorted(x.block_hash for x in t.keys()) == [2, 3, 10, 11]
        with pytest.raises(StoreFullError):  # and a batch with no room is still refused whole
            t.put_many([(k(20), blk)])
        assert len(t) == 4
    finally:
        t.close()
    t2 = SsdTier(str(tmp_path / "t"), capacity_bytes=4 * 8192, layout=layout, slab_bytes=4 * 8192)
    try:
        assert sorted(x.block_hash for x in t2.keys()) == [2, 3, 10, 11] and t2.get(k(11)) == blk
    finally:
        t2.close()


# --- S3 ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("required", [False, True])
def test_a_promotion_that_turns_the_ssd_tier_unhealthy_leaves_the_block_on_ssd_only(required):
    fs = CrashFs()
    ssd = SsdTier("/t", capacity_bytes=1 << 20, fs=fs, slab_bytes=1 << 20)
    idx = open_index("flat")
    dp = StoreDataPlane("n0", dram=LocalKvStore(8192, segment_bytes=8192), ssd=ssd, index=idx)
    dp.put(k(1), b"A" * 4096)
    dp.demote(k(1))
    dp.put(k(2), b"B" * 4096)
    dp.put(k(3), b"C" * 4096)  # DRAM full: promoting A demotes a victim, and that commit fails
    fs.fail_next_fsync(1)
    if required:
        with pytest.raises(TierUnhealthyError, match="stays on SSD"):
            dp.promote(k(1))
    else:
        assert dp.get(k(1)) == b"A" * 4096  # a read hit is served from the unhealthy tier
    assert not ssd.healthy
    assert k(1) in ssd and k(1) not in dp.dram  # one tier per block
    assert [t for t in dp.tiers_of(k(1))] == [CacheTier.SSD]
    assert [e.tier for e in idx.entries_on_node("n0") if e.block_hash == 1] == [CacheTier.SSD]
    assert k(1) in set(dp.policy(CacheTier.SSD)) and k(1) not in set(dp.policy(CacheTier.DRAM))
    assert dp.get(k(1)) == b"A" * 4096  # and it stays readable


# --- S4 ---------------------------------------------------------------------------------------------------


class _FdLimitedFs(RealFs):
    """The real disk with a small descriptor limit: ``open`` past ``limit`` open files raises EMFILE."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.open_fds = limit, set()

    def open(self, path: str, mode: str) -> int:
        if len(self.open_fds) >= self.limit:
            raise OSError(errno.EMFILE, "Too many open files", path)
        fd = super().open(path, mode)
        self.open_fds.add(fd)
        return fd

    def close(self, fd: int) -> None:
        super().close(fd)
        self.open_fds.discard(fd)


def test_out_of_descriptors_commits_pending_puts_instead_of_turning_the_tier_unhealthy(tmp_path):
    fs = _FdLimitedFs(limit=24)
    t = SsdTier(str(tmp_path / "t"), capacity_bytes=4 << 20, layout="files", group_commit_blocks=1000, fs=fs)
    done: list[tuple[StoreKey, object]] = []
    try:
        for i in range(100):  # the files layout holds one descriptor per pending block
            t.put_async(k(i), bytes([i]) * 4096, lambda key, err: done.append((key, err)))
        assert t.healthy and len(t) == 100
        t.flush()
        assert len(done) == 100 and all(err is None for _, err in done)
        with pytest.raises(StoreError, match="out of file descriptors"):  # a batch that cannot be staged at
            t.put_many([(k(1000 + i), b"y" * 4096) for i in range(40)])  # once is refused whole
        assert t.healthy and len(t) == 100
        t.put(k(2000), b"z")  # and the tier goes on
    finally:
        t.close()
    t2 = SsdTier(str(tmp_path / "t"), capacity_bytes=4 << 20, layout="files")
    try:
        assert len(t2) == 101 and t2.get(k(99)) == bytes([99]) * 4096
    finally:
        t2.close()


# --- S5 ---------------------------------------------------------------------------------------------------


def test_a_1_gib_slab_holds_a_one_page_block_in_more_than_half_its_pages(tmp_path):
    t = SsdTier(str(tmp_path / "t"), capacity_bytes=1 << 30, slab_bytes=1 << 30, verify_on_open=False)
    try:  # the node pool was capped at 2**17 nodes: at most 131,071 live blocks in a slab of 262,144 pages
        n = 0
        for _ in range(17):
            t.put_many([(k(n + i), b"x") for i in range(8192)])
            n += 8192
        assert len(t) == 139_264 and t.free_bytes == (262_144 - 139_264) * 4096
    finally:
        t.close()


# --- S6 ---------------------------------------------------------------------------------------------------


def test_flush_after_a_failed_commit_does_not_report_its_deletes_durable():
    fs = CrashFs()
    t = SsdTier("/t", capacity_bytes=1 << 20, fs=fs, slab_bytes=1 << 18)
    t.put(k(1), b"one" * 1000)
    t.delete(k(1))  # pending
    fs.fail_next_fsync(1)
    with pytest.raises(TierUnhealthyError):
        t.put(k(2), b"two" * 1000)  # its group commit carries the delete, and fails
    with pytest.raises(TierUnhealthyError):
        t.flush()  # the delete is not durable
    t.close()
    t2 = SsdTier("/t", capacity_bytes=1 << 20, fs=fs.crash(random.Random(0)), slab_bytes=1 << 18)
    assert k(1) in t2  # as the error said: the restart brought it back
    t2.close()


# --- S7 ---------------------------------------------------------------------------------------------------


def test_the_accounting_layout_refuses_blocks_larger_than_a_slab_like_the_slab_layout(tmp_path):
    real = SsdTier(str(tmp_path / "t"), capacity_bytes=64 << 10, slab_bytes=8192)
    acct = SsdTier(None, capacity_bytes=64 << 10, slab_bytes=8192, account_only=True)
    try:
        for t in (real, acct):
            with pytest.raises(BlockTooLargeError):
                t.put(k(1), b"x" * 12288)
            t.put(k(2), b"y" * 8192)
    finally:
        real.close()
        acct.close()
