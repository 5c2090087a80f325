"""Regression tests of the master review's findings (/tmp/s24/review_master.md #1-#8): each fails
without its fix."""

from __future__ import annotations

import logging
import os

import msgpack
import pytest

from quillcache.master import (
    InvalidParamsError, MasterConfig, MasterService, NoSpaceError, ObjectNotFoundError, PutRequest, SegmentDescriptor,
    SnapshotError,
)
from quillcache.master import validate
from quillcache.master.errors import RecordEncodeError
from quillcache.master.ha import _Groups, log_prefix
from quillcache.master.oplog import Op, decode_record, encode_batch, encode_record, join_encoded
from quillcache.master.state import MasterState
from quillcache.master.residency import IndexProjection
from quillcache.index import open_index
from tests.fd_helpers import fds_into

UNIT = 64
BAD = "bad\ud800"  # a lone surrogate: a Python str that is not valid UTF-8 (msgpack cannot write it)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def seg(node: str, sid: int, capacity_bytes: int = 16 * UNIT, **kw) -> SegmentDescriptor:
    return SegmentDescriptor(node_id=node, segment_id=sid, capacity_bytes=capacity_bytes, **kw)


def cfg(**kw) -> MasterConfig:
    base = dict(alignment_bytes=UNIT, index_kind="flat", snapshot_writer="inline", snapshot_every_s=86400.0)
    base.update(kw)
    return MasterConfig(**base)


def crash(m: MasterService) -> None:
    """What a SIGKILL leaves: the log as written (committed here), no close-time snapshot."""
    m._log.commit()
    m._log.close()
    m.index.close()
    m._dir_lock.release()


@pytest.fixture
def masters():
    """Services a test opens; each is closed at the end (a crashed one is skipped)."""
    opened: list[MasterService] = []
    yield opened
    for m in opened:
        if not m._closed and (m._log is None or not m._log._wal.closed):
            m.close()


# ---------------------------------------------------------------- #1 encode before apply
@pytest.mark.parametrize("data_dir", [False, True])
def test_an_unencodable_key_or_segment_is_refused_up_front_and_changes_nothing(tmp_path, masters, data_dir):
    clock = Clock()
    d = str(tmp_path / "m") if data_dir else None
    m = MasterService(cfg(), clock=clock, data_dir=d)
    masters.append(m)
    for bad in (seg("n\udc80", 7), seg("n1", 7, endpoint="e\ud800"), seg("n1", 7, transport="t\udfff"),
                seg("n1", 7, region_ids=(1 << 64,))):
        with pytest.raises(InvalidParamsError, match="UTF-8|region_ids"):
            m.mount_segment(bad)
    assert m.segments() == [] and m.lsn == (1 if data_dir else 0)  # (a data dir starts with its EPOCH record)
    m.mount_segment(seg("n0", 0))
    lsn = m.lsn
    for call in (lambda: m.put_start(BAD, 10), lambda: m.put_end(BAD), lambda: m.remove(BAD),
                 lambda: m.object_info(BAD)):
        with pytest.raises(InvalidParamsError, match="UTF-8"):
            call()
    out = m.batch_put_start([PutRequest(key="good", size_bytes=10), PutRequest(key=BAD, size_bytes=10)])
    assert isinstance(out[1], InvalidParamsError) and "UTF-8" in str(out[1]) and not isinstance(out[0], Exception)
    cols = m.batch_put_start_columns(["c1", BAD, "c2"], [10, 10, 10])  # the compiled path lets it through: the
    assert set(cols.errors) == {1} and "UTF-8" in str(cols.errors[1])  # reference then refuses it key by key
    assert sorted(m.keys()) == ["c1", "c2", "good"] and m.lsn == lsn + 2
    m.check_invariants()
    m.batch_put_end(["good", "c1", "c2"])
    if data_dir:
        m.close()
        r = MasterService(cfg(), clock=clock, data_dir=d)
        masters.append(r)
        assert sorted(r.keys()) == ["c1", "c2", "good"] and r.exists(["good", "c1", "c2"]) == [True] * 3


@pytest.mark.parametrize("data_dir", [False, True])
def test_a_record_that_cannot_be_encoded_is_refused_before_it_is_applied(tmp_path, masters, monkeypatch, data_dir):
    """The backstop behind the argument checks (disabled here): a record msgpack cannot write is refused
    with RecordEncodeError before it is applied, so memory and the log never disagree and the data
    dir reopens with what was acknowledged."""
    monkeypatch.setattr(validate, "utf8_ok", lambda s: True)
    clock = Clock()
    d = str(tmp_path / "m") if data_dir else None
    m = MasterService(cfg(), clock=clock, data_dir=d)
    masters.append(m)
    with pytest.raises(RecordEncodeError, match="MOUNT record cannot be written"):
        m.mount_segment(seg("n\udc80", 7))
    assert m.segments() == [] and m.clients() == []
    m.mount_segment(seg("n0", 0))
    lsn = m.lsn
    with pytest.raises(RecordEncodeError, match="PUT_START_MANY"):
        m.batch_put_start([PutRequest(key="good", size_bytes=10), PutRequest(key=BAD, size_bytes=10)])
    with pytest.raises(RecordEncodeError, match="PUT_START"):
        m.put_start(BAD, 10)
    with pytest.raises(RecordEncodeError):
        m.batch_put_start_columns(["c1", BAD], [10, 10])
    assert m.keys() == [] and m.lsn == lsn and m.failed is None
    assert m.segment_usage(0) == (0, 16 * UNIT)  # every range placed for the refused puts went back
    m.check_invariants()
    with pytest.raises(ObjectNotFoundError):
        m.put_end("good")  # (was: applied in memory, missing from the log)
    m.put_start("good", 10)
    m.put_end("good")
    assert m.lsn == lsn + 2
    if data_dir:
        m.close()
        r = MasterService(cfg(), clock=clock, data_dir=d)
        masters.append(r)
        assert r.keys() == ["good"] and r.lsn == lsn + 2


def test_join_encoded_is_byte_for_byte_encode_batch():
    recs = [[Op.PUT_END, 1, 2.5, "a"], [Op.EVICT, 1, 3.0, ["x", "y"]], [Op.RECLAIM_LISTED, 2, 1e300, ["z"], [[1, 64]]]]
    for n in (1, 2, 3):
        assert join_encoded(recs[:n], [encode_record(r) for r in recs[:n]]) == encode_batch(recs[:n])


def test_a_log_record_that_does_not_apply_is_a_snapshot_error_naming_its_lsn_and_op(tmp_path, masters):
    clock = Clock()
    d = str(tmp_path / "m")
    m = MasterService(cfg(), clock=clock, data_dir=d)
    m.mount_segment(seg("n0", 0))
    bad_lsn = m._log.append(encode_record([Op.PUT_END, 1, clock.t, "ghost"]))  # a PUT_END without its PUT_START
    crash(m)
    with pytest.raises(SnapshotError, match=rf"PUT_END at lsn {bad_lsn} does not apply.*KeyError"):
        MasterService(cfg(), clock=clock, data_dir=d)


# ---------------------------------------------------------------- #2 reads after LOG_FAILED: in
# test_master_service.py::test_failed_fsync_turns_the_master_read_only (reads of the failed call's key)

# ---------------------------------------------------------------- #3 follow() commits its local log
def test_follow_fsyncs_the_records_it_appends_to_the_local_log(tmp_path, masters):
    clock = Clock()
    d = str(tmp_path / "standby")
    standby = MasterService(cfg(), clock=clock, data_dir=d, replicate=lambda recs: None)
    masters.append(standby)
    recs = [(1, encode_record([Op.EPOCH, 1, 1000.0])),
            (2, encode_record([Op.MOUNT, 1, 1000.0, "n0", 0, 1 << 16, "", "tcp", [], 0])),
            (3, encode_record([Op.PUT_START, 1, 1000.0, "k", 10, 64, 0, 1800.0, None, 1, [[0, 0]]])),
            (4, encode_record([Op.PUT_END, 1, 1000.0, "k"]))]
    assert standby.follow(recs) == 4
    assert standby._log.durable_lsn == 4 and standby.durable_lsn == 4
    crash(standby)  # the standby dies: its data dir restarts on its own
    r = MasterService(cfg(), clock=clock, data_dir=d, replicate=lambda recs: None)
    masters.append(r)
    assert r.lsn == 4 and r.keys() == ["k"]


# ---------------------------------------------------------------- #4 a put that can never fit evicts nothing
def test_a_put_larger_than_every_segment_evicts_nothing():
    clock = Clock()
    m = MasterService(cfg(), clock=clock)
    for i in range(2):
        m.mount_segment(seg(f"n{i}", i, capacity_bytes=10 * UNIT))
    for j in range(10):
        m.put_start(f"obj{j}", UNIT)
        m.put_end(f"obj{j}")
    clock.t += 60  # leases over: every object is evictable; the cache is half full
    for _ in range(5):
        with pytest.raises(NoSpaceError, match="larger than every segment"):
            m.put_start("huge", 64 * UNIT)
    out = m.batch_put_start([PutRequest(key="huge", size_bytes=64 * UNIT), PutRequest(key="small", size_bytes=10)])
    assert isinstance(out[0], NoSpaceError) and not isinstance(out[1], Exception)
    assert len(m.keys()) == 11
    for j in range(10):  # fill it: a put that fits a segment once eviction ran still evicts (Mooncake)
        m.put_start(f"more{j}", UNIT)
    assert len(m.keys()) < 21


# ---------------------------------------------------------------- #5 cadence after restart counts changes
def test_a_restarted_master_counts_the_state_changes_of_its_log_tail(tmp_path, masters):
    clock = Clock()
    d = str(tmp_path / "m")
    c = cfg(snapshot_every_records=100, snapshot_growth=0.0, restart_budget_s=0.0, snapshot_inflight_records=0)
    m = MasterService(c, clock=clock, data_dir=d)
    m.mount_segment(seg("n0", 0, capacity_bytes=1 << 24))
    k = 0
    for crash_no in range(3):
        for _ in range(3):  # 90 changes per round: no snapshot is due before the crash...
            m.batch_put_start([PutRequest(key=f"k{k + i}", size_bytes=10) for i in range(30)])
            k += 30
        tail = m._log.records_since_rotate
        crash(m)
        m = MasterService(c, clock=clock, data_dir=d)
        masters.append(m)
        assert m._log.records_since_rotate == tail  # ...and the restart counts what the crashed master did
        assert tail <= 100 + 30  # snapshot_every_records + one call's changes: the documented bound holds


# ---------------------------------------------------------------- #6 RECLAIM replays what was decided
@pytest.mark.parametrize("restart_reclaim_s", [600.0, 1000.0, 100.0])
def test_reclaim_replays_the_same_whatever_the_restarting_config(tmp_path, masters, restart_reclaim_s):
    clock = Clock()
    d = str(tmp_path / "m")
    m = MasterService(cfg(zombie_reclaim_s=600.0, zombie_preempt_s=30.0), clock=clock, data_dir=d)
    m.mount_segment(seg("n0", 0, capacity_bytes=3 * UNIT))  # room for three objects
    m.put_start("zombie", UNIT)  # never ended: reclaimed at t0+600
    m.put_start("preempted", UNIT)
    clock.t += 60
    m.heartbeat("n0")
    m.put_start("preempted", UNIT)  # a zombie pre-empted: its old range stays taken until t0+600
    clock.t += 590  # t0+650: the zombie and the discarded range are due, the new "preempted" (t0+660) is not
    m.heartbeat("n0")
    rep = m.tick()
    assert rep.reclaimed_puts == ("zombie",) and rep.reclaimed_bytes == 2 * UNIT
    m.put_start("next", UNIT)  # reuses a reclaimed range
    m.put_end("next")
    want = {k: m.object_info(k).replicas[0].offset_bytes for k in m.keys()}
    crash(m)
    r = MasterService(cfg(zombie_reclaim_s=restart_reclaim_s, zombie_preempt_s=30.0), clock=clock, data_dir=d)
    masters.append(r)
    assert {k: r.object_info(k).replicas[0].offset_bytes for k in r.keys()} == want
    r.check_invariants()


def test_the_old_reclaim_record_is_still_read_with_its_old_meaning():
    st = MasterState(alignment=UNIT, max_allocs=1024, index=IndexProjection(open_index("flat", None)),
                     lease_ttl_s=10.0)
    st._reclaim_s = 600.0
    st.detach_space()  # (as a replay: the records carry the placements)
    st.apply(decode_record(encode_record([Op.MOUNT, 1, 1000.0, "n0", 0, 4 * UNIT, "", "tcp", [], 0])), 1)
    st.apply(decode_record(encode_record([Op.PUT_START, 1, 1000.0, "z", 10, UNIT, 0, 1.0, None, 1, [[0, 0]]])), 2)
    st.apply(decode_record(encode_record([Op.RECLAIM, 1, 1599.0])), 3)
    assert "z" in st.pending
    st.apply(decode_record(encode_record([Op.RECLAIM, 1, 1600.0])), 4)
    assert "z" not in st.pending and st.used_bytes == 0
    with pytest.raises(ValueError, match="not pending"):  # a listed reclaim naming nothing to reclaim
        st.apply(decode_record(encode_record([Op.RECLAIM_LISTED, 1, 1600.0, ["z"], []])), 5)


# ---------------------------------------------------------------- #7 an odd log group never stops following
@pytest.mark.parametrize("value", [msgpack.packb([1, 1, b"\xc1"], use_bin_type=True),  # chunk not msgpack
                                   msgpack.packb([1, 1, msgpack.packb(7)], use_bin_type=True),  # not an array
                                   msgpack.packb([1, 1, msgpack.packb([7])], use_bin_type=True),  # not bytes
                                   msgpack.packb([2, 1, msgpack.packb([b"r"])], use_bin_type=True)])  # count
def test_a_log_group_that_does_not_assemble_is_ignored_and_following_goes_on(value, caplog):
    base = log_prefix("/qc", "m")
    g = _Groups()
    with caplog.at_level(logging.WARNING, logger="quillcache.master.ha"):
        g.add(base, f"{base}{5:020d}/{1:020d}/{0:06d}", value)
    assert "ignoring key" in caplog.text and g.complete == {}
    g.add(base, f"{base}{1:020d}/{1:020d}/{0:06d}", msgpack.packb([1, 1, msgpack.packb([b"rec"])], use_bin_type=True))
    assert g.take(0) == [(1, b"rec")]


# ---------------------------------------------------------------- #8 a failed open leaves no file open
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
@pytest.mark.parametrize("damage", ["snapshot", "log"])
def test_a_failed_open_leaves_no_file_of_the_data_dir_open(tmp_path, damage):
    clock = Clock()
    d = str(tmp_path / "m")
    c = cfg(index_kind="art", index_on_disk=True)
    m = MasterService(c, clock=clock, data_dir=d)
    m.mount_segment(seg("n0", 0))
    m.put_start("k", 10)
    m.put_end("k")
    if damage == "snapshot":
        m.close()
        with open(os.path.join(d, "master.snap"), "r+b") as f:
            f.seek(30)
            f.write(b"\xff\xff")
    else:  # a tail record that does not apply (the index and the log are open when it fails)
        m._log.append(encode_record([Op.PUT_END, 1, clock.t, "ghost"]))
        crash(m)
    assert fds_into(d) == []
    for _ in range(3):
        with pytest.raises(SnapshotError):
            MasterService(c, clock=clock, data_dir=d)
    assert fds_into(d) == []
