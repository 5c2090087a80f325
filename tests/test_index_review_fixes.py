"""Regression tests of the index / ART / WAL review: each test failed before its fix.

1. An ART batch refused after it was logged is withdrawn from the log and fails the index; node
   names enter the table only once their batch is applied.
2. Flat/sorted snapshots are checksummed and their records checked for pairing; a secondary
   without its primary is a typed error, not an assert.
3. WAL recovery jumps over zero runs instead of checking every zero byte; CrashFs can zero-fill.
4. An ART index whose log failed can still be closed (everything released, the error raised once).
5. A flat.snapshot.tmp left by a crash during a flush is removed at open.
6. A WAL payload is logged as its bytes, whatever its buffer's item size.
7. remove() type-checks its items; ArtTree's u64 scans agree with ArtReference.
"""

from __future__ import annotations

import array
import copy
import errno
import hashlib
import os
import random
import secrets

import crc32c
import msgpack
import numpy as np
import pytest

from quillcache.art.tree import ArtReference, ArtTree
from quillcache.durability import wal as walmod
from quillcache.durability.crashfs import CrashFs
from quillcache.durability.wal import WalError, WalFailedError, WalWriter, scan, scan_bytes
from quillcache.index import INDEX_BACKENDS, IndexClosedError, NotAnIndexError, ResidencyEntry, open_index
from quillcache.index import keys as K
from quillcache.index.art_index import WAL, IndexFailedError
from quillcache.index.flat import _HEAD, MAGIC, SNAPSHOT, VERSION
from quillcache.types import CacheTier


def entry(h: int, node: str = "base", off: int = 0) -> ResidencyEntry:
    return ResidencyEntry(h, node, CacheTier.DRAM, h.to_bytes(16, "little"), 1, off, 4096)


def columns(first: int, n: int, node: str) -> tuple:
    h = np.arange(first, first + n, dtype=np.uint64)
    z = np.zeros(n, dtype=np.uint32)
    idents = b"".join(int(x).to_bytes(16, "little") for x in h)
    return h, idents, [node] * n, np.full(n, int(CacheTier.DRAM), np.uint8), z + 1, z.astype(np.uint64), z + 4096


# ---- 1. a refused ART batch leaves nothing behind ------------------------------------------------------------


class _FailingInserts:
    """An ArtTree stand-in whose insert_batch applies half the rows, then runs out of memory (as the
    arena's growth can part-way through a batch)."""

    def __init__(self, tree: ArtTree) -> None:
        self._tree = tree

    def insert_batch(self, keys: np.ndarray, values: np.ndarray) -> int:
        half = len(keys) // 2
        self._tree.insert_batch(np.ascontiguousarray(keys[:half]), np.ascontiguousarray(values[:half]))
        raise MemoryError("cannot grow the arena (injected)")

    def __getattr__(self, name: str):
        return getattr(self._tree, name)

    def __len__(self) -> int:
        return len(self._tree)


def _refused_put(ix, how: str) -> None:
    ix._secondary = _FailingInserts(ix._secondary)
    with pytest.raises(MemoryError) as exc:
        if how == "put_columns":
            ix.put_columns(*columns(10**9, 40, "node-Z"))
        else:
            ix.put([entry(10**9 + i, "node-Z") for i in range(40)])
    assert any("now failed" in note for note in getattr(exc.value, "__notes__", ()))


@pytest.mark.parametrize("how", ["put", "put_columns"])
@pytest.mark.parametrize("written", [False, True], ids=["buffered", "written"])
def test_a_batch_refused_after_it_was_logged_is_withdrawn_and_fails_the_index(how, written):
    fs = CrashFs()
    ix = open_index("art", "/r/ix", fs=fs)
    ix.put([entry(h) for h in range(30)])
    ix.flush()
    ix.put([entry(h) for h in range(30, 40)])  # accepted, not flushed: close() makes it durable
    if written:
        ix._wal.group_bytes = 1  # every append reaches the file at once (unsynced)
    _refused_put(ix, how)
    for call in (lambda: ix.locate([1]), lambda: ix.locate_raw(1), lambda: ix.locate_arrays(np.array([1], np.uint64)),
                 lambda: ix.put([entry(7)]), ix.flush, ix.checkpoint, lambda: len(ix), lambda: ix.nodes() and ix.scan_prefix(b"")):
        with pytest.raises(IndexFailedError, match="refused part-way .*MemoryError"):
            call()
    for seed in range(25):  # power lost now: the refused batch never comes back
        again = open_index("art", "/r/ix", fs=copy.deepcopy(fs).crash(random.Random(seed)))
        assert again.locate([10**9])[0] == [] and again.nodes() == ["base"]
        assert len(again.locate_arrays(np.arange(30, dtype=np.uint64)).keys) == 30  # acknowledged
        again.close()
    ix.close()  # no checkpoint of the half-applied trees; the log is synced
    disk = fs.snapshot()
    again = open_index("art", "/r/ix", fs=disk)
    assert again.nodes() == ["base"] and again.locate([10**9])[0] == [] and len(again) == 40
    again.put([entry(5, "node-B")])  # a new node takes the number the refused one was given, under its own name
    assert [e.node for e in again.locate([5])[0]] == ["base", "node-B"]
    again.close()
    final = open_index("art", "/r/ix", fs=disk)
    assert [e.node for e in final.locate([5])[0]] == ["base", "node-B"] and final.nodes() == ["base", "node-B"]
    final.close()


def test_an_in_memory_art_index_fails_the_same_way():
    ix = open_index("art")
    ix.put([entry(1)])
    _refused_put(ix, "put_columns")
    with pytest.raises(IndexFailedError):
        ix.locate([1])
    ix.close()
    with pytest.raises(IndexClosedError):
        ix.locate([1])


def test_a_batch_that_does_not_fit_the_layout_is_refused_before_it_is_logged(tmp_path):
    ix = open_index("art", tmp_path / "ix")
    ix.put([entry(1)])
    lsn = ix._wal.next_lsn
    for puts in ([(b"Z" + bytes(29), bytes(16))], [(b"B" + bytes(29), bytes(15))], [(b"M\x00", b"\x00")]):
        with pytest.raises(K.IndexKeyError):
            ix._raw_write(puts, ())
    assert ix._wal.next_lsn == lsn and [e.block_hash for e in ix.locate([1])[0]] == [1]  # not logged, not failed
    ix.close()


@pytest.mark.parametrize("group_bytes", [1 << 20, 1], ids=["buffered", "written"])
def test_retract_withdraws_the_last_unacknowledged_record(group_bytes):
    fs = CrashFs()
    fs.mkdir("/w")
    w = WalWriter.create("/w/a.wal", 1, fs=fs, group_bytes=group_bytes)
    w.append(b"one")
    w.sync()
    w.append(b"two")
    lsn = w.append(b"refused")
    with pytest.raises(WalError, match="cannot retract lsn 2"):
        w.retract(2)  # not the last record
    w.retract(lsn)
    with pytest.raises(WalError, match="cannot retract lsn 3"):
        w.retract(lsn)  # not twice
    for seed in range(20):
        _, recs = scan_bytes(copy.deepcopy(fs).crash(random.Random(seed)).read_file("/w/a.wal"), "a.wal")
        assert b"refused" not in [p for _, p in recs] and recs[:1] == [(1, b"one")]
    assert w.append(b"three") == lsn
    w.sync()
    with pytest.raises(WalError, match="unacknowledged"):
        w.retract(lsn)  # acknowledged now
    w.close()
    assert [p for _, p in scan_bytes(fs.read_file("/w/a.wal"), "a.wal")[1]] == [b"one", b"two", b"three"]


# ---- 2. flat/sorted snapshots: checksum, pairing, typed errors -----------------------------------------------


def _snapshot_path(tmp_path, kind: str):
    ix = open_index(kind, tmp_path / kind)
    ix.put([ResidencyEntry(7, "n0", CacheTier.DRAM, bytes(16), 3, 4096, 64), entry(9, "n1")])
    ix.close()
    return tmp_path / kind / SNAPSHOT


def _write_body(path, records) -> None:
    body = msgpack.packb(records, use_bin_type=True)
    path.write_bytes(_HEAD.pack(MAGIC, VERSION, 0, crc32c.crc32c(body), len(body)) + body)


@pytest.mark.parametrize("kind", ["flat", "sorted"])
def test_every_flipped_byte_of_a_flat_snapshot_is_refused_naming_the_file(tmp_path, kind):
    snap = _snapshot_path(tmp_path, kind)
    good = snap.read_bytes()
    assert good[:8] == MAGIC
    for i in range(len(good)):
        bad = bytearray(good)
        bad[i] ^= 1 << (i % 8)
        snap.write_bytes(bytes(bad))
        with pytest.raises(NotAnIndexError, match="is not a valid flat-index snapshot") as exc:
            open_index(kind, snap.parent)
        assert str(snap) in str(exc.value)
    snap.write_bytes(good)
    assert open_index(kind, snap.parent).locate([7])[0][0].offset_bytes == 4096


@pytest.mark.parametrize("kind", ["flat", "sorted"])
@pytest.mark.parametrize("damage, why", [
    ("drop_primary", "secondary record .* has no primary record"),
    ("drop_secondary", "primary record .* has no secondary record"),
    ("drop_name", "node number 2, which the node table lacks"),
    ("same_number", "share node number 1"),
    ("bad_tier", "tier byte 9"),
])
def test_a_checksum_valid_snapshot_whose_records_do_not_pair_is_refused(tmp_path, kind, damage, why):
    snap = _snapshot_path(tmp_path, kind)
    records = msgpack.unpackb(snap.read_bytes()[_HEAD.size:], raw=False)
    fam = {"drop_primary": b"B", "drop_secondary": b"N", "drop_name": b"Mn1\x00"}
    if damage in fam:
        records = [r for r in records if not r[0].startswith(fam[damage])]
    elif damage == "same_number":
        records = [[k, (1).to_bytes(4, "big")] if k == b"Mn1\x00" else [k, v] for k, v in records]
    else:
        records = [[k[:-1] + b"\x09", v] if k[:1] == b"B" else [k, v] for k, v in records]
    _write_body(snap, records)
    with pytest.raises(NotAnIndexError, match=why) as exc:
        open_index(kind, snap.parent)
    assert str(snap) in str(exc.value)


@pytest.mark.parametrize("kind", ["flat", "sorted"])
def test_snapshot_versions(tmp_path, kind):
    snap = _snapshot_path(tmp_path, kind)
    records = msgpack.unpackb(snap.read_bytes()[_HEAD.size:], raw=False)
    # format 1 (before checksums) is still read, and the next flush writes format 2
    snap.write_bytes(msgpack.packb({"magic": "quillcache-flat-index-v1", "records": records}, use_bin_type=True))
    ix = open_index(kind, snap.parent)
    assert ix.locate([7])[0][0].offset_bytes == 4096
    ix.close()
    assert snap.read_bytes()[:8] == MAGIC
    body = snap.read_bytes()[_HEAD.size:]
    snap.write_bytes(_HEAD.pack(MAGIC, 3, 0, crc32c.crc32c(body), len(body)) + body)
    with pytest.raises(NotAnIndexError, match=r"format version 3 is unknown \(this version reads 2 and 1\)"):
        open_index(kind, snap.parent)


@pytest.mark.parametrize("kind", sorted(INDEX_BACKENDS))
def test_a_secondary_without_its_primary_is_a_typed_error(tmp_path, kind):
    ix = open_index(kind, tmp_path / kind)
    e = entry(5, "n0")
    ix.put([e])
    no = ix._node_no["n0"]
    ix._raw_write((), [K.primary_key(5, no, int(e.tier), e.identity)])  # damage: the primary record is gone
    for call in (ix.entries_on_node, ix.remove_node):
        with pytest.raises(NotAnIndexError, match="secondary record .* has no primary record"):
            call("n0")


# ---- 3. zero runs in a WAL -----------------------------------------------------------------------------------


def _log_with_zero_tail(path, zeros: int) -> bytes:
    w = WalWriter.create(path, 1)
    for i in range(1000):
        w.append(b"x" * 100 + i.to_bytes(4, "little"))
    w.sync()
    w.close()
    good = path.read_bytes()
    path.write_bytes(good + bytes(zeros))
    return good


def _counting_checks(monkeypatch) -> list:
    calls = [0]
    real = walmod._check_at

    def counted(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(walmod, "_check_at", counted)
    return calls


@pytest.mark.parametrize("mode", ["point_in_time", "strict", "truncate", "salvage"])
def test_a_zero_filled_tail_is_skipped_without_a_check_per_byte(tmp_path, monkeypatch, mode):
    zeros = 4 << 20
    good = _log_with_zero_tail(tmp_path / "z.wal", zeros)
    want_report, want = scan_bytes(good, "z.wal", mode=mode)
    calls = _counting_checks(monkeypatch)
    report, recs = scan(tmp_path / "z.wal", mode=mode)
    assert recs == want and len(recs) == 1000
    assert (report.valid_bytes, report.dropped_bytes, report.last_lsn) == (len(good), zeros, want_report.last_lsn)
    assert calls[0] < 1100, calls[0]  # one per record (plus a few): not one per zero byte (4 Mi)


def test_an_art_index_with_a_zero_filled_log_tail_reopens_without_a_check_per_byte(tmp_path, monkeypatch):
    ix = open_index("art", tmp_path / "ix")
    for b in range(200):
        ix.put([entry(b * 8 + j, off=j) for j in range(8)])
    ix.flush()
    want = ix.scan_prefix(b"")
    ix._wal.close()  # power loss: no checkpoint at close
    ix._wal = None
    ix._dir_lock.release()  # (as the process's death would)
    with open(tmp_path / "ix" / WAL, "ab") as fh:
        fh.write(bytes(2 << 20))
    calls = _counting_checks(monkeypatch)
    with pytest.warns(UserWarning, match="dropped 2097152 bytes"):
        again = open_index("art", tmp_path / "ix")
    assert again.scan_prefix(b"") == want and calls[0] < 400, calls[0]
    again.close()


def _random_log(rng: random.Random) -> bytes:
    """A log with records, then zero runs, garbage and kept records in random order and sizes."""
    fs = CrashFs()
    fs.mkdir("/w")
    w = WalWriter.create("/w/a.wal", 1, fs=fs, group_bytes=1)
    for _ in range(rng.randrange(1, 40)):
        w.append(rng.randbytes(rng.randrange(0, 60)))
        if rng.random() < 0.2:
            w.sync()
    data = bytearray(fs.read_file("/w/a.wal"))
    for _ in range(rng.randrange(1, 4)):
        a = rng.randrange(walmod.HEADER_BYTES, len(data) + 1)
        n = rng.randrange(1, 600)
        fill = bytes(n) if rng.random() < 0.7 else rng.randbytes(n)
        data[a:a + n] = fill if rng.random() < 0.5 else data[a:a + n]
        if rng.random() < 0.5:
            data[a:a] = bytes(rng.randrange(1, 400))  # a zero hole in the middle
    return bytes(data)


def test_zero_run_skipping_finds_exactly_what_a_check_per_candidate_finds(monkeypatch):
    rng = random.Random(11)
    logs = [_random_log(rng) for _ in range(120)]

    def outcome(data: bytes, mode: str):
        try:
            return scan_bytes(data, "a.wal", mode=mode)
        except walmod.WalCorruptionError as exc:
            return str(exc)

    modes = ["point_in_time", "strict", "truncate", "salvage"]
    got = [[outcome(d, m) for m in modes] for d in logs]
    monkeypatch.setattr(walmod._Search, "_find", lambda self, pattern, at: self.raw.find(pattern, at))
    assert got == [[outcome(d, m) for m in modes] for d in logs]


def _wal_workload() -> tuple[CrashFs, int]:
    """A log on a CrashFs with unsynced records written after the last sync; (fs, durable lsn)."""
    fs = CrashFs()
    fs.mkdir("/w")
    w = WalWriter.create("/w/a.wal", 1, fs=fs, group_bytes=64)
    rng = random.Random(7)
    for i in range(300):
        w.append(rng.randbytes(rng.randrange(1, 200)))
        if i % 37 == 0:
            w.sync()
    w.write()
    return fs, w.durable_lsn


def test_crash_draws_without_zero_fill_are_those_of_before(monkeypatch):
    # recorded from CrashFs.crash before the zero-fill fate existed (same workload, epoch pinned)
    monkeypatch.setattr(secrets, "randbits", lambda k: 12345)
    fs, _ = _wal_workload()
    before = {0: ("33be8d6f5c2d499d", (1, 0, 1, 1, 0, 0)), 1: ("60537c1f3b9d1b20", (1, 1, 1, 0, 0, 0)),
              5: ("b63cda92dec9a6db", (0, 2, 1, 0, 0, 0)), 11: ("7b935431d2ffb451", (1, 0, 2, 0, 0, 0))}
    for seed, (digest, stats) in before.items():
        disk = copy.deepcopy(fs).crash(random.Random(seed))
        s = disk.last_crash
        assert hashlib.sha256(disk.read_file("/w/a.wal")).hexdigest()[:16] == digest
        assert (s.writes_kept, s.writes_dropped, s.writes_torn, s.writes_garbled, s.dir_ops_kept,
                s.dir_ops_lost, s.writes_zeroed) == stats + (0,)


def test_a_zero_filled_crash_loses_nothing_acknowledged():
    fs, durable = _wal_workload()
    acked = [r for r in scan_bytes(fs.read_file("/w/a.wal"), "a.wal")[1] if r[0] <= durable]
    assert len(acked) == durable > 200
    zeroed = 0
    for seed in range(60):
        disk = copy.deepcopy(fs).crash(random.Random(seed), zero_fill=True)
        zeroed += disk.last_crash.writes_zeroed
        _, recs = scan_bytes(disk.read_file("/w/a.wal"), "a.wal")
        assert recs[:len(acked)] == acked
    assert zeroed > 0


def test_the_zeroed_fate_lands_zero_bytes_where_the_write_was():
    seen = 0
    for seed in range(40):
        fs = CrashFs()
        fs.mkdir("/z")
        fd = fs.open("/z/f", "x")
        fs.fsync_dir("/z")
        fs.pwrite(fd, b"\xff" * 100, 0)  # the size grows; the data never reaches the disk when zeroed
        disk = fs.crash(random.Random(seed), zero_fill=True)
        if disk.last_crash.writes_zeroed:
            seen += 1
            assert disk.read_file("/z/f") == bytes(100)
    assert seen > 0


# ---- 4. closing an ART index whose log failed ----------------------------------------------------------------


def test_an_art_index_whose_fsync_failed_closes_once_and_releases_its_handles():
    fs = CrashFs()
    ix = open_index("art", "/x/ix", fs=fs)
    ix.put([entry(1)])
    fs.fail_next_fsync(1)
    with pytest.raises(WalFailedError, match="fsync failed"):
        ix.flush()
    with pytest.raises(WalFailedError, match="closed without a checkpoint because the log failed"):
        ix.close()
    ix.close()  # closed: nothing left to do
    assert not fs._fds
    with pytest.raises(IndexClosedError):
        ix.locate([1])


def test_an_fsync_failing_during_close_still_closes():
    fs = CrashFs()
    ix = open_index("art", "/y/ix", fs=fs)
    ix.put([entry(1)])
    fs.fail_next_fsync(1)  # close's checkpoint syncs the log first
    with pytest.raises(WalFailedError):
        ix.close()
    ix.close()
    assert not fs._fds


def test_an_art_index_with_a_mapped_checkpoint_releases_it_after_an_fsync_failure(tmp_path, monkeypatch):
    ix = open_index("art", tmp_path / "ix")
    ix.put([entry(h) for h in range(100)])
    ix.close()
    fds = len(os.listdir("/proc/self/fd"))
    ix = open_index("art", tmp_path / "ix")  # the checkpoint is mapped
    ix.put([entry(500)])

    def eio(fd):
        raise OSError(errno.EIO, "simulated EIO")

    monkeypatch.setattr(os, "fdatasync", eio)
    with pytest.raises(WalFailedError):
        ix.flush()
    monkeypatch.undo()
    with pytest.raises(WalFailedError):
        ix.close()
    assert ix._ckpt_buf is None and ix._wal is None and len(os.listdir("/proc/self/fd")) == fds


# ---- 5. a crash during a flat index's flush ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["flat", "sorted"])
@pytest.mark.parametrize("first", [True, False], ids=["first-flush", "later-flush"])
def test_a_temp_file_left_by_a_crash_during_a_flush_is_removed_at_open(tmp_path, monkeypatch, kind, first):
    ix = open_index(kind, tmp_path / kind)
    if not first:
        ix.put([entry(1)])
        ix.flush()
    ix.put([entry(2)])

    def die(*a):
        raise OSError(errno.EIO, "the process dies between the fsynced temp file and the rename")

    monkeypatch.setattr(os, "replace", die)
    with pytest.raises(OSError):
        ix.flush()
    monkeypatch.undo()
    assert (tmp_path / kind / (SNAPSHOT + ".tmp")).exists()
    again = open_index(kind, tmp_path / kind)
    assert len(again) == (0 if first else 1)
    assert not (tmp_path / kind / (SNAPSHOT + ".tmp")).exists()
    again.close()


# ---- 6. WAL payload buffers ------------------------------------------------------------------------------------


def test_a_wal_payload_is_logged_as_its_bytes_whatever_its_item_size(tmp_path):
    w = WalWriter.create(tmp_path / "w.wal", 1)
    wide = memoryview(array.array("I", [1, 2, 3, 4]))
    matrix = np.arange(6, dtype=np.uint16).reshape(2, 3)
    w.append(b"first")
    w.append(wide)
    w.append(matrix)
    w.append(memoryview(b"abc"))
    for bad, what in ((memoryview(b"abcdef")[::2], "non-contiguous"), ("text", "got str"),
                      (np.arange(8)[::2], "non-contiguous")):
        with pytest.raises(TypeError, match=what):
            w.append(bad)
    w.append(b"last")
    w.close()
    report, recs = scan(tmp_path / "w.wal")
    assert recs == [(1, b"first"), (2, wide.tobytes()), (3, matrix.tobytes()), (4, b"abc"), (5, b"last")]
    assert report.dropped_reason == ""


# ---- 7. edge inputs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(INDEX_BACKENDS))
def test_remove_takes_replica_keys_only_and_removes_nothing_otherwise(tmp_path, kind):
    ix = open_index(kind, tmp_path / kind)
    ix.put([entry(1), entry(2)])
    for bad in ([1], [entry(1).key, "n0"], [(1, "base", CacheTier.DRAM, bytes(16))]):
        with pytest.raises(TypeError, match="remove\\(\\) takes ReplicaKey or ResidencyEntry objects, got"):
            ix.remove(bad)
    assert len(ix) == 2
    assert ix.remove([entry(1).key, entry(2)]) == 2 and len(ix) == 0
    ix.close()


def _outcome(fn, *args):
    try:
        r = fn(*args)
    except (ValueError, TypeError, OverflowError) as exc:
        return type(exc).__name__, str(exc)
    return "ok", [np.asarray(x).tolist() for x in r] if isinstance(r, tuple) else r


def test_art_tree_u64_scans_agree_with_the_reference():
    t, r = ArtTree(2), ArtReference(2)
    for x in (t, r):
        for n in (1, 5, 2**64 - 1):
            x.insert(b"\x42" + n.to_bytes(8, "big") + b"\x01", b"vv")
    cases = [
        ("scan_u64_prefix_packed", (0x42, 5)), ("scan_u64_prefix_packed", (256, 1)),
        ("scan_u64_prefix_packed", (0, -1)), ("scan_u64_prefix_packed", (0x42, 2**64)),
        ("scan_u64_prefix_batch", (0x42, np.array([1, 5], np.int64), 10)),
        ("scan_u64_prefix_batch", (0x42, np.array([1, 5, 7], np.uint32), 10)),
        ("scan_u64_prefix_batch", (0x42, np.array([2**64 - 1, 1], np.uint64)[::-1], 10)),
        ("scan_u64_prefix_batch", (0x42, [5, 1], 10)),
        ("scan_u64_prefix_batch", (0x42, np.array([-1], np.int64), 10)),
        ("scan_u64_prefix_batch", (0x42, np.array([1.0]), 10)),
        ("scan_u64_prefix_batch", (0x42, np.zeros((2, 2), np.uint64), 10)),
        ("scan_u64_prefix_batch", (256, np.array([1], np.uint64), 10)),
        ("scan_u64_prefix_batch", (0x42, np.array([1], np.uint64), 8)),
        ("scan_u64_prefix_batch", (0x42, [2**64], 10)),
    ]
    for name, args in cases:
        got, want = _outcome(getattr(t, name), *args), _outcome(getattr(r, name), *args)
        assert got == want, (name, args, got, want)
    assert _outcome(t.scan_u64_prefix_batch, 0x42, np.array([1, 5], np.int64), 10)[0] == "ok"
    assert _outcome(t.scan_u64_prefix_packed, 256, 1) == ("OverflowError", "head=256 or number=1 out of range for u8/u64")
