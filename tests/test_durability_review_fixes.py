"""Regression tests of the durability review of 2026-11-29 (/tmp/s34/store): each failed before its fix.

1. A RocksDB index with a damaged SST file raises ``IndexCorruptionError`` naming the file; before, its
   iterator's error status was never read, so every scan answered "nothing there" (H2).
2. A directory where a log or store file is expected is refused by ``RealFs.open`` with an
   ``IsADirectoryError`` that names the path; before, it opened read-only and the first read failed with
   an error naming no file (L2).
3. ``WalWriter`` refuses a bad ``group_bytes`` when it is made; before, an ``append`` raised after buffering
   its record, which the next sync made durable although the call had failed (L3).
"""

from __future__ import annotations

import glob
import os

import pytest

from quillcache.durability.fs import READ, RealFs
from quillcache.durability.wal import WalWriter, scan
from quillcache.index import ResidencyEntry, open_index
from quillcache.index.base import IndexCorruptionError, NotAnIndexError
from quillcache.types import CacheTier


def entry(h: int) -> ResidencyEntry:
    return ResidencyEntry(h, "n0", CacheTier.DRAM, h.to_bytes(16, "little"), 1, 0, 4096)


def test_a_damaged_rocksdb_sst_is_an_error_not_an_empty_index(tmp_path):
    d = str(tmp_path / "rdb")
    ix = open_index("rocksdb", d)
    ix.put([entry(i) for i in range(100)])
    ix.close()
    ix = open_index("rocksdb", d)
    assert len(ix) == 100 and ix.locate([5])[0]
    ix.close()
    ssts = glob.glob(os.path.join(d, "*.sst"))
    assert ssts, "the close flushed the memtable into an SST file"
    for path in ssts:
        raw = bytearray(open(path, "rb").read())
        raw[100] ^= 0xFF
        with open(path, "wb") as fh:
            fh.write(raw)
    with pytest.raises(IndexCorruptionError, match=r"\.sst") as err:
        ix = open_index("rocksdb", d)  # the open reads the node table: a scan over the damaged block
        try:  # (should the open not touch the damaged block, a read must)
            len(ix), ix.locate([5])
        finally:
            ix.close()
    assert isinstance(err.value, NotAnIndexError)  # callers that refuse a bad index dir catch this


def test_realfs_refuses_a_directory_where_a_file_is_expected_and_names_it(tmp_path):
    d = tmp_path / "master.wal"
    d.mkdir()
    with pytest.raises(IsADirectoryError) as err:
        RealFs().open(str(d), READ)
    assert err.value.filename == str(d)
    with pytest.raises(IsADirectoryError) as err:
        scan(d)
    assert err.value.filename == str(d) and str(d) in str(err.value)
    f = tmp_path / "file"
    f.write_bytes(b"x")
    fs = RealFs()
    fd = fs.open(str(f), READ)  # a file still opens
    try:
        assert fs.pread(fd, 1, 0) == b"x"
    finally:
        fs.close(fd)


@pytest.mark.parametrize("bad", ["1M", None, 2.5, 0, -5])
def test_a_bad_group_bytes_is_refused_before_anything_is_logged(tmp_path, bad):
    p = tmp_path / "w.log"
    with pytest.raises((TypeError, ValueError), match="group_bytes"):
        WalWriter.create(p, 1, group_bytes=bad)
    assert not p.exists() and not (tmp_path / "w.log.tmp").exists()
