"""The write-ahead log: round trip, torn tails, mid-log damage, modes, epochs, fsync and write
failures, and power loss at every sync point of a short run (on CrashFs)."""

import errno
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.durability import wal as W
from quillcache.durability.crashfs import CrashFs, SimulatedCrash


def _write(path, payloads, sync_every=None):
    w = W.WalWriter.create(path, base_lsn=1, group_bytes=1)
    for i, p in enumerate(payloads, 1):
        w.append(p)
        if sync_every and i % sync_every == 0:
            w.sync()
    return w


def test_round_trip(tmp_path):
    path = tmp_path / "log"
    w = _write(path, [b"a", b"", b"c" * 1000])
    w.close()
    report, recs = W.scan(path)
    assert recs == [(1, b"a"), (2, b""), (3, b"c" * 1000)]
    assert report.dropped_bytes == 0 and report.last_lsn == 3
    w2 = W.WalWriter.reopen(path, report)
    assert w2.append(b"d") == 4
    w2.close()
    assert [r for _, r in W.scan(path)[1]] == [b"a", b"", b"c" * 1000, b"d"]


@given(cut=st.integers(min_value=0, max_value=10_000), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None)
def test_any_truncation_or_garbage_after_the_durable_point_keeps_exactly_the_acknowledged(tmp_path_factory, cut, seed):
    path = tmp_path_factory.mktemp("w") / "log"
    w = _write(path, [bytes([i]) * 40 for i in range(10)])
    w.sync()
    durable = w.durable_bytes
    for i in range(10, 20):  # unacknowledged appends, written (group_bytes=1) but never synced
        w.append(bytes([i]) * 40)
    w.write()
    data = bytearray(path.read_bytes())
    rng = random.Random(seed)
    tail_len = len(data) - durable
    mode = seed % 3
    if mode == 0:  # torn: cut anywhere after the durable point
        data = data[: durable + cut % (tail_len + 1)]
    elif mode == 1:  # garble one unsynced byte
        i = durable + cut % tail_len
        data[i] ^= 1 + rng.randrange(255)
    else:  # replace the unsynced tail with garbage
        data = data[:durable] + rng.randbytes(cut % 300)
    path.write_bytes(bytes(data))
    report, recs = W.scan(path)
    acked = [(i + 1, bytes([i]) * 40) for i in range(10)]
    assert recs[:10] == acked
    # anything recovered past the durable point is an intact prefix of what was appended
    assert recs[10:] == [(i + 1, bytes([i]) * 40) for i in range(10, 10 + len(recs) - 10)]
    if mode == 0 and cut % (tail_len + 1) < tail_len or mode == 1:
        assert len(recs) < 20  # a cut or garbled record is never returned
    if mode == 0:
        assert report.valid_bytes <= len(data)


def test_damage_to_an_acknowledged_record_is_refused(tmp_path):
    path = tmp_path / "log"
    w = _write(path, [b"x" * 50 for _ in range(6)], sync_every=1)
    w.close()
    data = bytearray(path.read_bytes())
    data[W.HEADER_BYTES + 5] ^= 0xFF  # inside record 1's header/payload; later records say it was acked
    path.write_bytes(bytes(data))
    with pytest.raises(W.WalCorruptionError, match="acknowledged"):
        W.scan(path)
    report, recs = W.scan(path, mode="truncate")
    assert recs == [] and "dropped" in report.dropped_reason


def test_strict_refuses_any_valid_record_after_a_bad_one(tmp_path):
    path = tmp_path / "log"
    w = _write(path, [b"y" * 50 for _ in range(4)])  # nothing synced: all unacknowledged
    w.write()
    data = bytearray(path.read_bytes())
    data[W.HEADER_BYTES + W.RECORD_HEADER_BYTES + 3] ^= 0x10
    path.write_bytes(bytes(data))
    assert W.scan(path)[1] == []  # point-in-time: unacknowledged, dropped
    with pytest.raises(W.WalCorruptionError, match="valid record"):
        W.scan(path, mode="strict")


def test_records_of_another_epoch_never_validate(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a, [b"old"] * 3).close()
    _write(b, [b"new"]).close()
    # splice a's records after b's header: same LSNs, other epoch
    spliced = b.read_bytes()[: W.HEADER_BYTES] + a.read_bytes()[W.HEADER_BYTES :]
    b.write_bytes(spliced)
    report, recs = W.scan(b)
    assert recs == []


def test_header_damage_and_bad_mode(tmp_path):
    path = tmp_path / "log"
    _write(path, [b"z"]).close()
    data = bytearray(path.read_bytes())
    data[10] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(W.WalCorruptionError, match="header checksum"):
        W.scan(path)
    path.write_bytes(b"garbage" * 10)
    with pytest.raises(W.WalCorruptionError, match="not a QuillCache WAL"):
        W.scan(path)
    with pytest.raises(ValueError, match="recovery mode"):
        W.scan(path, mode="yolo")


def test_fsync_failure_turns_the_log_read_only(tmp_path, monkeypatch):
    w = _write(tmp_path / "log", [b"a"])

    def boom(fd):
        raise OSError(5, "EIO")

    monkeypatch.setattr(os, "fdatasync", boom)
    with pytest.raises(W.WalFailedError, match="not retrying"):
        w.sync()
    monkeypatch.undo()
    with pytest.raises(W.WalFailedError):
        w.append(b"b")
    with pytest.raises(W.WalFailedError):
        w.sync()
    w.close()


# ------------------------------------------------------------------ on the crash simulator
_PAYLOADS = [bytes([i]) * (i * 7 % 50) for i in range(30)]


def _crashfs_run(crash_at: int | None) -> tuple[CrashFs, int]:
    """Append the payloads (syncing every 4th) until power is lost: ``(fs, records acknowledged)``."""
    fs = CrashFs(crash_at_sync=crash_at)
    fs.mkdir("/w")
    acked = 0
    try:
        w = W.WalWriter.create("/w/log", 1, fs=fs, group_bytes=64)  # several unsynced writes per sync
        for i, p in enumerate(_PAYLOADS, 1):
            w.append(p)
            if i % 4 == 0:
                w.sync()
                acked = i
        w.close()
        acked = len(_PAYLOADS)
    except SimulatedCrash:
        pass
    return fs, acked


def test_a_crash_at_every_sync_point_loses_no_acknowledged_record():
    total_syncs = _crashfs_run(None)[0].sync_calls
    assert total_syncs >= 9
    outcomes = set()
    for crash_at in range(1, total_syncs + 2):  # + 1: the run completes, then power is lost
        for seed in range(8):
            fs, acked = _crashfs_run(crash_at)
            disk = fs.crash(random.Random(seed * 1000 + crash_at))
            if not disk.exists("/w/log"):  # the crash came before the new log's name was durable
                assert acked == 0, crash_at
                outcomes.add("no log")
                continue
            report, recs = W.scan("/w/log", fs=disk)
            assert len(recs) >= acked, (crash_at, seed, report)
            assert recs == [(i, p) for i, p in enumerate(_PAYLOADS[: len(recs)], 1)]  # an intact prefix
            outcomes.add("more than acked" if len(recs) > acked else "exactly acked")
            w = W.WalWriter.reopen("/w/log", report, fs=disk)  # and the log goes on after recovery
            assert w.append(b"after") == len(recs) + 1
            w.close()
            assert W.scan("/w/log", fs=disk)[1][-1] == (len(recs) + 1, b"after")
    assert outcomes == {"no log", "exactly acked", "more than acked"}


def test_salvage_skips_a_damaged_record_and_reports_its_lsns(tmp_path):
    path = tmp_path / "log"
    w = _write(path, [bytes([i]) * 50 for i in range(6)], sync_every=1)
    w.close()
    data = bytearray(path.read_bytes())
    record_bytes = W.RECORD_HEADER_BYTES + 50
    data[W.HEADER_BYTES + 2 * record_bytes + 30] ^= 0xFF  # inside record 3's payload
    path.write_bytes(bytes(data))
    with pytest.raises(W.WalCorruptionError, match="acknowledged"):
        W.scan(path)  # point in time: later records prove lsn 3 was acknowledged
    report, recs = W.scan(path, mode="salvage")
    assert [lsn for lsn, _ in recs] == [1, 2, 4, 5, 6] and recs[2] == (4, bytes([3]) * 50)
    assert report.damaged_lsns == ((3, 3),) and report.last_lsn == 6 and report.dropped_reason == ""
    path.write_bytes(bytes(data[:-10]))  # and a torn tail too: the tail is dropped, the hole reported
    report, recs = W.scan(path, mode="salvage")
    assert [lsn for lsn, _ in recs] == [1, 2, 4, 5] and report.damaged_lsns == ((3, 3),)
    assert "torn" in report.dropped_reason and report.valid_bytes == W.HEADER_BYTES + 5 * record_bytes


@pytest.mark.parametrize("policy", ["fail", "rollback"])
def test_a_failed_write_is_undone(policy):
    fs = CrashFs()
    fs.mkdir("/w")
    w = W.WalWriter.create("/w/log", 1, fs=fs, on_write_error=policy)
    w.append(b"a" * 100)
    w.sync()
    durable_size = fs.stat("/w/log").size_bytes
    fs.disk_bytes = fs.used_bytes + 50  # the next write lands partially, then ENOSPC
    w.append(b"b" * 100)
    w.append(b"c" * 100)
    with pytest.raises(W.WalWriteError if policy == "rollback" else W.WalFailedError) as ei:
        w.sync()
    assert isinstance(ei.value, OSError) and ei.value.errno == errno.ENOSPC
    assert fs.stat("/w/log").size_bytes == durable_size  # the partial write was truncated away
    fs.disk_bytes = None
    if policy == "fail":
        assert w.failed is not None
        with pytest.raises(W.WalFailedError, match="read-only"):
            w.append(b"d")
        w.close()
        assert W.scan("/w/log", fs=fs)[1] == [(1, b"a" * 100)]
        return
    assert ei.value.lost_lsns == (2, 3) and w.failed is None
    assert w.append(b"d") == 2
    w.close()
    assert W.scan("/w/log", fs=fs)[1] == [(1, b"a" * 100), (2, b"d")]


def test_fsync_failure_on_crashfs_is_never_retried():
    fs = CrashFs()
    fs.mkdir("/w")
    w = W.WalWriter.create("/w/log", 1, fs=fs)
    w.append(b"a")
    fs.fail_next_fsync()
    with pytest.raises(W.WalFailedError, match="not retrying") as ei:
        w.sync()
    assert ei.value.errno == errno.EIO
    syncs = fs.sync_calls
    with pytest.raises(W.WalFailedError):
        w.sync()
    assert fs.sync_calls == syncs  # refused without touching the disk
    with pytest.raises(ValueError, match="on_write_error"):
        W.WalWriter.create("/w/other", 1, fs=fs, on_write_error="ignore")


# ---- hostile logs: recovery work is linear in the file, LSNs near 2**64 are plain values -----------


def _count_checksummed(monkeypatch) -> list[int]:
    """Count the payload bytes recovery checksums (the work that used to be quadratic)."""
    seen = [0]
    real = W._record_crc

    def counting(epoch, lsn, durable, payload):
        seen[0] += len(payload)
        return real(epoch, lsn, durable, payload)

    monkeypatch.setattr(W, "_record_crc", counting)
    return seen


@pytest.mark.parametrize("size_bytes", [64 << 10, 256 << 10])
def test_fake_record_headers_cost_a_bounded_multiple_of_the_file(monkeypatch, size_bytes):
    from experiments.recovery_bench import fake_header_image

    image = fake_header_image(size_bytes, random.Random(size_bytes))
    seen = _count_checksummed(monkeypatch)
    with pytest.raises(W.WalCorruptionError, match="whether an acknowledged record follows cannot be told"):
        W.scan_bytes(image, "fake.wal")  # point_in_time: cannot prove nothing acknowledged follows -> refuse
    report, records = W.scan_bytes(image, "fake.wal", mode="salvage")  # a cache's log: drop and say so
    assert records == [] and "gave up the search" in report.dropped_reason
    # each fake header claims the rest of the file; checking them all would be ~size**2 / 48 bytes
    assert seen[0] <= 2 * (W.SEARCH_BUDGET_FACTOR * size_bytes + (16 << 20)) + 2 * size_bytes


def test_salvage_of_a_log_damaged_in_every_second_record_recovers_the_rest_in_linear_work(monkeypatch):
    from experiments.recovery_bench import ssd_log_image

    for n in (200, 800):
        image = ssd_log_image(n, damage=True, rng=random.Random(n))
        seen = _count_checksummed(monkeypatch)
        report, records = W.scan_bytes(image, "ssd.log", mode="salvage")
        assert [lsn for lsn, _ in records] == list(range(1, n + 1, 2))  # every intact record, in order
        assert len(report.damaged_lsns) == n // 2 - (1 if n % 2 == 0 else 0)
        assert seen[0] <= 2 * len(image)  # each byte about once (the damaged records are skipped unread)


def test_lsns_near_the_end_of_the_64_bit_space(tmp_path):
    top = W.MAX_LSN
    w = W.WalWriter.create(tmp_path / "top.wal", top - 1)
    assert w.append(b"a") == top - 1 and w.append(b"b") == top
    with pytest.raises(W.WalError, match="LSN space is exhausted"):
        w.append(b"c")  # was struct.error
    w.close()
    report, records = W.scan(tmp_path / "top.wal")
    assert [lsn for lsn, _ in records] == [top - 1, top] and report.last_lsn == top
    with open(tmp_path / "top.wal", "ab") as fh:  # garbage after the last record: searched without overflow
        fh.write(os.urandom(200))
    for mode in W.RECOVERY_MODES:
        report, records = W.scan(tmp_path / "top.wal", mode=mode)
        assert [lsn for lsn, _ in records] == [top - 1, top]
    header_only = W.encode_header(12345, top) + os.urandom(300)  # was OverflowError
    assert W.scan_bytes(header_only, "h.wal", mode="salvage")[1] == []
    for bad in (0, -1, top + 1, 1.0, True):
        with pytest.raises(ValueError, match="base_lsn must be an int"):
            W.WalWriter.create(tmp_path / "bad.wal", bad)


def test_the_writer_is_a_context_manager_that_syncs_on_exit(tmp_path):
    with W.WalWriter.create(tmp_path / "cm.wal", 1) as w:
        w.append(b"one")
    assert w.closed
    assert [p for _, p in W.scan(tmp_path / "cm.wal")[1]] == [b"one"]
