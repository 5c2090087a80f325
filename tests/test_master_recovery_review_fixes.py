"""Review fixes of the master's log recovery: a damaged or torn last record that recovery drops (of the active
log, or of a sealed segment whose active log is missing) is kept aside in the data dir under a name that says
what it is (never overwritten by a later drop, never taken for a log file), logged as a WARNING naming the
file, the offset, the byte count and the expected LSN, and reported (``MasterService.recovery_report``,
``master_status()["recovery"]`` over RPC); a refusal of damage in the middle of the log says what an operator
can do (no ``mode='truncate'``, which the master does not offer); a gap after a damaged sealed segment says so;
a directory where a log or snapshot file should be is one line naming it."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_master_rpc import Server

from quillcache.durability.fs import RealFs
from quillcache.durability.wal import HEADER_BYTES, WalCorruptionError
from quillcache.master import MasterConfig, MasterService, ReplicaConfig, SegmentDescriptor
from quillcache.master.client import MasterClient
from quillcache.master import oplog
from quillcache.master.oplog import log_files, sealed_segments, segment_path
from quillcache.master.server import SingleMaster

ROOT = Path(__file__).resolve().parents[1]
UNIT = 64
EXIT_DEADLINE_S = 15.0  # a refused master exits within this


def _clock() -> float:
    return 1000.0


def _config() -> MasterConfig:
    return MasterConfig(alignment_bytes=UNIT, snapshot_every_records=10**6)


def _open(d: Path) -> MasterService:
    return MasterService(_config(), clock=_clock, data_dir=d)


def _crash(m: MasterService) -> None:
    """End ``m`` as a crash would: no snapshot, the tail stays in the log."""
    m._log.close()
    m.index.close()
    m._dir_lock.release()


def _killed_dir(d: Path, n: int = 5) -> None:
    """A data dir whose log holds a mount and ``n`` acknowledged puts (k0..k{n-1}) past the snapshot."""
    m = _open(d)
    m.mount_segment(SegmentDescriptor(node_id="n0", segment_id=0, capacity_bytes=64 * UNIT, endpoint="n0:1"))
    for i in range(n):
        m.put_start(f"k{i}", UNIT, ReplicaConfig(replica_num=1))
        m.put_end(f"k{i}")
    _crash(m)


def _flip_last(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[-1] ^= 0x01
    p.write_bytes(bytes(data))


def _cut(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-3])


def _dropped_files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if ".dropped-" in p.name)


# ------------------------------------------------------------------------------ M1: a dropped tail of master.wal
@pytest.mark.parametrize("damage", [pytest.param(_flip_last, id="bit-flip"), pytest.param(_cut, id="torn")])
def test_a_dropped_last_record_of_the_log_is_kept_aside_logged_and_reported(tmp_path, caplog, damage):
    d = tmp_path / "d"
    _killed_dir(d)
    wal = d / "master.wal"
    before = wal.read_bytes()
    damage(wal)
    damaged = wal.read_bytes()
    with caplog.at_level(logging.WARNING, logger="quillcache.master"):
        m = _open(d)
    try:
        assert m.exists(["k3", "k4"]) == [True, False]  # the last put_end is what was dropped
        rep = m.recovery_report
        assert not rep.clean and rep.records == m.recovered_records
        (drop,) = rep.dropped
        assert isinstance(drop, oplog.DroppedTail)
        assert drop.path == str(wal) and drop.expected_lsn == m.lsn + 1
        assert drop.num_bytes == len(damaged) - drop.offset > 0
        assert os.path.getsize(wal) == drop.offset  # the log was cut back there
        assert before[:drop.offset] == damaged[:drop.offset]
        kept = Path(drop.kept_as)
        assert kept.parent == d and kept.name == f"master.wal.dropped-{drop.expected_lsn}-{drop.offset}"
        assert kept.read_bytes() == damaged[drop.offset:]  # every dropped byte, unchanged
        (rec,) = [r for r in caplog.records if r.levelno == logging.WARNING and "dropped" in r.getMessage()]
        msg = rec.getMessage()
        for part in (str(wal), f"{drop.num_bytes} bytes", f"at byte {drop.offset}", f"lsn {drop.expected_lsn}",
                     str(kept)):
            assert part in msg, (part, msg)
        status = SingleMaster(m).status()  # what master_status() answers over RPC
        assert status["recovery"] == {"clean": False, "records": m.recovered_records, "dropped": [drop.as_dict()]}
    finally:
        m.close()
    with _open(d) as m2:  # the kept file is no part of the log: the next start is clean and keeps it
        assert m2.recovery_report.clean and m2.exists(["k3"]) == [True]
    assert kept.read_bytes() == damaged[drop.offset:]


def test_a_clean_restart_reports_clean_and_a_master_without_data_dir_has_no_report(tmp_path):
    d = tmp_path / "d"
    _killed_dir(d)
    with _open(d) as m:
        assert m.recovery_report.clean and m.recovery_report.records == m.recovered_records > 0
        assert SingleMaster(m).status()["recovery"]["dropped"] == []
    assert not _dropped_files(d)
    with MasterService(_config(), clock=_clock) as m:
        assert m.recovery_report is None and SingleMaster(m).status()["recovery"] is None


def test_a_later_drop_at_the_same_place_never_overwrites_the_earlier_one(tmp_path):
    d = tmp_path / "d"
    _killed_dir(d)
    wal = d / "master.wal"
    _flip_last(wal)
    first = wal.read_bytes()
    _crash(_open(d))
    data = bytearray(first)  # the same place damaged again, with other bytes
    data[-2] ^= 0x10
    wal.write_bytes(bytes(data))
    _crash(_open(d))
    wal.write_bytes(first)
    with _open(d) as m:
        (drop,) = m.recovery_report.dropped
    kept = _dropped_files(d)
    base = f"master.wal.dropped-{drop.expected_lsn}-{drop.offset}"
    assert [p.name for p in kept] == [base, f"{base}-1", f"{base}-2"]
    assert [p.read_bytes() for p in kept] == [first[drop.offset:], bytes(data[drop.offset:]), first[drop.offset:]]


def test_kept_files_are_never_taken_for_log_files_nor_deleted_by_snapshots(tmp_path):
    d = tmp_path / "d"
    _killed_dir(d)
    _flip_last(d / "master.wal")
    with _open(d) as m:
        kept = Path(m.recovery_report.dropped[0].kept_as)
        m._log.seal()  # a sealed segment next to the kept file
        assert [p for _, p in sealed_segments(str(d), RealFs())] == [segment_path(str(d), 1)]
        assert str(kept) not in log_files(str(d), RealFs())  # (what an HA standby deletes to install a snapshot)
        m.put_start("k9", UNIT, ReplicaConfig(replica_num=1))
        m.put_end("k9")
        m.snapshot()  # rotates the log and deletes the segments the snapshot covers
        assert sealed_segments(str(d), RealFs()) == []
    assert kept.exists()
    with _open(d) as m:
        assert m.recovery_report.clean and m.exists(["k9"]) == [True]


# ------------------------------------------------------------------- M1: the double fault (sealed tail, no active)
def _sealed_without_active(d: Path) -> Path:
    """A sealed segment holding every record, whose last record is damaged, and no active log (a crash between
    sealing and creating the next active file, on top of damage)."""
    _killed_dir(d)
    m = _open(d)
    m._log.seal()
    _crash(m)
    seg = Path(sealed_segments(str(d), RealFs())[-1][1])
    os.unlink(d / "master.wal")
    _flip_last(seg)
    return seg


def test_a_damaged_last_record_of_a_sealed_segment_with_the_active_log_missing_is_reported(tmp_path, caplog):
    d = tmp_path / "d"
    seg = _sealed_without_active(d)
    damaged = seg.read_bytes()
    with caplog.at_level(logging.WARNING, logger="quillcache.master"):
        m = _open(d)
    try:
        assert m.exists(["k3", "k4"]) == [True, False]
        (drop,) = m.recovery_report.dropped
        assert drop.path == str(seg) and drop.num_bytes == len(damaged) - drop.offset > 0
        kept = Path(drop.kept_as)
        assert kept.name == f"{seg.name}.dropped-{drop.expected_lsn}-{drop.offset}"
        assert kept.read_bytes() == damaged[drop.offset:]
        msg = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
        assert str(seg) in msg and f"lsn {drop.expected_lsn}" in msg and str(kept) in msg
        assert [p for _, p in sealed_segments(str(d), RealFs())] == [str(seg)]  # the kept file is not a segment
    finally:
        m.close()  # snapshot: the segment is deleted, the kept bytes stay
    assert not seg.exists() and kept.read_bytes() == damaged[drop.offset:]


def test_a_gap_after_a_damaged_sealed_segment_names_the_damage(tmp_path):
    d = tmp_path / "d"
    _killed_dir(d)
    m = _open(d)
    m._log.seal()
    _crash(m)
    seg = Path(sealed_segments(str(d), RealFs())[-1][1])
    _flip_last(seg)
    with pytest.raises(ValueError, match=r"records \d+\.\.\d+ are missing \(the previous segment's tail is damaged: "
                                         r"bad or torn record at byte \d+"):
        _open(d)
    assert not _dropped_files(d)  # a refused start writes nothing


# ------------------------------------------------------------------------------ the mid-log refusal's advice
def _damage_middle(d: Path) -> int:
    """Flip a byte of a record in the middle of master.wal; returns that record's offset (where recovery cuts)."""
    wal = d / "master.wal"
    data = bytearray(wal.read_bytes())
    data[len(data) // 2] ^= 0x01
    wal.write_bytes(bytes(data))
    return len(data) // 2


def test_a_mid_log_refusal_says_what_an_operator_can_do_and_the_advice_works(tmp_path):
    d = tmp_path / "d"
    _killed_dir(d)
    _damage_middle(d)
    wal = d / "master.wal"
    with pytest.raises(WalCorruptionError) as err:
        _open(d)
    msg = str(err.value)
    assert "mode=" not in msg and "damaged in the middle" in msg and str(d) in msg
    at = int(msg.split("truncate -s ")[1].split()[0])
    assert f"truncate -s {at} {wal}" in msg and "accepting the loss of every record from lsn" in msg
    lost = int(msg.split("every record from lsn ")[1].split()[0])
    os.truncate(wal, at)  # what the message says to do (after keeping a copy)
    with _open(d) as m:
        assert m.recovery_report.clean and m.lsn == lost - 1


def test_a_mid_segment_refusal_names_the_later_log_files_to_move_aside(tmp_path):
    d = tmp_path / "d"
    _killed_dir(d)
    m = _open(d)
    m._log.seal()
    _crash(m)
    seg = Path(sealed_segments(str(d), RealFs())[-1][1])
    data = bytearray(seg.read_bytes())
    data[HEADER_BYTES + (len(data) - HEADER_BYTES) // 2] ^= 0x01
    seg.write_bytes(bytes(data))
    with pytest.raises(WalCorruptionError) as err:
        _open(d)
    msg = str(err.value)
    assert "mode=" not in msg and f"{seg}" in msg and "move the later log files aside (master.wal" in msg


def _run_master(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quillcache", "master", *args], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=EXIT_DEADLINE_S)


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_the_cli_prints_the_advice_in_one_line(tmp_path):
    d = tmp_path / "d"
    _killed_dir(d)
    _damage_middle(d)
    res = _run_master("--data-dir", str(d))
    line = _one_line(res.stderr)
    assert res.returncode == 1 and "mode=" not in line and "truncate -s " in line and f"{d}/master.wal" in line


# ------------------------------------------------------------------------------------- over RPC
def test_master_status_over_rpc_reports_the_drop(tmp_path):
    d = tmp_path / "d"
    _killed_dir(d)
    _flip_last(d / "master.wal")
    s = Server(d, "--client-ttl-s", "3600")
    try:
        with MasterClient(s.address) as c:
            rec = c.master_status()["recovery"]
        assert rec["clean"] is False and len(rec["dropped"]) == 1
        assert rec["dropped"][0]["kept_as"] == str(_dropped_files(d)[0])
        assert rec["dropped"][0]["path"] == str(d / "master.wal")
    finally:
        s.close()


# -------------------------------------------------------------- L2: a directory where a file should be, in one line
@pytest.mark.parametrize("name", ["master.wal", "master.snap", "master.wal.00000000000000000001"])
def test_a_directory_where_a_master_file_should_be_is_one_line_naming_it(tmp_path, name):
    d = tmp_path / "d"
    with _open(d) as m:
        m.mount_segment(SegmentDescriptor(node_id="n0", segment_id=0, capacity_bytes=64 * UNIT, endpoint="n0:1"))
    p = d / name
    if p.exists():
        os.unlink(p)
    os.mkdir(p)
    res = _run_master("--data-dir", str(d))
    line = _one_line(res.stderr)
    assert res.returncode == 1 and str(p) in line, line
    shutil.rmtree(p)
