"""Unit tests of ``MasterService``: each semantic of the brief, bad input, and crash safety of the
operation log (CrashFs power loss, a truncated WAL, and SIGKILLs of a child process)."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from quillcache.durability.crashfs import CrashFs
from quillcache.master import (
    ErrorCode, InvalidParamsError, LeaseHeldError, LogFailedError, MasterConfig, MasterError, MasterService,
    NeedRemountError, NoSpaceError, ObjectExistsError, ObjectNotFoundError, ObjectNotReadyError, ObjectStatus,
    PinKind, PutRequest, PutStartResult, ReplicaConfig, ReplicaDescriptor, SegmentDescriptor, SegmentExistsError,
    SegmentNotFoundError, SnapshotError, StaleEpochError, kv_object_key, residency_key,
)
from quillcache.master.oplog import Op, encode_record
from quillcache.master.types import MAX_DURATION_S
from quillcache.master.snapshot import SNAPSHOT_NAME, encode_state, publish_snapshot
from quillcache.master.snapshot_writer import SNAPSHOT_WRITERS, SnapshotOutcome, SnapshotWriter

UNIT = 64


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def seg(node: str, sid: int, units: int = 16) -> SegmentDescriptor:
    return SegmentDescriptor(node_id=node, segment_id=sid, capacity_bytes=units * UNIT, endpoint=f"{node}:7000",
                             transport="tcp", region_ids=(sid,))


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make(clock: Clock, nodes: int = 3, units: int = 16, **cfg) -> MasterService:
    m = MasterService(MasterConfig(alignment_bytes=UNIT, index_kind="flat", **cfg), clock=clock)
    for i in range(nodes):
        m.mount_segment(seg(f"n{i}", i, units))
    return m


def put(m: MasterService, key: str, size: int = UNIT, n: int = 1, **kw):
    r = m.put_start(key, size, ReplicaConfig(replica_num=n), **kw)
    m.put_end(key)
    return r


# ---------------------------------------------------------------------------------------- puts
def test_put_start_places_replicas_on_distinct_nodes(clock):
    m = make(clock)
    m.mount_segment(seg("n0", 10))  # a second segment on n0: never two replicas on one node
    r = m.put_start("k", 100, ReplicaConfig(replica_num=3))
    assert len(r.replicas) == 3 and len({d.node_id for d in r.replicas}) == 3
    assert all(d.size_bytes == 100 and d.transport == "tcp" for d in r.replicas)
    assert not r.existing


def test_more_replicas_than_nodes_gives_fewer_replicas(clock):
    m = make(clock, nodes=2)
    r = m.put_start("k", 100, ReplicaConfig(replica_num=5))
    assert len(r.replicas) == 2


def test_preferred_segment_first(clock):
    m = make(clock)
    r = m.put_start("k", 10, ReplicaConfig(replica_num=1, preferred_segment=2))
    assert [d.segment_id for d in r.replicas] == [2]


def test_pending_object_is_not_readable_until_put_end(clock):
    m = make(clock)
    m.put_start("k", 10)
    [out] = m.get_replicas(["k"])
    assert isinstance(out, ObjectNotReadyError) and out.code == ErrorCode.OBJECT_NOT_READY
    assert m.exists(["k"]) == [False]
    assert m.index.locate([residency_key("k")[0]]) == [[]]  # the planner does not see it either
    m.put_end("k")
    assert m.exists(["k"]) == [True]
    [reps] = m.get_replicas(["k"])
    [rows] = m.index.locate([residency_key("k")[0]])
    assert [(e.node, e.segment_id, e.offset_bytes) for e in rows] == [(d.node_id, d.segment_id, d.offset_bytes)
                                                                       for d in reps]


def test_put_revoke_frees_space(clock):
    m = make(clock, nodes=1, units=1)
    m.put_start("k", 10)
    with pytest.raises(NoSpaceError):
        m.put_start("k2", 10)
    m.put_revoke("k")
    m.put_start("k2", 10)
    with pytest.raises(ObjectNotFoundError):
        m.put_end("k")


def test_put_end_and_revoke_errors(clock):
    m = make(clock)
    with pytest.raises(ObjectNotFoundError, match="'nope'"):
        m.put_end("nope")
    with pytest.raises(ObjectNotFoundError):
        m.put_revoke("nope")
    put(m, "k")
    with pytest.raises(ObjectExistsError, match="already complete"):
        m.put_end("k")
    with pytest.raises(InvalidParamsError, match="use remove"):
        m.put_revoke("k")


def test_existing_key_without_same_digest_is_refused(clock):
    m = make(clock)
    put(m, "k", digest=b"d1")
    with pytest.raises(ObjectExistsError, match="'k'"):
        m.put_start("k", 10)
    with pytest.raises(ObjectExistsError):
        m.put_start("k", 10, digest=b"d2")


def test_same_digest_returns_existing_in_flight_and_complete(clock):
    m = make(clock)
    first = m.put_start("k", 10, ReplicaConfig(replica_num=2), digest=b"same")
    again = m.put_start("k", 10, ReplicaConfig(replica_num=2), digest=b"same")
    assert again.existing and again.replicas == first.replicas and again.put_id == first.put_id
    m.put_end("k")
    third = m.put_start("k", 10, digest=b"same")
    assert third.existing and third.replicas == first.replicas


def test_zombie_put_is_preempted_after_30s_and_reclaimed_after_600s(clock):
    m = make(clock, nodes=1, units=2)
    old = m.put_start("k", 10)
    clock.t += 29.0
    with pytest.raises(ObjectExistsError, match="being written"):
        m.put_start("k", 10)
    clock.t += 1.0
    new = m.put_start("k", 10)  # pre-empts the zombie
    assert new.put_id != old.put_id
    assert m.segment_usage(0)[0] == 2 * UNIT  # the zombie's range is kept: its writer may still write
    with pytest.raises(ObjectNotFoundError, match="pre-empted"):
        m.put_end("k", put_id=old.put_id)  # the zombie's late put_end cannot complete its successor
    m.put_end("k", put_id=new.put_id)
    clock.t += 600.0 - 30.0
    m.heartbeat("n0")
    report = m.tick()
    assert report.reclaimed_bytes == UNIT and m.segment_usage(0)[0] == UNIT
    m.put_start("p", 10)  # never ended: reclaimed 600 s after its start
    clock.t += 600.0
    m.heartbeat("n0")
    assert m.tick().reclaimed_puts == ("p",)
    assert "p" not in m.keys()


# ---------------------------------------------------------------------------------------- reads, leases
def test_get_grants_lease_max_and_exists_does_not(clock):
    m = make(clock)
    put(m, "k")
    assert m.exists(["k"]) == [True]
    assert m.object_info("k").lease_end_s == -float("inf")  # exists touched nothing
    m.get_replicas(["k"])
    assert m.object_info("k").lease_end_s == clock.t + 10.0
    clock.t += 3.0
    m.get_replicas(["k"])
    assert m.object_info("k").lease_end_s == clock.t + 10.0


def test_batch_calls_return_per_key_results(clock):
    m = make(clock)
    put(m, "a")
    m.put_start("b", 10)
    out = m.get_replicas(["a", "b", "c", 7])
    assert isinstance(out[0], tuple)
    assert [o.code for o in out[1:]] == [ErrorCode.OBJECT_NOT_READY, ErrorCode.OBJECT_NOT_FOUND,
                                         ErrorCode.INVALID_PARAMS]
    res = m.batch_put_start([PutRequest(key="c", size_bytes=10), PutRequest(key="a", size_bytes=10),
                             PutRequest(key="d", size_bytes=0)])
    assert not isinstance(res[0], MasterError)
    assert [r.code for r in res[1:]] == [ErrorCode.OBJECT_ALREADY_EXISTS, ErrorCode.INVALID_PARAMS]
    assert m.batch_put_end(["c", "zz"])[0] is None
    assert m.batch_put_revoke(["b", "b"])[1].code == ErrorCode.OBJECT_NOT_FOUND
    assert m.batch_remove(["zz"])[0].code == ErrorCode.OBJECT_NOT_FOUND


def test_remove_refused_while_leased_or_incomplete(clock):
    m = make(clock)
    put(m, "k")
    m.get_replicas(["k"])
    with pytest.raises(LeaseHeldError, match="'k'"):
        m.remove("k")
    clock.t += 10.0
    m.remove("k")
    m.put_start("p", 10)
    with pytest.raises(ObjectNotReadyError):
        m.remove("p")
    put(m, "f")
    m.get_replicas(["f"])
    m.remove("f", force=True)
    with pytest.raises(ObjectNotFoundError):
        m.remove("f")


# ---------------------------------------------------------------------------------------- eviction
def test_watermark_eviction_order_skips_leased_pinned_and_incomplete(clock):
    m = make(clock, nodes=1, units=20, evict_fraction=0.10, client_ttl_s=MAX_DURATION_S)  # evict 2 units
    for i in range(15):
        put(m, f"o{i}")
        clock.t += 1.0
    put(m, "hard", pin=PinKind.HARD)
    put(m, "soft", pin=PinKind.SOFT)
    m.put_start("pending", 10)
    m.get_replicas(["o0"])  # leased and most recent
    clock.t += 1.0
    m.get_replicas(["o1"])
    clock.t += 1.0
    # 18 of 20 units used -> 0.90 is not above the watermark
    assert m.tick().evicted == ()
    put(m, "o15")
    report = m.tick()  # 19/20 > 0.90 -> evict 2 units: oldest unleased first (o2, o3)
    assert report.evicted == ("o2", "o3")
    # explicit eviction of everything: soft pinned last, hard pinned / pending / leased never
    evicted = m.evict(target_bytes=1 << 30)
    assert evicted[-1] == "soft" and "hard" not in evicted and "pending" not in evicted
    assert "o1" not in evicted and "o0" not in evicted


def test_exists_probes_do_not_block_eviction(clock):
    m = make(clock, nodes=1, units=2)
    put(m, "a")
    put(m, "b")
    m.exists(["a", "b"])
    r = m.put_start("c", 10)  # no space: eviction runs, finds 'a' (exists() granted no lease)
    assert r.replicas and "a" not in m.keys()


def test_no_space_only_at_zero_and_names_the_numbers(clock):
    m = make(clock, nodes=1, units=1)
    put(m, "a")
    m.get_replicas(["a"])  # leased: eviction may not take it
    with pytest.raises(NoSpaceError, match="no segment has 64 free bytes"):
        m.put_start("b", 10)
    with pytest.raises(NoSpaceError, match="larger than every segment"):
        m.put_start("big", 2 * UNIT)
    empty = MasterService(MasterConfig(index_kind="flat"), clock=clock)
    with pytest.raises(NoSpaceError, match="no segment is mounted"):
        empty.put_start("x", 1)


def test_soft_pin_expires(clock):
    m = make(clock, nodes=1, units=4, soft_pin_ttl_s=100.0)
    put(m, "s", pin=PinKind.SOFT)
    clock.t += 1.0
    put(m, "u")
    assert m.evict(target_bytes=UNIT) == ["u"]
    put(m, "u2")
    clock.t += 100.0  # the soft pin is over: 's' is now an ordinary (and the oldest) object
    m.heartbeat("n0")
    assert m.evict(target_bytes=UNIT) == ["s"]


# ---------------------------------------------------------------------------------------- clients
def test_client_expiry_clears_replicas_and_needs_remount(clock):
    m = make(clock, nodes=2)
    r = m.put_start("two", 10, ReplicaConfig(replica_num=2))
    m.put_end("two")
    put(m, "one", n=1)
    on_n0 = [d.node_id for d in m.get_replica_list("one")] == ["n0"]
    clock.t += 5.0
    m.heartbeat("n1")
    clock.t += 6.0
    report = m.tick()
    assert report.expired_clients == ("n0",)
    assert [d.node_id for d in m.get_replica_list("two")] == ["n1"]
    assert ("one" in m.keys()) != on_n0
    with pytest.raises(NeedRemountError, match="'n0'"):
        m.heartbeat("n0")
    with pytest.raises(NeedRemountError):
        m.put_start("x", 10, client_id="n0")
    m.mount_segment(seg("n0", 0))  # re-registration
    m.heartbeat("n0")
    assert len(r.replicas) == 2


def test_unmount_drops_replicas_and_orphans(clock):
    m = make(clock, nodes=2)
    put(m, "k", n=1, )
    sid = m.get_replica_list("k")[0].segment_id
    m.unmount_segment(sid)
    assert "k" not in m.keys() and m.index.locate([residency_key("k")[0]]) == [[]]
    with pytest.raises(SegmentNotFoundError):
        m.unmount_segment(sid)


# ---------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("key,size,n,match", [
    ("", 10, 1, "non-empty str"),
    (5, 10, 1, "non-empty str"),
    ("k" * 5000, 10, 1, "at most 4096"),
    ("k", 0, 1, r"size_bytes=0 must be in \[1"),
    ("k", -5, 1, r"size_bytes=-5"),
    ("k", 1 << 40, 1, "size_bytes=1099511627776"),
    ("k", 1.5, 1, "must be an int"),
    ("k", True, 1, "must be an int"),
    ("k", 10, 0, "replica_num=0"),
    ("k", 10, 17, "replica_num=17"),
])
def test_bad_put_params_are_typed_errors(clock, key, size, n, match):
    m = make(clock)
    with pytest.raises(InvalidParamsError, match=match) as info:
        m.put_start(key, size, ReplicaConfig(replica_num=n))
    assert info.value.code == ErrorCode.INVALID_PARAMS
    assert m.stats().num_objects == 0


def test_bad_segments(clock):
    m = make(clock)
    with pytest.raises(SegmentExistsError, match="segment 0"):
        m.mount_segment(seg("x", 0))
    for bad, match in [(dict(node_id="", segment_id=9, capacity_bytes=UNIT), "node_id"),
                       (dict(node_id="x", segment_id=-1, capacity_bytes=UNIT), "segment_id"),
                       (dict(node_id="x", segment_id=9, capacity_bytes=1), "capacity_bytes"),
                       (dict(node_id="x", segment_id=9, capacity_bytes=UNIT, tier=9), "tier")]:
        with pytest.raises(InvalidParamsError, match=match):
            m.mount_segment(SegmentDescriptor(**bad))
    with pytest.raises(InvalidParamsError, match="belongs to 'n1'"):
        m.unmount_segment(1, client_id="n2")
    with pytest.raises(InvalidParamsError):
        MasterService(MasterConfig(alignment_bytes=3))


def test_kv_object_key_maps_to_block_hash_and_identity(clock):
    m = make(clock)
    ident = bytes(range(16))
    key = kv_object_key(0xDEADBEEF, ident)
    assert residency_key(key) == (0xDEADBEEF, ident)
    put(m, key)
    [rows] = m.index.locate([0xDEADBEEF])
    assert rows and rows[0].identity == ident


# ---------------------------------------------------------------------------------------- durability
def durable(clock: Clock, fs, path="/d", **cfg) -> MasterService:
    return MasterService(MasterConfig(alignment_bytes=UNIT, **cfg), clock=clock, data_dir=path, fs=fs)


def snapshot_of(m: MasterService) -> dict:
    return {k: (m.object_info(k).status, [(d.segment_id, d.offset_bytes) for d in m.object_info(k).replicas])
            for k in m.keys()}


@pytest.mark.parametrize("snap_every", [5, 1000])
def test_restart_keeps_objects_segments_and_pending_stays_invisible(clock, snap_every):
    fs = CrashFs()
    m = durable(clock, fs, snapshot_every_records=snap_every, snapshot_growth=0.0, restart_budget_s=0.0)
    for i in range(3):
        m.mount_segment(seg(f"n{i}", i))
    for i in range(10):
        put(m, f"k{i}", n=2)
    m.put_start("inflight", 10)
    m.remove("k3")
    before = snapshot_of(m)
    for crash in (True, False):
        if crash:
            fs = fs.crash(random.Random(1))
        else:
            m.close()
        m = durable(clock, fs, snapshot_every_records=snap_every, snapshot_growth=0.0, restart_budget_s=0.0)
        m.check_invariants()
        assert snapshot_of(m) == before
        assert [s.segment_id for s in m.segments()] == [0, 1, 2]
        assert isinstance(m.get_replicas(["inflight"])[0], ObjectNotReadyError)
        assert m.index.locate([residency_key("inflight")[0]]) == [[]]
    put(m, "after")  # the rebuilt allocators place new objects next to the recovered ones
    m.check_invariants()


class DeferredSnapshotWriter(SnapshotWriter):
    """A background writer that runs in this process (so CrashFs sees its writes): ``start`` encodes
    the state at its LSN at once, the second ``poll`` after it publishes that snapshot, so the
    service goes on appending to the log in between, as it does while a forked child writes."""

    background = True

    def __init__(self) -> None:
        self._job = None

    @property
    def busy(self) -> bool:
        return self._job is not None

    def start(self, fs, data_dir, state) -> None:
        self._job = [fs, data_dir, encode_state(state), state.lsn, 0]

    def poll(self):
        if self._job is None:
            return None
        self._job[4] += 1
        return self.wait() if self._job[4] >= 2 else None

    def wait(self):
        if self._job is None:
            return None
        fs, data_dir, blob, lsn, _ = self._job
        self._job = None
        return SnapshotOutcome(lsn, publish_snapshot(fs, data_dir, blob, lsn), 0.0)


@pytest.fixture()
def deferred_writer():
    SNAPSHOT_WRITERS.register("deferred-test", DeferredSnapshotWriter)
    try:
        yield "deferred-test"
    finally:
        del SNAPSHOT_WRITERS["deferred-test"]


@pytest.mark.parametrize("background", [False, True])
def test_crash_at_every_sync_loses_no_acknowledged_object(clock, background, request):
    """CrashFs crash at the n-th sync for every n: everything acknowledged before the crash survives —
    with snapshots written inline, and written in the background (log sealed, appends go on in a new
    segment, the snapshot published later, then the covered segments deleted)."""
    writer = request.getfixturevalue("deferred_writer") if background else "inline"
    n = 1
    while True:
        fs = CrashFs(crash_at_sync=n)
        acked: dict[str, list] = {}
        ending = None  # the put_end in progress at the crash may or may not have become durable
        crashed = False
        try:
            m = durable(clock, fs, snapshot_every_records=7, snapshot_growth=0.0, restart_budget_s=0.0,
                        snapshot_writer=writer)
            m.mount_segment(seg("n0", 0, 64))
            m.mount_segment(seg("n1", 1, 64))
            acked["segments"] = [0, 1]
            for i in range(12):
                r = m.put_start(f"k{i}", 10, ReplicaConfig(replica_num=2))
                if i % 4 == 3:
                    continue  # left in flight
                ending = f"k{i}"
                m.put_end(ending)
                acked[ending] = [(d.segment_id, d.offset_bytes) for d in r.replicas]
            m.close()
        except BaseException as exc:  # SimulatedCrash
            if type(exc).__name__ != "SimulatedCrash":
                raise
            crashed = True
        disk = fs.crash(random.Random(n))
        r = durable(clock, disk, snapshot_every_records=7, snapshot_growth=0.0, restart_budget_s=0.0,
                        snapshot_writer=writer)
        r.check_invariants()
        if "segments" in acked:
            assert sorted(s.segment_id for s in r.segments()) == [0, 1]
        for k, reps in acked.items():
            if k == "segments":
                continue
            info = r.object_info(k)
            assert info.status == ObjectStatus.COMPLETE and [(d.segment_id, d.offset_bytes) for d in info.replicas] == reps
        for k in r.keys():
            assert k in acked or k == ending or r.object_info(k).status == ObjectStatus.PENDING
        r.close()
        if not crashed:
            assert m.snapshots_taken >= 3  # (every 7 changes, and at close)
            break
        n += 1
    assert n > 20  # every sync point of the run was a crash point


def test_truncated_wal_tail_loses_only_unacknowledged(clock, tmp_path):
    m = MasterService(MasterConfig(alignment_bytes=UNIT, snapshot_every_records=10**6), clock=clock, data_dir=tmp_path)
    m.mount_segment(seg("n0", 0))
    for i in range(5):
        put(m, f"k{i}")
    m._log.close()
    m.index.close()
    wal = tmp_path / "master.wal"
    size = wal.stat().st_size
    with open(wal, "ab") as fh:  # a torn, unacknowledged append after the last sync
        fh.write(b"\x10\x00\x00\x00garbage")
    m._dir_lock.release()  # (as the process's death would)
    r = MasterService(MasterConfig(alignment_bytes=UNIT), clock=clock, data_dir=tmp_path)
    assert sorted(r.keys()) == [f"k{i}" for i in range(5)]
    r.close()
    assert size > 0


def test_damaged_snapshot_is_refused(clock, tmp_path):
    m = MasterService(MasterConfig(alignment_bytes=UNIT), clock=clock, data_dir=tmp_path)
    m.mount_segment(seg("n0", 0))
    put(m, "k")
    m.close()
    snap = tmp_path / SNAPSHOT_NAME
    data = bytearray(snap.read_bytes())
    data[-3] ^= 0xFF
    snap.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match="damaged"):
        MasterService(MasterConfig(alignment_bytes=UNIT), clock=clock, data_dir=tmp_path)


def test_epoch_fencing(clock, tmp_path):
    m = MasterService(MasterConfig(alignment_bytes=UNIT, epoch=3), clock=clock, data_dir=tmp_path)
    m.mount_segment(seg("n0", 0))
    assert m.epoch == 3
    with pytest.raises(StaleEpochError, match="epoch 2"):
        m.apply_record(encode_record([Op.PUT_END, 2, clock.t, "k"]))
    m.observe_epoch(4)  # a newer leader exists: this one may not write any more
    with pytest.raises(StaleEpochError, match="deposed"):
        m.put_start("k", 10)
    m._log.close()
    m.index.close()
    m._dir_lock.release()  # (as the process's death would)
    with pytest.raises(StaleEpochError, match="older than epoch 3"):
        MasterService(MasterConfig(alignment_bytes=UNIT, epoch=2), clock=clock, data_dir=tmp_path)
    r = MasterService(MasterConfig(alignment_bytes=UNIT, epoch=5), clock=clock, data_dir=tmp_path)
    assert r.epoch == 5 and [s.segment_id for s in r.segments()] == [0]
    r.close()


@pytest.mark.parametrize("sync_put_start", [True, False])
def test_failed_fsync_turns_the_master_read_only(clock, sync_put_start):
    fs = CrashFs()
    m = durable(clock, fs, sync_put_start=sync_put_start)
    m.mount_segment(seg("n0", 0))
    fs.fail_next_fsync()
    if not sync_put_start:  # a put start is only written; the put_end's fsync (covering both) fails
        m.put_start("k", 10)
        assert m.durable_lsn == m.lsn - 1
    with pytest.raises(LogFailedError, match="read-only"):
        m.put_end("k") if not sync_put_start else m.put_start("k", 10)
    with pytest.raises(LogFailedError):
        m.mount_segment(seg("n1", 1))
    for read in (lambda: m.exists(["k"]), lambda: m.get_replicas(["k"]), lambda: m.object_info("k"),
                 lambda: m.get_replicas_columns(["k"]), lambda: m.get_replicas_compact(["k"])):
        with pytest.raises(LogFailedError, match="no read"):  # memory holds the unacknowledged change
            read()


def test_put_start_is_written_and_fsynced_by_the_next_change(clock):
    """A call that only starts puts writes its record without an fsync: a power loss (only synced bytes
    survive, the rest kept, dropped, torn or garbled by a seeded RNG) may forget those puts and nothing
    else; the next state change (here a put_end) fsyncs both; a call that changes nothing fsyncs nothing."""
    outcomes = set()
    for seed in range(12):
        fs = CrashFs()
        m = durable(clock, fs)
        m.mount_segment(seg("n0", 0))
        m.put_start("a", 10)
        m.put_end("a")
        m.batch_put_start([PutRequest(key="b", size_bytes=10), PutRequest(key="c", size_bytes=10)])
        assert m.lsn == m.durable_lsn + 1
        m.get_replicas(["a"])
        m.exists(["b"])
        assert m.lsn == m.durable_lsn + 1  # reads did not fsync the put start
        lost = MasterService(MasterConfig(alignment_bytes=UNIT), clock=clock, data_dir="/d",
                             fs=fs.crash(random.Random(seed)))
        assert lost.object_info("a").status is ObjectStatus.COMPLETE
        left = set(lost.keys()) - {"a"}
        assert left in (set(), {"b", "c"})  # one record: both or neither
        for k in left:
            assert lost.object_info(k).status is ObjectStatus.PENDING
        outcomes.add(bool(left))
        lost.close()
    assert outcomes == {True, False}  # the seeds show both fates of the unsynced record
    fs = CrashFs()
    m = durable(clock, fs)
    m.mount_segment(seg("n0", 0))
    m.put_start("b", 10)
    m.put_end("b")  # fsyncs the put start with it
    again = MasterService(MasterConfig(alignment_bytes=UNIT), clock=clock, data_dir="/d", fs=fs.crash(random.Random(0)))
    assert again.object_info("b").status is ObjectStatus.COMPLETE
    again.close()


def test_put_start_survives_a_process_crash_and_sync_put_start_fsyncs_it(clock, tmp_path):
    m = MasterService(MasterConfig(alignment_bytes=UNIT), clock=clock, data_dir=tmp_path)
    m.mount_segment(seg("n0", 0))
    r = m.put_start("p", 10)
    assert m.durable_lsn == m.lsn - 1
    fd, m._log._wal._fd = m._log._wal._fd, -1  # the process dies: no close, no sync; the written bytes stay
    m._log._wal.fs.close(fd)  # (the OS releases the descriptor; a handle is not one)
    m._dir_lock.release()
    again = MasterService(MasterConfig(alignment_bytes=UNIT), clock=clock, data_dir=tmp_path)
    info = again.object_info("p")
    assert info.status is ObjectStatus.PENDING and info.put_id == r.put_id
    again.put_end("p")
    assert again.durable_lsn == again.lsn
    again.close()
    s = MasterService(MasterConfig(alignment_bytes=UNIT, sync_put_start=True), clock=clock,
                      data_dir=tmp_path / "strict")
    s.mount_segment(seg("n0", 0))
    s.put_start("q", 10)
    assert s.durable_lsn == s.lsn
    s.close()


def test_restart_timing_small(clock, tmp_path):
    m = MasterService(MasterConfig(alignment_bytes=UNIT, snapshot_every_records=10**9), clock=clock,
                      data_dir=tmp_path)
    for i in range(4):
        m.mount_segment(seg(f"n{i}", i, 1 << 14))
    keys = [f"key-{i}" for i in range(20000)]
    for j in range(0, len(keys), 1000):
        m.batch_put_start([PutRequest(key=k, size_bytes=UNIT) for k in keys[j:j + 1000]])
        m.batch_put_end(keys[j:j + 1000])
    m.close()
    r = MasterService(MasterConfig(alignment_bytes=UNIT), clock=clock, data_dir=tmp_path)
    assert r.stats().num_objects == 20000
    assert r.recovery_s < 1.0
    put(r, "new")
    r.check_invariants()
    r.close()


# ---------------------------------------------------------------------------------------- SIGKILL
KILLS = int(os.environ.get("QUILLCACHE_MASTER_KILLS", "30"))
CHILD = Path(__file__).with_name("master_kill_child.py")


def test_sigkill_loses_no_acknowledged_put(tmp_path):
    rng = random.Random(1234)
    acked: dict[str, str] = {}
    removed: set[str] = set()
    inflight: set[str] = set()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    start = 0
    for kill in range(KILLS):
        proc = subprocess.Popen([sys.executable, str(CHILD), str(tmp_path), str(rng.getrandbits(32)), str(start)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        ready = proc.stdout.readline()
        assert ready.strip() == "READY", proc.stderr.read()
        # recovered state (the child reopened the data dir) is checked below from a fresh master
        time.sleep(rng.uniform(0.0, 0.15))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
        for line in out.splitlines():
            parts = line.split()
            if parts and parts[0] == "ACK" and len(parts) == 3:
                acked[parts[1]] = parts[2]
                start = max(start, int(parts[1].split("-")[1]) + 100)
            elif parts and parts[0] == "REMOVING" and len(parts) == 2:
                removed.add(parts[1])
            elif parts and parts[0] == "INFLIGHT" and len(parts) == 2:
                inflight.add(parts[1])
        start += 1000
        m = MasterService(MasterConfig(alignment_bytes=4096, snapshot_every_records=50, snapshot_growth=0.0,
                                             restart_budget_s=0.0), data_dir=tmp_path)
        m.check_invariants()
        for key, reps in acked.items():
            if key in removed:
                continue
            info = m.object_info(key)
            assert info.status == ObjectStatus.COMPLETE, key
            assert ",".join(f"{d.segment_id}:{d.offset_bytes}" for d in info.replicas) == reps, key
        unacked_complete = 0
        for key in m.keys():
            info = m.object_info(key)
            if info.status == ObjectStatus.PENDING:  # a half-finished put is never visible
                assert isinstance(m.get_replicas([key])[0], ObjectNotReadyError)
                assert m.index.locate([residency_key(key)[0]]) == [[]]
            else:
                assert key not in inflight, key  # a put never ended is never complete
                # committed, but killed before the child printed the ack (at most one batch)
                unacked_complete += key not in acked and key not in removed
        assert unacked_complete <= 8 * (kill + 1)
        m._log.close()
        m.index.close()
        m._dir_lock.release()  # the next child takes the data dir
    assert len(acked) > KILLS


def test_standby_follows_the_log_then_writes(clock, tmp_path):
    from quillcache.durability.wal import scan

    leader = MasterService(MasterConfig(alignment_bytes=UNIT, snapshot_every_records=10**6, epoch=1), clock=clock,
                           data_dir=tmp_path)
    for i in range(2):
        leader.mount_segment(seg(f"n{i}", i))
    for i in range(6):
        put(leader, f"k{i}", n=2)
    leader.put_start("inflight", 10)
    leader.remove("k2")
    standby = MasterService(MasterConfig(alignment_bytes=UNIT, index_kind="flat", epoch=2), clock=clock)
    _, records = scan(tmp_path / "master.wal")
    for lsn, payload in records:
        standby.apply_record(payload, lsn)
    assert snapshot_of(standby) == snapshot_of(leader)
    put(standby, "new", n=2)  # promotion: allocators rebuilt from the followed tables, epoch 2 writes
    standby.check_invariants()
    assert standby.lsn > leader.lsn
    leader.close()


# ---------------------------------------------------------------------------------------- residency at recovery
def test_publish_missing_ends_like_publish_and_skips_what_the_index_has():
    """Random add/drop sequences over a few replicas, on an index that already holds a random part of
    them: ``publish_missing`` leaves the index exactly as ``publish`` does, writing only the difference."""
    from quillcache.index import open_index
    from quillcache.master.residency import IndexProjection
    from quillcache.types import CacheTier

    seed = 1414
    rng = random.Random(seed)
    for trial in range(60):
        keys = [f"k{i}" for i in range(rng.randint(1, 6))]
        nodes = ["a", "b", "c"]
        pre = [(rng.choice(keys), rng.choice(nodes), rng.randrange(3)) for _ in range(rng.randint(0, 6))]
        ops = [(rng.random() < 0.6, rng.choice(keys), rng.choice(nodes), rng.randrange(3))
               for _ in range(rng.randint(0, 12))]
        results = []
        for publish in ("publish", "publish_missing"):
            idx = open_index("flat", None)
            p = IndexProjection(idx)
            for key, node, off in pre:
                p.add(key, [(node, CacheTier.DRAM, 1, off * 64, 64)])
            p.publish()
            before = idx.logical_bytes_written
            for is_add, key, node, off in ops:
                if is_add:
                    p.add(key, [(node, CacheTier.DRAM, 1, off * 64, 64)])
                else:
                    p.drop(key, [(node, CacheTier.DRAM)])
            getattr(p, publish)()
            results.append(([idx.locate([residency_key(k)[0]]) for k in keys], idx.logical_bytes_written - before))
        (want, wrote_all), (got, wrote_missing) = results
        assert got == want, f"seed {seed} trial {trial}: {ops} over {pre}"
        assert wrote_missing <= wrote_all


def test_restarts_on_the_same_log_tail_do_not_rewrite_the_index(clock, tmp_path):
    """A master with its index on disk that stops without a snapshot (its index holds the tail's replicas)
    restarts twice: the tail is replayed into the tables each time but nothing is written to the index again."""
    cfg = MasterConfig(alignment_bytes=UNIT, snapshot_every_records=10**9, index_on_disk=True)
    m = MasterService(cfg, clock=clock, data_dir=tmp_path)
    for i in range(2):
        m.mount_segment(seg(f"n{i}", i, 1 << 10))
    m.snapshot()
    keys = [f"k{i}" for i in range(200)]
    m.batch_put_start([PutRequest(key=k, size_bytes=UNIT, config=ReplicaConfig(replica_num=2)) for k in keys])
    m.batch_put_end(keys)
    m.remove(keys[0], force=True)
    m.index.flush()  # the index's own log has the tail's records (as after a SIGKILL past its write)
    want = {k: m.index.locate([residency_key(k)[0]]) for k in keys}
    m._dir_lock.release()  # each master "dies" without a close (the log tail stays): its process would release this
    m.index._dir_lock.release()  # (and its index's lock)
    for _ in range(2):
        r = MasterService(cfg, clock=clock, data_dir=tmp_path)
        assert r.recovered_records == 3
        assert r.index.logical_bytes_written == 0
        assert {k: r.index.locate([residency_key(k)[0]]) for k in keys} == want
        assert want[keys[0]] == [[]] and len(want[keys[1]][0]) == 2
        r.check_invariants()
        r._dir_lock.release()
        r.index._dir_lock.release()
    shutil.rmtree(tmp_path / "index")  # an index that lost everything is refilled from the tables
    r = MasterService(cfg, clock=clock, data_dir=tmp_path)
    assert {k: r.index.locate([residency_key(k)[0]]) for k in keys} == want
    r._dir_lock.release()
    r.index._dir_lock.release()
    # an index that lost only the tail: the first restart writes it (and flushes), the next writes nothing
    shutil.rmtree(tmp_path / "index")
    written = []
    for i in range(2):
        r = MasterService(cfg, clock=clock, data_dir=tmp_path)
        written.append(r.index.logical_bytes_written)
        assert {k: r.index.locate([residency_key(k)[0]]) for k in keys} == want
        if i == 0:
            r._dir_lock.release()
            r.index._dir_lock.release()
    assert written[0] > 0 and written[1] == 0, written
    r.close()


@pytest.mark.parametrize("materialize", [False, True])
def test_in_memory_index_is_rebuilt_from_snapshot_and_tail(clock, tmp_path, materialize):
    """The default index lives in memory: a restart (no close: snapshot + a log tail with puts, ends, a
    remove and a revoke) rebuilds it from the tables, equal to the index the master had; nothing is on disk
    under ``index``. With some records materialized before the fill, the result is the same."""
    cfg = MasterConfig(alignment_bytes=UNIT, snapshot_every_records=10**9)
    m = MasterService(cfg, clock=clock, data_dir=tmp_path)
    for i in range(3):
        m.mount_segment(seg(f"n{i}", i, 1 << 12))
    first = [f"a{i}" for i in range(150)]
    m.batch_put_start_columns(first, [UNIT] * len(first), replica_num=2)
    m.batch_put_end(first[:120])  # 30 stay PENDING: not in the index
    m.snapshot()
    tail = [f"b{i}" for i in range(40)]
    m.batch_put_start_columns(tail, [UNIT * 2] * len(tail))
    m.batch_put_end(tail[:30])
    m.remove(first[0], force=True)
    m.put_revoke(tail[39])
    keys = first + tail
    want = {k: sorted(m.index.locate([residency_key(k)[0]])[0], key=repr) for k in keys}
    assert sum(len(v) for v in want.values()) == 2 * 119 + 30
    assert not (tmp_path / "index").exists()
    m._dir_lock.release()  # m "dies" without a close: its process would release this
    r = MasterService(cfg, clock=clock, data_dir=tmp_path)
    if materialize:
        r.close()
        r = MasterService(cfg, clock=clock, data_dir=tmp_path)
    assert {k: sorted(r.index.locate([residency_key(k)[0]])[0], key=repr) for k in keys} == want
    r.check_invariants()
    r.close()


# ---------------------------------------------------------------------------------------- compact forms
def _errs(xs):
    return [(type(x).__name__, str(x)) if isinstance(x, Exception) else x for x in xs]


def test_compact_forms_agree_with_the_plain_ones():
    """Two masters on the same clock take the same seeded random requests (good and bad, 1-4 replicas,
    preferred segments, pins, digests, repeats), one through the plain batch calls, one through the
    compact forms; expanded, the results are equal, and so are the objects afterwards."""
    from quillcache.master.wire import expand_put_results, expand_replicas, put_rows

    seed = 1415
    rng = random.Random(seed)
    clocks = (Clock(), Clock())
    plain, compact = (make(c, nodes=4, units=64) for c in clocks)
    keys = [f"k{i}" for i in range(40)]
    for step in range(25):
        reqs = []
        for _ in range(rng.randint(1, 12)):
            key = rng.choice(keys + [""]) if rng.random() < 0.95 else 7
            reqs.append(PutRequest(key=key, size_bytes=rng.choice([1, UNIT, 3 * UNIT, 0, 10**9]),
                                   config=ReplicaConfig(replica_num=rng.randint(1, 4),
                                                        preferred_segment=rng.choice([None, None, 1, 3, 9])),
                                   pin=rng.choice(list(PinKind)), digest=rng.choice([None, b"d", b"e"])))
        want = plain.batch_put_start(reqs)
        segs, rows = compact.batch_put_start_compact(put_rows(reqs))
        assert _errs(expand_put_results(segs, rows)) == _errs(want), f"seed {seed} step {step}"
        done = [r.key for r, w in zip(reqs, want) if not isinstance(w, Exception) and not w.existing]
        ends = rng.sample(done, k=len(done) // 2)
        assert _errs(plain.batch_put_end(ends)) == _errs(compact.batch_put_end(ends))
        ask = rng.sample(keys, k=8) + [5]
        want = plain.get_replicas(ask)
        segs, rows = compact.get_replicas_compact(ask)
        assert _errs(expand_replicas(segs, rows)) == _errs(want), f"seed {seed} step {step}"
        for k in ask[:2]:
            try:
                want = plain.get_replica_list(k)
            except MasterError as e:
                with pytest.raises(type(e), match=re.escape(str(e))):
                    compact.get_replica_list_compact(k)
            else:
                segs, row = compact.get_replica_list_compact(k)
                assert expand_replicas(segs, [row])[0] == want
        clocks[0].t += 1.0
        clocks[1].t += 1.0
    assert sorted(plain.keys()) == sorted(compact.keys())
    for k in plain.keys():
        assert plain.object_info(k) == compact.object_info(k)
    compact.check_invariants()
    with pytest.raises(InvalidParamsError, match="compact put_start row"):
        raise compact.batch_put_start_compact([["k", 1]])[1][0]


def test_a_batch_put_end_is_one_record_that_replays_and_malformed_ones_are_refused(clock):
    """batch_put_end of several keys writes ONE PUT_END_MANY record: each key checked as if the ones before it
    were ended (a repeat is 'already complete', a bad key its own error), and a restart replays it exactly."""
    from quillcache.master.oplog import decode_record

    fs = CrashFs()
    m = durable(clock, fs)
    for i in range(3):
        m.mount_segment(seg(f"n{i}", i))
    m.batch_put_start([PutRequest(key=f"k{i}", size_bytes=10, config=ReplicaConfig(replica_num=2)) for i in range(4)])
    lsn = m.lsn
    out = m.batch_put_end(["k0", "k1", "k0", "nope", 7, "k2"])
    assert m.lsn == lsn + 1  # one record, one LSN for the whole call
    assert [None if o is None else o.code for o in out] == [None, None, ErrorCode.OBJECT_ALREADY_EXISTS,
                                                            ErrorCode.OBJECT_NOT_FOUND, ErrorCode.INVALID_PARAMS, None]
    before = snapshot_of(m)
    m = durable(clock, fs.crash(random.Random(3)))  # replayed from the log tail
    assert snapshot_of(m) == before
    assert [len(r) for r in m.index.locate([residency_key(k)[0] for k in ("k0", "k1", "k2", "k3")])] == [2, 2, 2, 0]
    m.check_invariants()
    assert decode_record(encode_record([Op.PUT_END_MANY, 1, 0.0, ["a", "b"]]))[3] == ["a", "b"]
    for bad in ([], ["a", 3], "a"):
        with pytest.raises(ValueError, match="PUT_END_MANY must hold a non-empty array of keys"):
            decode_record(encode_record([Op.PUT_END_MANY, 1, 0.0, bad]))


def test_a_batch_put_start_is_one_columnar_record_that_replays_and_malformed_ones_are_refused(clock):
    """batch_put_start of several new keys writes ONE PUT_START_MANY record (columns): repeats inside the batch
    answer from the batch's own puts (same digest: existing; else 'already exists'), a bad request is its own
    error, and a restart replays the record to the same objects, offsets, put ids and free space."""
    from quillcache.master.oplog import decode_record

    fs = CrashFs()
    m = durable(clock, fs)
    for i in range(3):
        m.mount_segment(seg(f"n{i}", i))
    lsn = m.lsn
    reqs = [PutRequest(key="a", size_bytes=10, digest=b"d"), PutRequest(key="b", size_bytes=100,
                                                                        config=ReplicaConfig(replica_num=2)),
            PutRequest(key="a", size_bytes=10, digest=b"d"), PutRequest(key="b", size_bytes=100),
            PutRequest(key="c", size_bytes=0), "junk",
            PutRequest(key="e", size_bytes=5, pin=PinKind.SOFT, config=ReplicaConfig(preferred_segment=2))]
    out = m.batch_put_start(reqs)
    assert m.lsn == lsn + 1  # one record, one LSN, for the whole call
    assert [o.code if isinstance(o, Exception) else o.existing for o in out] == [
        False, False, True, ErrorCode.OBJECT_ALREADY_EXISTS, ErrorCode.INVALID_PARAMS, ErrorCode.INVALID_PARAMS, False]
    assert out[2] == PutStartResult(out[0].replicas, out[0].put_id, True)
    assert [o.put_id for o in (out[0], out[1], out[6])] == [out[0].put_id, out[0].put_id + 1, out[0].put_id + 2]
    assert len({d.node_id for d in out[1].replicas}) == 2 and out[6].replicas[0].segment_id == 2
    m.batch_put_end(["a", "b"])
    before = snapshot_of(m), [m.segment_usage(i) for i in range(3)], m.object_info("e")
    m = durable(clock, fs.crash(random.Random(5)))  # replayed from the log tail
    assert (snapshot_of(m), [m.segment_usage(i) for i in range(3)], m.object_info("e")) == before
    m.check_invariants()
    nxt = m.put_start("f", 10)  # the rebuilt allocators place after the replayed ranges
    assert nxt.put_id == out[6].put_id + 1
    m.check_invariants()
    good = [Op.PUT_START_MANY, 1, 0.0, 60.0, 7, ["x", "y"], [1, 2], [64, 64], [0, 1], [None, b"d"], [1, 2],
            [0, 0, 1, 64, 2, 64]]
    assert decode_record(encode_record(good))[5] == ["x", "y"]
    for i, bad, why in [(5, ["x", "x"], "appears twice"), (5, [], "non-empty array of str"),
                        (6, [1], "size_bytes must be an array of 2 ints"), (10, [1, 0], "at least one replica"),
                        (11, [0, 0, 1], "flat array of 6 ints"), (9, [None, "d"], "digests"),
                        (4, 0, "first_put_id")]:
        rec = list(good)
        rec[i] = bad
        with pytest.raises(ValueError, match=f"PUT_START_MANY is malformed: .*{why}"):
            decode_record(encode_record(rec))
    with pytest.raises(ValueError, match="PUT_START_MANY has 8 fields, expected 9"):
        decode_record(encode_record(good[:-1]))


def test_a_log_of_per_object_put_start_records_still_replays(clock):
    """A log written before PUT_START_MANY existed (one PUT_START record per object) replays as it always did."""
    from quillcache.master.oplog import OpLog

    fs = CrashFs()
    fs.mkdir("/old")
    log = OpLog("/old", fs)
    log.recover(0)
    recs = [[Op.MOUNT, 1, 1.0, "n0", 0, 16 * UNIT, "n0:7000", "tcp", [0], 0],
            [Op.MOUNT, 1, 1.0, "n1", 1, 16 * UNIT, "n1:7000", "tcp", [1], 0],
            [Op.PUT_START, 1, 2.0, "a", 10, UNIT, 0, 1800.0, None, 1, [[0, 0]]],
            [Op.PUT_START, 1, 2.0, "b", 100, 2 * UNIT, 0, 1800.0, b"d", 2, [[1, 0], [0, UNIT]]],
            [Op.PUT_END, 1, 3.0, "a"]]
    for r in recs:
        log.append(encode_record(r))
    log.commit()
    log.close()
    m = durable(clock, fs, path="/old")
    assert snapshot_of(m) == {"a": (ObjectStatus.COMPLETE, [(0, 0)]), "b": (ObjectStatus.PENDING, [(1, 0), (0, UNIT)])}
    assert m.object_info("b").digest == b"d" and m.segment_usage(0) == (3 * UNIT, 16 * UNIT)
    m.check_invariants()
    assert m.put_start("c", 10).put_id == 3
    m.check_invariants()


@settings(max_examples=200, deadline=None)
@given(node=st.text(min_size=1, max_size=8), sid=st.integers(0, 2**32 - 1), endpoint=st.text(max_size=8),
       transport=st.sampled_from(["tcp", "rdma"]), region=st.integers(0, 2**16), off=st.integers(0, 2**40),
       size=st.integers(1, 2**32 - 1), put_id=st.integers(1, 2**40), existing=st.booleans())
def test_the_fast_result_builders_equal_the_dataclass_constructors(node, sid, endpoint, transport, region, off, size,
                                                                   put_id, existing):
    """new_replica_descriptor / new_put_start_result (the put_start hot path) build exactly the constructors'
    values: equal, same hash and repr, same codec round trip, still frozen."""
    import dataclasses

    from quillcache.master.types import new_put_start_result, new_replica_descriptor
    from quillcache.master.wire import register_master_types
    from quillcache.rpc.codec import DEFAULT_CODEC

    want = PutStartResult((ReplicaDescriptor(node, sid, endpoint, transport, region, off, size),), put_id, existing)
    got = new_put_start_result((new_replica_descriptor(node, sid, endpoint, transport, region, off, size),), put_id,
                               existing)
    assert got == want and hash(got) == hash(want) and repr(got) == repr(want)
    assert type(got) is PutStartResult and type(got.replicas[0]) is ReplicaDescriptor
    codec = register_master_types(DEFAULT_CODEC)
    assert codec.decode(codec.encode(got)) == want
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.replicas[0].offset_bytes = 0


@pytest.mark.parametrize("writer", ["inline", "fork"])
def test_snapshot_cadence_grows_with_the_table(clock, tmp_path, writer):
    """A snapshot comes once the log holds max(snapshot_every_records, snapshot_growth x objects) changes:
    with 10 and 1.0, a table of 200 objects is snapshotted after 200 more changes, not after 10. The
    forked writer snapshots the same LSNs (its outcome is taken when waited for)."""
    cfg = MasterConfig(alignment_bytes=UNIT, snapshot_every_records=10, snapshot_growth=1.0, restart_budget_s=0.0,
                       snapshot_writer=writer)
    m = MasterService(cfg, clock=clock, data_dir=tmp_path)
    m.mount_segment(seg("n0", 0, 1 << 16))
    keys = [f"k{i}" for i in range(100)]
    m.batch_put_start_columns(keys, [UNIT] * 100)  # 100 changes >= max(10, 1.0 x 0): snapshot
    assert m.snapshot_in_flight == (writer == "fork")
    m.wait_snapshot()
    first = m.last_snapshot_lsn
    assert first == m.lsn
    more = [f"m{i}" for i in range(40)]
    m.batch_put_start_columns(more, [UNIT] * 40)  # 40 < max(10, 140): no snapshot
    assert not m.snapshot_in_flight and m.last_snapshot_lsn == first
    m.batch_put_end(keys)  # 140 >= 140: snapshot
    m.wait_snapshot()
    assert m.last_snapshot_lsn == m.lsn > first
    assert m.last_snapshot_outcome is None or m.last_snapshot_outcome.ok
    with pytest.raises(MasterError, match="snapshot_growth"):
        MasterService(MasterConfig(snapshot_growth=-1.0))
    m.close()


def test_deferred_index_publish(clock):
    """``defer_index_publish``: a put_end's rows wait until ``publish_index()`` or the next state change (published
    before that call's first record, so a failing call never discards them); the default publishes at once."""
    fs = CrashFs()
    m = durable(clock, fs, defer_index_publish=True)
    m.mount_segment(seg("n0", 0))
    h = {k: residency_key(k)[0] for k in ("a", "b", "c")}
    m.put_start("a", 10)
    m.put_end("a")
    assert m.index.locate([h["a"]]) == [[]]  # deferred
    m.publish_index()
    assert [e.node for e in m.index.locate([h["a"]])[0]] == ["n0"]
    m.publish_index()  # nothing waits: no change
    m.put_start("b", 10)
    m.put_end("b")
    with pytest.raises(ObjectNotFoundError):
        m.put_end("nope")  # a call that fails without a record leaves b's rows queued
    assert m.index.locate([h["b"]]) == [[]]
    fs.fail_next_fsync()
    with pytest.raises(LogFailedError):
        m.mount_segment(seg("n1", 1))  # its first record published b's rows first; the failure drops only its own
    assert [e.node for e in m.index.locate([h["b"]])[0]] == ["n0"]
    m3 = durable(clock, CrashFs(), path="/f", defer_index_publish=False)
    m3.mount_segment(seg("n0", 0))
    m3.put_start("c", 10)
    m3.put_end("c")
    assert [e.node for e in m3.index.locate([h["c"]])[0]] == ["n0"]  # the default publishes before returning


@pytest.mark.parametrize("name", ["index_on_disk", "sync_put_start", "defer_index_publish"])
def test_boolean_config_fields_refuse_other_types(name):
    with pytest.raises(InvalidParamsError, match=f"MasterConfig.{name}=1 must be a bool"):
        MasterService(MasterConfig(**{name: 1}))


def test_the_server_config_from_its_command_line():
    """``quillcache master``: put starts written, not fsynced, unless ``--sync-put-start``; the server always
    defers the index publish to after its replies (it calls ``publish_index``)."""
    import argparse

    from quillcache.cli.master import configure
    from quillcache.master.server import _config

    parser = argparse.ArgumentParser()
    configure(parser)
    plain = _config(parser.parse_args(["--data-dir", "/x"]))
    strict = _config(parser.parse_args(["--data-dir", "/x", "--sync-put-start"]))
    assert (plain.sync_put_start, strict.sync_put_start) == (False, True)
    assert plain.defer_index_publish and strict.defer_index_publish
