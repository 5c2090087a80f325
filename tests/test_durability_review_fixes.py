"""Review fixes of the durable file systems (``quillcache.durability``):

3. CrashFs: a failed fsync loses the file's unsynced writes for good (Linux >= 4.13 marks the pages clean):
   a retried fsync saves nothing, a crash never brings them back, reads still see them (the page cache),
   and writes after the failure become durable at the next successful fsync as usual;
4. RealFs: handles are opaque and never reused, so every call on a closed handle raises EBADF (an fd
   number reused by a later open used to let a use-after-close write into another file);
9. CrashFs: mkdir needs its parent and fsync_dir a directory, raising what RealFs raises; the root is
   the simulation's boundary (a top-level directory needs no parent; syncing the root is a no-op)."""

from __future__ import annotations

import errno
import random

import pytest

from quillcache.durability.crashfs import CrashFs
from quillcache.durability.fs import RealFs


def _disk(tmp_path, kind: str):
    """(file system, the directory the test works in) on the real disk or the simulator."""
    if kind == "real":
        return RealFs(), str(tmp_path)
    fs = CrashFs()
    fs.mkdir("/w")
    return fs, "/w"


# ---------------------------------------------------------------- 3. a failed fsync loses the writes
def test_a_write_whose_fsync_failed_never_becomes_durable():
    for seed in range(50):
        fs = CrashFs()
        fs.mkdir("/d")
        fd = fs.open("/d/a", "x")
        fs.fsync_dir("/d")
        fs.pwrite(fd, b"synced", 0)
        fs.fsync(fd)
        fs.pwrite(fd, b"LOST", 0)
        fs.fail_next_fsync()
        with pytest.raises(OSError) as ei:
            fs.fsync(fd)
        assert ei.value.errno == errno.EIO
        fs.fsync(fd)  # the retry a caller must never rely on succeeds, and saves nothing
        assert fs.pread(fd, 6, 0) == b"LOSTed"  # reads see the page cache
        assert fs.snapshot().read_file("/d/a") == b"synced"
        assert fs.crash(random.Random(seed)).read_file("/d/a") == b"synced", seed


def test_writes_after_a_failed_fsync_are_durable_at_the_next_one_without_the_lost_ones():
    for seed in range(50):
        fs = CrashFs()
        fs.mkdir("/d")
        fd = fs.open("/d/a", "x")
        fs.fsync_dir("/d")
        fs.pwrite(fd, b"AAAA", 0)
        fs.fail_next_fsync()
        with pytest.raises(OSError):
            fs.fsync(fd)
        fs.pwrite(fd, b"BBBB", 8)
        fs.truncate(fd, 10)
        fs.fdatasync(fd)
        assert fs.read_file("/d/a") == b"AAAA\0\0\0\0BB"
        fs.pwrite(fd, b"C", 0)  # unsynced at the crash: kept, dropped, torn or garbled
        disk = fs.crash(random.Random(seed)).read_file("/d/a")
        assert len(disk) == 10 and disk[1:] == bytes(7) + b"BB", (seed, disk)  # never the lost AAAA


# ---------------------------------------------------------------- 4. a closed handle is EBADF
@pytest.mark.parametrize("kind", ["real", "crash"])
def test_every_call_on_a_closed_handle_is_ebadf_even_after_a_reopen(tmp_path, kind):
    fs, d = _disk(tmp_path, kind)
    a = fs.open(f"{d}/a", "x")
    fs.close(a)
    b = fs.open(f"{d}/b", "x")  # the OS would give b the descriptor number a had
    fs.pwrite(b, b"b's", 0)
    calls = {"pwrite": lambda: fs.pwrite(a, b"meant for a", 0), "pread": lambda: fs.pread(a, 3, 0),
             "preadinto": lambda: fs.preadinto(a, memoryview(bytearray(3)), 0), "fsync": lambda: fs.fsync(a),
             "fdatasync": lambda: fs.fdatasync(a), "truncate": lambda: fs.truncate(a, 0),
             "fallocate": lambda: fs.fallocate(a, 0, 4096), "fsize": lambda: fs.fsize(a),
             "map_copy": lambda: fs.map_copy(a), "close": lambda: fs.close(a)}
    for name, call in calls.items():
        with pytest.raises(OSError) as ei:
            call()
        assert ei.value.errno == errno.EBADF, name
    assert fs.pread(b, 16, 0) == b"b's" and fs.fsize(b) == 3  # b was never touched
    fs.close(b)
    handles = set()
    for _ in range(20):  # never reused
        h = fs.open(f"{d}/b", "r")
        fs.close(h)
        handles.add(h)
    assert len(handles) == 20


def test_a_real_handle_still_maps_and_syncs(tmp_path):
    fs = RealFs()
    h = fs.open(str(tmp_path / "m"), "x")
    fs.pwrite(h, b"mapped", 0)
    fs.fallocate(h, 0, 8)
    fs.fsync(h)
    m = fs.map_copy(h)
    try:
        assert m[:6] == b"mapped" and fs.fsize(h) == 8
    finally:
        m.close()
        fs.close(h)


# ---------------------------------------------------------------- 9. mkdir and fsync_dir as on a real disk
@pytest.mark.parametrize("kind", ["real", "crash"])
def test_mkdir_needs_its_parent_and_fsync_dir_a_directory(tmp_path, kind):
    fs, d = _disk(tmp_path, kind)
    fs.close(fs.open(f"{d}/file", "x"))
    syncs = getattr(fs, "sync_calls", 0)
    for call, error in ((lambda: fs.mkdir(f"{d}/no/such"), FileNotFoundError),
                        (lambda: fs.mkdir(f"{d}/file/sub"), NotADirectoryError),
                        (lambda: fs.fsync_dir(f"{d}/missing"), FileNotFoundError),
                        (lambda: fs.fsync_dir(f"{d}/file"), NotADirectoryError)):
        with pytest.raises(error):
            call()
    assert getattr(fs, "sync_calls", 0) == syncs  # nothing was synced
    assert not fs.exists(f"{d}/no")
    fs.mkdir(f"{d}/sub")
    fs.mkdir(f"{d}/sub/deeper")
    fs.fsync_dir(f"{d}/sub")
    assert fs.is_dir(f"{d}/sub/deeper")


def test_the_simulated_root_is_the_boundary():
    fs = CrashFs()
    fs.mkdir("/top")  # a top-level directory needs no parent
    fs.mkdir("rel")
    fs.fsync_dir("/")  # syncing the boundary is a no-op, not a sync call
    fs.fsync_dir(".")
    assert fs.sync_calls == 0
    fs.fsync_dir("/top")
    assert fs.sync_calls == 1
    for root in ("/", "."):
        with pytest.raises(FileExistsError):
            fs.mkdir(root)
