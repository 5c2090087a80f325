"""Regression tests for the store review (s23): each test reproduces one finding through the public
API (and the CrashFs fault hooks) and checks the invariant the finding broke.

1. a demotion never copies DRAM bytes that fail their crc32c to SSD (explicit and pressure);
2. a full disk under the SSD tier is not a capacity shortage: no SSD block is evicted for it;
3. an unhealthy SSD tier keeps the data plane's residency invariants (read hits, DRAM pressure,
   promote, delete);
4. a log generation whose end-of-snapshot record was damaged still opens with every block;
5. put_async blocks pending when a write error turns the tier unhealthy get their callback, once;
6. a pending put_async block that fails its crc32c on read gets its callback and frees its space;
7. failed opens and failed directory fsyncs leave no file handle open;
9. a damaged log with no slab file opens empty (not refused);
10. a log rotation that fails after renaming its new generation loses no acknowledged put (second review D1);
11. a new slab whose directory fsync failed leaves no slab file behind (D2);
12. a DRAM pressure victim dropped as corrupt is reported to ``on_evict`` (R2).
"""

from __future__ import annotations

import copy
import errno
import random

import pytest

from quillcache.durability.crashfs import CrashFs
from quillcache.durability.wal import HEADER_BYTES, RECORD_HEADER_BYTES, WalWriter, scan
from quillcache.index import open_index
from quillcache.store.dataplane import StoreDataPlane
from quillcache.store.dram import LocalKvStore
from quillcache.store.errors import (
    CorruptBlockError,
    DiskFullError,
    SsdRecoveryError,
    StoreFullError,
    TierUnhealthyError,
)
from quillcache.store.keys import StoreKey
from quillcache.store.ssd import SsdTier
from quillcache.types import CacheTier

GPU, DRAM, SSD = CacheTier.GPU, CacheTier.DRAM, CacheTier.SSD
NODE = "n"


def K(h: int) -> StoreKey:
    return StoreKey(h, b"I" * 16)


def blob(h: int, n: int) -> bytes:
    return random.Random(h).randbytes(n)


@pytest.fixture
def index():
    idx = open_index("flat")
    try:
        yield idx
    finally:
        idx.close()


def assert_consistent(dp: StoreDataPlane, index) -> None:
    """Bytes exclusive between DRAM and SSD, each tier's policy tracks exactly its blocks, the
    index holds exactly what the tiers hold."""
    dram, ssd = set(dp.dram.keys()), set(dp.ssd.keys()) if dp.ssd is not None else set()
    assert not dram & ssd, "a block has bytes in DRAM and SSD"
    assert set(dp.policy(DRAM)) == dram and set(dp.policy(SSD)) == ssd
    key = lambda e: (e.block_hash, e.tier)  # noqa: E731
    assert sorted(index.entries_on_node(NODE), key=key) == sorted(dp.residency(), key=key)


def _flip_dram_byte(dram: LocalKvStore, k: StoreKey) -> None:
    seg, off, _ = dram.location_of(k)
    dram._segment_array(seg)[off + 10] ^= 0x40  # a DRAM bit flip (what checksum=True is there for)


# ---------------------------------------------------------------- 1. demotion of corrupt DRAM bytes

@pytest.mark.parametrize("verify_reads", [True, False])
@pytest.mark.parametrize("how", ["demote", "pressure"])
def test_corrupt_dram_bytes_are_dropped_not_demoted(tmp_path, index, how, verify_reads):
    dram = LocalKvStore(4096, checksum=True)
    dp = StoreDataPlane(NODE, dram=dram, ssd=SsdTier(tmp_path / "ssd", capacity_bytes=1 << 20, slab_bytes=256 << 10),
                        index=index, verify_dram_reads=verify_reads)
    try:
        dp.put(K(1), blob(1, 2048))
        dp.put(K(3), blob(3, 1024))
        _flip_dram_byte(dram, K(1))
        if how == "demote":
            with pytest.raises(CorruptBlockError, match="crc32c"):
                dp.demote(K(1))
        else:
            assert dp.put(K(2), blob(2, 3000)) == DRAM  # DRAM pressure: K(1) and K(3) are the victims
            assert dp.tier_of(K(3)) == SSD and dp.get(K(3)) == blob(3, 1024)  # a good victim is demoted
        assert K(1) not in dp and K(1) not in dp.ssd  # dropped everywhere, never copied to SSD
        assert dp.stats().corrupt_blocks == 1 and dp.stats().demotions_dram_to_ssd == (how == "pressure")
        assert_consistent(dp, index)
    finally:
        dp.close()


# ---------------------------------------------------------------- 2. disk full is not a capacity shortage

@pytest.mark.parametrize("layout", ["slab", "files"])
def test_disk_full_evicts_no_ssd_block(index, layout):
    fs = CrashFs()
    fs.mkdir("/t")
    ssd = SsdTier("/t/ssd", capacity_bytes=64 * 4096, slab_bytes=64 * 4096, fs=fs, layout=layout)
    evicted = []
    dp = StoreDataPlane(NODE, dram=LocalKvStore(8192), ssd=ssd, index=index,
                        on_evict=lambda k, t: evicted.append((k, t)))
    try:
        for h in range(1, 11):
            dp.put(K(h), blob(h, 3000), tier=SSD)
        fs.disk_bytes = fs.used_bytes + (1000 if layout == "files" else 0)  # someone else filled the disk
        with pytest.raises(DiskFullError, match="no block was evicted"):
            dp.put(K(99), blob(99, 3000), tier=SSD)
        assert isinstance(DiskFullError("x"), StoreFullError)  # callers catching StoreFullError still do
        assert evicted == [] and dp.stats().evictions_ssd == 0 and ssd.healthy
        assert [ssd.get(K(h)) for h in range(1, 11)] == [blob(h, 3000) for h in range(1, 11)]
        assert_consistent(dp, index)
        # DRAM pressure while the disk is full: the DRAM victim cannot be demoted, so it is dropped
        dp.put(K(20), blob(20, 4000))
        dp.put(K(21), blob(21, 4000))
        dp.put(K(22), blob(22, 4000))  # evicts K(20): SSD cannot take it (disk full)
        assert K(20) not in dp and evicted == [(K(20), DRAM)] and len(ssd) == 10
        assert_consistent(dp, index)
        fs.disk_bytes = None  # room again: the SSD tier works and holds every block it had
        assert dp.put(K(99), blob(99, 3000), tier=SSD) == SSD
        assert_consistent(dp, index)
    finally:
        dp.close()


# ---------------------------------------------------------------- 3. an unhealthy SSD tier

def _unhealthy_plane(index, dram_bytes: int) -> tuple[StoreDataPlane, CrashFs]:
    fs = CrashFs()
    fs.mkdir("/t")
    ssd = SsdTier("/t/ssd", capacity_bytes=16 * 4096, slab_bytes=16 * 4096, fs=fs)
    dp = StoreDataPlane(NODE, dram=LocalKvStore(dram_bytes), ssd=ssd, index=index)
    dp.put(K(1), blob(1, 1000), tier=SSD)
    dp.put(K(2), blob(2, 1000), tier=SSD)
    fs.fail_next_fsync()
    with pytest.raises(TierUnhealthyError):
        dp.put(K(3), blob(3, 1000), tier=SSD)
    assert not ssd.healthy
    return dp, fs


def test_unhealthy_ssd_read_hit_is_served_without_promotion(index):
    dp, _ = _unhealthy_plane(index, 8192)
    try:
        assert dp.get(K(1)) == blob(1, 1000)  # reads of acknowledged blocks keep working
        assert dp.tiers_of(K(1)) == {SSD} and dp.stats().promotions_skipped == 1
        assert_consistent(dp, index)
        with pytest.raises(TierUnhealthyError, match="nothing was changed"):
            dp.promote(K(2))
        with pytest.raises(TierUnhealthyError, match="nothing was changed"):
            dp.delete(K(2))
        assert dp.tiers_of(K(2)) == {SSD} and dp.get(K(2)) == blob(2, 1000)
        assert_consistent(dp, index)
    finally:
        dp.close()


def test_unhealthy_ssd_does_not_block_dram_puts(index):
    dp, _ = _unhealthy_plane(index, 4096)
    try:
        for h in range(10, 16):
            assert dp.put(K(h), blob(h, 2048)) == DRAM  # each evicts a DRAM victim: dropped, not demoted
        assert sorted(k.block_hash for k in dp.dram.keys()) == [14, 15]
        assert dp.stats().evictions_dram == 4 and dp.stats().demotions_dram_to_ssd == 0
        assert_consistent(dp, index)
    finally:
        dp.close()


# ---------------------------------------------------------------- 4. the end-of-snapshot record

def _record_offsets(path: str) -> list[tuple[int, bytes]]:
    """(file offset, payload) of every record of a clean log file."""
    _, recs = scan(path)
    out, pos = [], HEADER_BYTES
    for _, payload in recs:
        out.append((pos, payload))
        pos += RECORD_HEADER_BYTES + len(payload)
    return out


@pytest.mark.parametrize("tail", [False, True], ids=["batches-follow", "end-is-last"])
def test_damaged_end_of_snapshot_record_keeps_every_block(tmp_path, tail):
    d = tmp_path / "t"
    with SsdTier(d, capacity_bytes=1 << 20, slab_bytes=256 << 10) as t:
        for i in range(10):
            t.put(K(i), blob(i, 3000))
    if tail:  # reopen with a tiny rotation budget: the new generation is snapshot + E, no batch record
        with SsdTier(d, capacity_bytes=1 << 20, log_rotate_bytes=1) as t:
            assert t.recovery.log_rotated
    (log,) = [p for p in d.iterdir() if p.suffix == ".qcl"]
    recs = _record_offsets(str(log))
    (end_at,) = [off for off, payload in recs if payload[:1] == b"E"]
    assert (end_at == recs[-1][0]) == tail
    raw = bytearray(log.read_bytes())
    raw[end_at + RECORD_HEADER_BYTES + 2] ^= 0x02  # one bit of the E record
    log.write_bytes(bytes(raw))
    with SsdTier(d, capacity_bytes=1 << 20) as t:
        assert [t.get(K(i)) for i in range(10)] == [blob(i, 3000) for i in range(10)]
        rep = t.recovery
        assert not rep.clean and any("end-of-snapshot record was lost" in why for _, why in rep.dropped)
    with SsdTier(d, capacity_bytes=1 << 20) as t:  # the repaired directory reopens clean
        assert len(t) == 10 and t.recovery.clean


def test_a_misplaced_batch_record_without_damage_is_still_refused(tmp_path):
    """Only damage excuses a missing E record: a generation that simply lacks one is unusable."""
    from quillcache.store import ssd_log as L
    from quillcache.store.ssd_slab import SlabLayout
    from quillcache.durability.wal import RecoveryReport, WalHeader

    clean = RecoveryReport(WalHeader(1, 1), 1, 1, 0, 0, "")
    batch = L.encode_record(L.KIND_BATCH, [])
    with pytest.raises(ValueError, match="out of place"):
        SlabLayout._replay(None, [(1, batch)], clean, [])  # type: ignore[arg-type]


# ---------------------------------------------------------------- 5./6. put_async callbacks

class EioOnce(CrashFs):
    """A disk whose next data write fails with EIO (a media error) once armed."""

    arm = False

    def pwrite(self, fd, data, offset):
        if self.arm:
            self.arm = False
            raise OSError(errno.EIO, "simulated media error")
        return super().pwrite(fd, data, offset)


@pytest.mark.parametrize("layout", ["slab", "files"])
def test_pending_callbacks_fire_once_when_a_write_error_makes_the_tier_unhealthy(layout):
    fs = EioOnce()
    fs.mkdir("/t")
    t = SsdTier("/t/ssd", capacity_bytes=16 * 4096, slab_bytes=16 * 4096, fs=fs, layout=layout)
    fired: list[tuple[int, str | None]] = []
    cb = lambda k, e: fired.append((k.block_hash, type(e).__name__ if e else None))  # noqa: E731
    t.put_async(K(1), b"x" * 1000, callback=cb)
    t.put_async(K(2), b"x" * 1000, callback=cb)
    fs.arm = True
    with pytest.raises(TierUnhealthyError, match="2 pending put"):
        t.put_async(K(3), b"y" * 1000, callback=cb)
    assert fired == [(1, "TierUnhealthyError"), (2, "TierUnhealthyError")]  # no callback for K(3): it raised
    assert K(1) not in t and K(2) not in t and len(t) == 0 and t.used_bytes == 0
    t.close()
    assert len(fired) == 2 and fs._fds == {}  # exactly once; no temp-file handle left open


@pytest.mark.parametrize("layout", ["slab", "files"])
def test_corrupt_pending_put_gets_its_callback_and_frees_its_space(layout):
    fs = CrashFs()
    fs.mkdir("/t")
    t = SsdTier("/t/ssd", capacity_bytes=2 * 4096, slab_bytes=2 * 4096, fs=fs, layout=layout)
    size = 4096 if layout == "slab" else 4096 - 64
    fired = []
    t.put_async(K(1), b"a" * size, callback=lambda k, e: fired.append((k, e)))
    (path,) = [p for p in fs.paths("/t/ssd") if p.endswith((".qcs", ".tmp"))]
    fs.corrupt(path, 0 if layout == "slab" else 64 + 10)
    with pytest.raises(CorruptBlockError):
        t.get(K(1))
    assert len(fired) == 1 and isinstance(fired[0][1], CorruptBlockError)
    t.flush()
    assert len(fired) == 1  # not again with None ("durable")
    t.put(K(2), b"b" * size)
    t.put(K(3), b"c" * size)  # the tier's whole capacity is usable again
    t.close()
    with SsdTier("/t/ssd", capacity_bytes=2 * 4096, fs=fs) as t2:
        assert sorted(k.block_hash for k in t2.keys()) == [2, 3] and t2.recovery.clean


# ---------------------------------------------------------------- 7. handle leaks

def test_failed_open_after_the_slabs_were_opened_leaves_no_handle():
    class BadSector(CrashFs):
        """Once armed, slab 1 (opened after slab 0) has an unreadable sector."""

        armed = False

        def open(self, path, mode):
            fd = super().open(path, mode)
            if self.armed and path.endswith("slab-00001.qcs"):
                self.bad = fd
            return fd

        def pread(self, fd, size, offset):
            if self.armed and fd == getattr(self, "bad", None):
                raise OSError(errno.EIO, "simulated unreadable sector")
            return super().pread(fd, size, offset)

    fs = BadSector()
    fs.mkdir("/t")
    with SsdTier("/t/ssd", capacity_bytes=1 << 20, slab_bytes=64 << 10, fs=fs) as t:
        for i in range(40):
            t.put(K(i), blob(i, 5000))
    assert fs._fds == {}
    fs.armed = True
    with pytest.raises(SsdRecoveryError, match="unreadable sector"):
        SsdTier("/t/ssd", capacity_bytes=1 << 20, fs=fs)
    assert fs._fds == {}  # every slab handle the failed open took is closed


class DirSyncFails(CrashFs):
    arm = False

    def fsync_dir(self, path):
        if self.arm:
            self.arm = False
            raise OSError(errno.EIO, "simulated directory fsync failure")
        return super().fsync_dir(path)


def test_failed_directory_fsync_of_a_new_slab_leaves_no_handle():
    fs = DirSyncFails()
    fs.mkdir("/t")
    t = SsdTier("/t/ssd", capacity_bytes=1 << 20, slab_bytes=64 << 10, fs=fs)
    fs.arm = True  # the first put creates slab 0: fallocate, fsync, rename, fsync_dir <- fails
    with pytest.raises(TierUnhealthyError):
        t.put(K(1), b"x" * 100)
    t.close()
    assert fs._fds == {}


def test_failed_directory_fsync_of_a_new_wal_leaves_no_handle():
    fs = DirSyncFails()
    fs.mkdir("/w")
    fs.arm = True
    with pytest.raises(OSError, match="directory fsync"):
        WalWriter.create("/w/log", 1, fs=fs)
    assert fs._fds == {}


# ---------------------------------------------------------------- 9. damaged log, no slab

def test_damaged_log_with_no_slab_opens_empty_and_keeps_the_evidence():
    fs = CrashFs()
    fs.mkdir("/t")
    SsdTier("/t/ssd", capacity_bytes=16 * 4096, slab_bytes=16 * 4096, fs=fs).close()
    fs.corrupt("/t/ssd/log-00000000.qcl", 20)  # the log header: the log is unusable
    with SsdTier("/t/ssd", capacity_bytes=16 * 4096, fs=fs) as t:
        rep = t.recovery
        assert len(t) == 0 and not rep.clean and "started empty" in rep.log_tail
        assert [n for n, _ in rep.dropped] == ["log-00000000.qcl"] and rep.quarantined
        t.put(K(1), b"works")
    with SsdTier("/t/ssd", capacity_bytes=16 * 4096, fs=fs) as t:
        assert t.get(K(1)) == b"works"


# ---------------------------------------------------------------- 10. a failed log rotation (D1)

class FullDiskRotation(CrashFs):
    """The disk fills up during a log rotation: ``dir_fails`` directory fsyncs right after a log
    generation's rename fail with ENOSPC (the rotation's own, then the one undoing it), with
    ``unlink_fails`` removing a log generation fails, and while ``tmp_full`` a new generation's
    temp file cannot be created (ENOSPC: later rotations fail before any rename)."""

    dir_fails = 0
    unlink_fails = False
    tmp_full = False
    _after_log_rename = False

    def rename(self, src, dst):
        super().rename(src, dst)
        self._after_log_rename = dst.endswith(".qcl")

    def fsync_dir(self, path):
        if self.dir_fails and self._after_log_rename:
            self.dir_fails -= 1
            raise OSError(errno.ENOSPC, "simulated ENOSPC on a directory fsync")
        return super().fsync_dir(path)

    def unlink(self, path):
        if self.unlink_fails and path.endswith(".qcl"):
            raise OSError(errno.EIO, "simulated unlink failure")
        return super().unlink(path)

    def open(self, path, mode):
        if self.tmp_full and "/log-" in path and path.endswith(".tmp"):
            raise OSError(errno.ENOSPC, "simulated ENOSPC creating a log generation")
        return super().open(path, mode)


def _logs(fs: CrashFs) -> list[str]:
    return sorted(p.rsplit("/", 1)[1] for p in fs.paths("/t/ssd") if p.endswith(".qcl"))


@pytest.mark.parametrize("undo", ["removed", "dir-fsync-fails", "unlink-fails"])
def test_failed_log_rotation_loses_no_acknowledged_put(undo):
    """The new generation was renamed into place, its directory fsync failed: it must not stay
    behind while commits go on to the old generation (the next open would pick it). Removed: the
    tier stays healthy and later puts and deletes survive a clean reopen and crashes; if it cannot
    be removed durably, the tier refuses writes. Either way every acknowledged put is recovered."""
    fs = FullDiskRotation()
    fs.mkdir("/t")
    kw = dict(capacity_bytes=64 * 4096, slab_bytes=64 * 4096)
    t = SsdTier("/t/ssd", log_rotate_bytes=4096, fs=fs, **kw)
    fs.dir_fails = 2 if undo == "dir-fsync-fails" else 1
    fs.unlink_fails = undo == "unlink-fails"
    acked: list[int] = []
    for h in range(1, 300):  # puts until a rotation runs and fails after its rename
        t.put(K(h), blob(h, 100))
        acked.append(h)
        if not fs.dir_fails:
            break
    else:
        pytest.fail("no log rotation ran")
    fs.unlink_fails, fs.tmp_full = False, True  # the disk stays full: later rotations fail before a rename
    assert t.healthy == (undo == "removed")
    if t.healthy:
        assert _logs(fs) == ["log-00000000.qcl"]  # the half-made generation is gone
        t.delete(K(1))
        acked.remove(1)
    later = []
    for h in range(1000, 1010):
        try:
            t.put(K(h), blob(h, 100))  # each retries the rotation (tmp_full: ENOSPC, no rename)
        except TierUnhealthyError:
            continue
        later.append(h)
    assert len(later) == (10 if undo == "removed" else 0) and t.healthy == (undo == "removed")
    acked += later
    rng = random.Random(20240611)
    images = [copy.deepcopy(fs).crash(random.Random(rng.random())) for _ in range(12)]  # power lost now
    t.close()
    assert fs._fds == {}
    fs.tmp_full = False
    for img in [fs] + images:
        with SsdTier("/t/ssd", fs=img, **kw) as t2:
            assert [h for h in acked if K(h) not in t2] == []
            assert all(t2.get(K(h)) == blob(h, 100) for h in acked)
            assert K(1) not in t2 or undo != "removed"  # a durable delete stays deleted


# ---------------------------------------------------------------- 11. orphan slabs (D2)

class SlabDirFull(CrashFs):
    """The next ``fails`` directory fsyncs right after a slab's rename fail with ENOSPC."""

    fails = 0
    _after_slab_rename = False

    def rename(self, src, dst):
        super().rename(src, dst)
        self._after_slab_rename = dst.endswith(".qcs")

    def fsync_dir(self, path):
        if self.fails and self._after_slab_rename:
            self.fails -= 1
            raise OSError(errno.ENOSPC, "simulated ENOSPC on a directory fsync")
        return super().fsync_dir(path)


def test_new_slab_whose_directory_fsync_failed_leaves_no_slab_file():
    fs = SlabDirFull()
    fs.mkdir("/t")
    slab_bytes = 16 * 4096
    t = SsdTier("/t/ssd", capacity_bytes=64 * 4096, slab_bytes=slab_bytes, fs=fs)
    slabs = lambda: [p for p in fs.paths("/t/ssd") if p.endswith((".qcs", ".qcs.tmp"))]  # noqa: E731
    fs.fails = 3
    for _ in range(3):  # each retry of a full disk would leave one more preallocated slab
        with pytest.raises(DiskFullError):
            t.put(K(1), b"x" * 100)
    assert slabs() == [] and len(fs._fds) == 1  # only the log is open
    assert len(t) == 0 and t.used_bytes == 0 and t.healthy
    t.put(K(1), b"x" * 100)  # the disk has room again
    assert [fs.stat(p).size_bytes for p in slabs()] == [slab_bytes]
    t.close()
    with SsdTier("/t/ssd", capacity_bytes=64 * 4096, fs=fs) as t2:
        assert t2.get(K(1)) == b"x" * 100 and t2.recovery.clean
        assert [fs.stat(p).size_bytes for p in slabs()] == [slab_bytes]


# ---------------------------------------------------------------- 12. corrupt pressure victim (R2)

def test_corrupt_dram_victim_is_reported_to_on_evict(tmp_path, index):
    dram = LocalKvStore(4096, checksum=True)
    evicted: list[tuple[int, CacheTier]] = []
    dp = StoreDataPlane(NODE, dram=dram, ssd=SsdTier(tmp_path / "ssd", capacity_bytes=1 << 20, slab_bytes=256 << 10),
                        index=index, on_evict=lambda k, t: evicted.append((k.block_hash, t)))
    try:
        dp.put(K(1), blob(1, 2048))
        dp.put(K(3), blob(3, 1024))
        _flip_dram_byte(dram, K(1))
        assert dp.put(K(2), blob(2, 3000)) == DRAM  # K(1) (corrupt: dropped) and K(3) (demoted) are victims
        assert K(1) not in dp and dp.tier_of(K(3)) == SSD
        assert evicted == [(1, DRAM)]  # the drop is reported; the demotion moved K(3), it is not an eviction
        st = dp.stats()
        assert st.corrupt_blocks == 1 and st.evictions_dram == 0 and st.demotions_dram_to_ssd == 1
        assert_consistent(dp, index)
    finally:
        dp.close()
