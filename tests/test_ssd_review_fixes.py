"""Regression tests for the durability review's SSD tier findings (H1, M2, L1 of /tmp/s34/store/report.md).

- H1: one tier per directory: a second ``SsdTier`` on the same directory (this process or another) is refused
  with ``DataDirInUseError`` naming the directory; the lock file is the tier's own (not foreign); a failed open
  releases the lock; a simulated file system takes none.
- M2: a read that fails with an ``OSError`` (EMFILE, ENFILE, ENOMEM, EIO) raises ``StoreError`` and keeps the
  block and its file; only a short read or a crc32c mismatch drops it.
- L1: damaged files go to ``quarantine/``, never deleted: a files-layout object found damaged on read (durable or
  staged), a slab log generation replayed with damage (rotated away at open), an older damaged generation next to
  a newer one; the recovery names the keys of the put entries in the damaged log records.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys

import pytest

from quillcache.durability.crashfs import CrashFs
from quillcache.durability.dirlock import DataDirInUseError
from quillcache.durability.fs import RealFs
from quillcache.store.errors import CorruptBlockError, ForeignFileError, StoreError
from quillcache.store.keys import StoreKey
from quillcache.store.ssd import SsdTier
from quillcache.store.ssd_format import QUARANTINE, owned_kind

CAP = 4 << 20
LAYOUTS = ("slab", "files")
LOCK = "quillcache-ssd.lock"  # the tier's DataDirLock file (ssd_format.LOCK)


def key(i: int) -> StoreKey:
    return StoreKey(i, bytes([7]) * 16)


def data(i: int, n: int = 3000) -> bytes:
    return bytes([i % 251 + 1]) * n


def _tier(d, layout: str | None = None, **kw) -> SsdTier:
    return SsdTier(d, capacity_bytes=CAP, layout=layout, slab_bytes=1 << 20, **kw)


def _quarantined(d) -> list[str]:
    q = os.path.join(d, QUARANTINE)
    return sorted(os.listdir(q)) if os.path.isdir(q) else []


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at, os.SEEK_END if at < 0 else os.SEEK_SET)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 1]))


# ------------------------------------------------------------------ H1: one tier per directory
@pytest.mark.parametrize("layout", LAYOUTS)
def test_second_tier_on_one_dir_is_refused_in_this_process(tmp_path, layout):
    d = tmp_path / "t"
    a = _tier(d, layout)
    a.put(key(1), data(1))
    before = sorted(os.listdir(d))
    with pytest.raises(DataDirInUseError, match=f"{d}.*SSD tier"):
        _tier(d, layout)
    assert sorted(os.listdir(d)) == before  # the refused open touched nothing
    a.put(key(2), data(2))
    assert a.get(key(1)) == data(1) and a.get(key(2)) == data(2)
    a.close()
    with _tier(d) as b:  # released by close
        assert sorted(k.block_hash for k in b.keys()) == [1, 2]
        assert b.recovery.clean and b.recovery.foreign_files == ()


def test_second_tier_on_one_dir_is_refused_from_another_process(tmp_path):
    d = tmp_path / "t"
    code = ("import sys\nfrom quillcache.store.ssd import SsdTier\n"
            "try:\n    SsdTier(sys.argv[1], capacity_bytes=4 << 20)\n"
            "except Exception as e:\n    print(type(e).__name__, e)\nelse:\n    print('OPENED')\n")
    with _tier(d) as a:
        a.put(key(1), data(1))
        out = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=120,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert out.stdout.startswith("DataDirInUseError"), (out.stdout, out.stderr)
        assert str(d) in out.stdout and f"pid {os.getpid()}" in out.stdout
        assert a.get(key(1)) == data(1)


def test_lock_file_is_the_tiers_own_and_failed_opens_release_it(tmp_path):
    assert owned_kind(LOCK) is not None
    d = tmp_path / "t"
    with _tier(d, "files") as t:
        t.put(key(1), data(1))
    assert os.path.isfile(d / LOCK)
    with pytest.raises(ValueError, match="holds a 'files' SSD tier"):  # a failed open...
        _tier(d, "slab")
    with _tier(d) as t:  # ...released the lock; the lock file is not reported as foreign
        assert t.recovery.clean and t.recovery.foreign_files == () and t.get(key(1)) == data(1)


def test_foreign_dir_is_refused_and_left_as_found(tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("user data")
    with pytest.raises(ForeignFileError, match="not a QuillCache SSD tier"):
        _tier(d)
    assert sorted(os.listdir(d)) == ["notes.txt"]  # no lock file left behind
    d2 = tmp_path / "fresh"
    d2.mkdir()
    with _tier(d2) as t:  # an empty dir (or one with only our lock file) is initialised
        t.put(key(1), data(1))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_simulated_fs_takes_no_lock(layout):
    fs = CrashFs()
    fs.mkdir("/c")
    t = SsdTier("/c/t", capacity_bytes=CAP, fs=fs, layout=layout, slab_bytes=1 << 20)
    t.put(key(1), data(1))
    assert LOCK not in fs.listdir("/c/t")
    t.close()
    with SsdTier("/c/t", capacity_bytes=CAP, fs=fs) as t2:
        assert t2.get(key(1)) == data(1) and t2.recovery.clean


# ------------------------------------------------------------------ M2: a failed read keeps the block
class _ReadFailFs(RealFs):
    """RealFs whose reads of block bytes fail with ``errno_`` while ``armed``."""

    def __init__(self) -> None:
        super().__init__()
        self.armed: int | None = None

    def preadinto(self, fd, buf, offset):
        if self.armed is not None:
            raise OSError(self.armed, os.strerror(self.armed))
        return super().preadinto(fd, buf, offset)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("err", [errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EIO])
def test_read_error_keeps_the_block(tmp_path, layout, err):
    d = tmp_path / "t"
    fs = _ReadFailFs()
    t = SsdTier(d, capacity_bytes=CAP, fs=fs, layout=layout, slab_bytes=1 << 20)
    t.put(key(1), data(1))
    files = sorted(os.listdir(d))
    fs.armed = err
    with pytest.raises(StoreError, match=f"{key(1).hex()}.*kept") as exc:
        t.get(key(1))
    assert not isinstance(exc.value, CorruptBlockError)
    buf = bytearray(len(data(1)))
    with pytest.raises(StoreError, match="kept"):
        t.get_into(key(1), buf)
    fs.armed = None
    assert key(1) in t and t.get(key(1)) == data(1)
    t.put(key(2), data(2))  # a later commit logs no delete of it
    assert set(files) <= set(os.listdir(d)) and not _quarantined(d)
    t.close()
    with SsdTier(d, capacity_bytes=CAP) as t2:
        assert t2.get(key(1)) == data(1) and t2.recovery.clean


def test_missing_object_file_is_dropped(tmp_path):
    """(Kept behaviour) files layout: an object file that is gone cannot be read ever again: dropped."""
    d = tmp_path / "t"
    with _tier(d, "files") as t:
        t.put(key(1), data(1))
        os.unlink(d / "o-00000001.qco")
        with pytest.raises(CorruptBlockError, match="missing"):
            t.get(key(1))
        assert key(1) not in t


# ------------------------------------------------------------------ L1: damaged files go to quarantine/
def test_files_block_damaged_on_read_is_quarantined(tmp_path):
    d = tmp_path / "t"
    t = _tier(d, "files")
    t.put(key(1), data(1))
    t.put(key(2), data(2))
    obj = d / "o-00000001.qco"
    _flip(str(obj), -5)
    damaged = obj.read_bytes()
    with pytest.raises(CorruptBlockError, match="quarantine"):
        t.get(key(1))
    t.flush()
    assert not obj.exists()
    (q,) = _quarantined(d)
    assert q.endswith("o-00000001.qco") and (d / QUARANTINE / q).read_bytes() == damaged
    t.close()
    with _tier(d) as t2:
        assert key(1) not in t2 and t2.get(key(2)) == data(2) and t2.recovery.foreign_files == ()


def test_files_staged_block_damaged_on_read_is_quarantined(tmp_path):
    d = tmp_path / "t"
    with _tier(d, "files", group_commit_blocks=100) as t:
        fired = []
        t.put_async(key(1), data(1), lambda k, e: fired.append(e))
        (tmp,) = [n for n in os.listdir(d) if n.endswith(".tmp")]
        _flip(str(d / tmp), -1)
        with pytest.raises(CorruptBlockError):
            t.get(key(1))
        assert isinstance(fired[0], CorruptBlockError) and not (d / tmp).exists()
        (q,) = _quarantined(d)
        assert q.endswith(tmp)


def _three_block_slab_tier(d) -> str:
    with _tier(d) as t:
        for i in (1, 2, 3):
            t.put(key(i), data(i))
    (log,) = [n for n in os.listdir(d) if n.startswith("log-")]
    return log


def test_slab_damaged_log_tail_is_quarantined_and_names_the_key(tmp_path):
    d = tmp_path / "t"
    log = _three_block_slab_tier(d)
    _flip(str(d / log), -10)  # in the last record: key 3's batch
    damaged = (d / log).read_bytes()
    with _tier(d) as t:
        r = t.recovery
        assert sorted(k.block_hash for k in t.keys()) == [1, 2]
        assert key(3).hex() in r.log_tail and "unverified" in r.log_tail
        assert (key(3).hex(), f"{log}: its put entry is in a damaged log record (key read from the damaged "
                              f"bytes, unverified)") in r.dropped
        # only the dropped tail is kept (a crash's torn write looks the same: a whole generation per crash would
        # fill the disk), named after its generation and offset; the generation itself is replaced
        assert r.log_rotated and len(r.quarantined) == 1
        (kept,) = r.quarantined
        offset = int(kept.rsplit(".tail-", 1)[1])
        assert f"{log}.tail-" in kept and (d / kept).read_bytes() == damaged[offset:]
        assert 0 < len(damaged) - offset < len(damaged) // 2
        assert not (d / log).exists()


def test_repeated_crashes_with_torn_tails_keep_only_the_tails(tmp_path):
    # the re-review's M1: every open after a torn group commit moved the whole log generation to quarantine/
    d = tmp_path / "t"
    log = _three_block_slab_tier(d)
    kept_bytes = 0
    for i in range(5):
        (cur,) = [n for n in os.listdir(d) if n.endswith(".qcl")]
        with open(d / cur, "ab") as fh:
            fh.write(b"\x17" * 40)  # a torn append: garbage after the last whole record
        with _tier(d) as t:
            assert len(t) == 3 and t.recovery.quarantined
            kept_bytes += sum(os.path.getsize(d / q) for q in t.recovery.quarantined)
    assert kept_bytes == 5 * 40


def test_slab_damaged_middle_record_names_the_key(tmp_path):
    d = tmp_path / "t"
    log = _three_block_slab_tier(d)
    raw = (d / log).read_bytes()
    at = raw.find(key(2).to_bytes())  # key 2's entry: the second batch record
    _flip(str(d / log), at + 30)
    with _tier(d) as t:
        r = t.recovery
        assert sorted(k.block_hash for k in t.keys()) == [1, 3] and r.log_damaged_lsns
        assert [k for k, _ in r.dropped] == [key(2).hex()]
        assert r.quarantined and r.quarantined[0].endswith(log)


def test_older_damaged_generation_is_quarantined_not_swept(tmp_path):
    """A crash after the rotation that replaced a damaged generation, before its move to quarantine/, leaves it
    next to the newer one: the next open quarantines it too."""
    d = tmp_path / "t"
    log = _three_block_slab_tier(d)
    _flip(str(d / log), -10)
    with _tier(d) as t:
        (q,) = t.recovery.quarantined
    shutil.copyfile(d / q, d / log)  # as if the move had not happened
    with _tier(d) as t:
        r = t.recovery
        assert sorted(k.block_hash for k in t.keys()) == [1, 2]
        assert log not in r.swept_temp_files and any(x.endswith(log) for x in r.quarantined)
    assert not (d / log).exists() and len(_quarantined(d)) == 2
