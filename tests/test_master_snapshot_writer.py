"""Snapshots written in the background: the forked writer, the sealed log segments, publication rules.

The crash consistency of the protocol at every sync point is tested in test_master_service.py
(``test_crash_at_every_sync_loses_no_acknowledged_object``, background case, on CrashFs), and the
SIGKILL workload there runs with the forked writer (the default)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from quillcache.durability.fs import RealFs
from quillcache.master import MasterConfig, MasterService, SegmentDescriptor
from quillcache.master import snapshot_writer as SW
from quillcache.master.oplog import OpLog, log_files, sealed_segments
from quillcache.master.snapshot import SNAPSHOT_NAME, encode_state, publish_snapshot, snapshot_lsn
from quillcache.master.types import ObjectStatus

UNIT = 64


def service(path, **cfg) -> MasterService:
    cfg.setdefault("snapshot_every_records", 100)
    cfg.setdefault("snapshot_growth", 0.0)
    cfg.setdefault("restart_budget_s", 0.0)
    return MasterService(MasterConfig(alignment_bytes=UNIT, **cfg), data_dir=path)


def put_batch(m: MasterService, start: int, n: int) -> list[str]:
    keys = [f"k{i:06d}" for i in range(start, start + n)]
    cols = m.batch_put_start_columns(keys, np.full(n, UNIT, dtype=np.int64))
    assert not cols.errors
    m.batch_put_end(keys)
    return keys


def table(m: MasterService) -> dict:
    return {k: [(d.segment_id, d.offset_bytes) for d in m.object_info(k).replicas] for k in m.keys()
            if m.object_info(k).status == ObjectStatus.COMPLETE}


@pytest.fixture
def mounted(tmp_path):
    m = service(tmp_path)
    try:
        for i in range(3):
            m.mount_segment(SegmentDescriptor(node_id=f"n{i}", segment_id=i, capacity_bytes=1 << 24))
        yield m, tmp_path
    finally:
        m.close()


def test_forked_snapshot_covers_the_sealed_lsn_while_puts_go_on(mounted):
    m, path = mounted
    assert isinstance(m._snap_writer, SW.ForkSnapshotWriter)
    put_batch(m, 0, 60)  # 120 changes >= 100: the log is sealed and a child forked
    assert m.snapshot_in_flight
    sealed_at = m.lsn
    assert [p for _, p in sealed_segments(str(path), RealFs())]  # the sealed segment exists until published
    put_batch(m, 60, 10)  # appends go on into the new active file meanwhile
    out = m.wait_snapshot()
    assert out is not None and out.ok and out.lsn == sealed_at, out
    assert snapshot_lsn(RealFs(), str(path)) == sealed_at == m.last_snapshot_lsn
    assert sealed_segments(str(path), RealFs()) == []  # deleted once the snapshot was durable
    assert not [n for n in os.listdir(path) if n.startswith(SNAPSHOT_NAME + ".tmp")]
    want = table(m)
    m.close()
    again = service(path)
    try:
        assert table(again) == want and len(want) == 70
    finally:
        again.close()


def test_a_failed_background_snapshot_loses_nothing_and_the_next_is_inline(mounted, monkeypatch, caplog):
    m, path = mounted

    def broken(*a, **kw):
        raise OSError(28, "No space left on device (injected in the child)")

    monkeypatch.setattr(SW, "publish_snapshot", broken)  # the forked child inherits the patched module
    put_batch(m, 0, 60)
    out = m.wait_snapshot()
    assert out is not None and not out.ok and "No space left" in out.error
    assert "failed" in caplog.text and snapshot_lsn(RealFs(), str(path)) is None
    assert len(sealed_segments(str(path), RealFs())) == 1  # kept: it holds records no snapshot covers
    monkeypatch.undo()
    put_batch(m, 60, 1)  # the changes counted again: the next snapshot is due at once, and inline
    assert not m.snapshot_in_flight and m.snapshots_taken == 1 and m.last_snapshot_lsn >= m.lsn - 1
    assert sealed_segments(str(path), RealFs()) == []
    want = table(m)
    m.close()
    again = service(path)
    try:
        assert table(again) == want and len(want) == 61
    finally:
        again.close()


def test_a_killed_snapshot_child_is_reported_and_nothing_is_lost(mounted):
    m, path = mounted
    put_batch(m, 0, 60)
    os.kill(m._snap_writer._pid, 9)
    out = m.wait_snapshot()
    assert out is not None and (out.ok or "signal 9" in out.error), out  # (it may have published first)
    put_batch(m, 60, 5)
    m.wait_snapshot()
    want = table(m)
    m.close()
    again = service(path)
    try:
        assert table(again) == want and len(want) == 65
    finally:
        again.close()


def test_publish_never_replaces_a_later_snapshot_nor_publishes_for_a_dead_master(tmp_path):
    fs, d = RealFs(), str(tmp_path / "dst")
    os.mkdir(d)
    m = service(tmp_path / "src", snapshot_writer="inline")
    m.mount_segment(SegmentDescriptor(node_id="n0", segment_id=0, capacity_bytes=1 << 20))
    put_batch(m, 0, 3)
    old_blob, old_lsn = encode_state(m._state), m.lsn
    put_batch(m, 3, 3)
    new_blob, new_lsn = encode_state(m._state), m.lsn
    m.close()
    assert publish_snapshot(fs, d, new_blob, new_lsn) == len(new_blob)
    assert publish_snapshot(fs, d, old_blob, old_lsn, tmp_suffix=".1") == 0  # older than what is there
    assert snapshot_lsn(fs, d) == new_lsn
    newer = new_lsn + 5
    assert publish_snapshot(fs, d, new_blob, newer, still_wanted=lambda: False) == 0  # its master is gone
    assert snapshot_lsn(fs, d) == new_lsn
    assert sorted(os.listdir(d)) == [SNAPSHOT_NAME, SNAPSHOT_NAME + ".lock"]  # no temporary left behind


def test_a_missing_sealed_segment_is_refused_naming_the_records(tmp_path):
    m = service(tmp_path, snapshot_every_records=10**6)
    m.mount_segment(SegmentDescriptor(node_id="n0", segment_id=0, capacity_bytes=1 << 20))
    put_batch(m, 0, 2)
    m._log.seal()
    put_batch(m, 2, 2)
    m._log.seal()
    put_batch(m, 4, 2)
    m._log.close()
    m.index.close()
    segs = sealed_segments(str(tmp_path), RealFs())
    assert len(segs) == 2 and len(log_files(str(tmp_path), RealFs())) == 3
    os.unlink(segs[1][1])
    with pytest.raises(ValueError, match=r"records \d+\.\.\d+ are missing"):
        OpLog(str(tmp_path), RealFs()).recover(0)


def test_sealed_segments_replay_in_order_and_covered_ones_are_deleted(tmp_path):
    m = service(tmp_path, snapshot_every_records=10**6, snapshot_writer="inline")
    m.mount_segment(SegmentDescriptor(node_id="n0", segment_id=0, capacity_bytes=1 << 20))
    put_batch(m, 0, 2)
    m._log.seal()
    put_batch(m, 2, 2)
    m._log.seal()
    put_batch(m, 4, 2)
    want = table(m)
    m._log.close()  # a crash: no snapshot, three log files
    m.index.close()
    m._dir_lock.release()  # (as the process's death would)
    again = service(tmp_path, snapshot_every_records=10**6, snapshot_writer="inline")
    try:
        assert table(again) == want and len(want) == 6
        again.snapshot()
        assert log_files(str(tmp_path), RealFs()) == [str(tmp_path / "master.wal")]
    finally:
        again.close()


def test_unknown_writer_is_refused():
    from quillcache.master import MasterError
    with pytest.raises(MasterError, match="snapshot_writer"):
        MasterService(MasterConfig(snapshot_writer="thread"))


def test_the_log_past_a_snapshot_in_flight_is_bounded(tmp_path):
    """With snapshot_inflight_records=0 the master waits for the child at its next state change, so the
    log never holds more than one call's changes past a snapshot still being written."""
    m = service(tmp_path, snapshot_inflight_records=0)
    try:
        m.mount_segment(SegmentDescriptor(node_id="n0", segment_id=0, capacity_bytes=1 << 24))
        put_batch(m, 0, 60)
        assert m.snapshot_in_flight
        sealed_at = m.lsn
        put_batch(m, 60, 1)  # the first call past the seal waits for the child
        assert not m.snapshot_in_flight and m.last_snapshot_lsn == sealed_at
    finally:
        m.close()
    with pytest.raises(Exception, match="snapshot_inflight_records"):
        MasterService(MasterConfig(snapshot_inflight_records=-1))


def test_snapshots_come_as_rarely_as_the_restart_budget_allows(tmp_path):
    """snapshot_due_changes = max(floor, growth x objects, restart budget): the budget term shrinks as the
    table grows (loading it takes more of the budget) and vanishes at 0 s; a master follows it."""
    cfg = MasterConfig(snapshot_every_records=100, snapshot_growth=0.0, snapshot_inflight_records=10,
                       restart_budget_s=1e-3, restart_s_per_object=1e-6, restart_s_per_change=1e-6)
    assert cfg.snapshot_due_changes(0) == 1000 - 10
    assert cfg.snapshot_due_changes(500) == 500 - 10
    assert cfg.snapshot_due_changes(950) == 100  # the floor
    assert MasterConfig(restart_budget_s=0.0).snapshot_due_changes(10) == MasterConfig().snapshot_every_records
    big = MasterConfig(snapshot_growth=0.15)
    assert big.snapshot_due_changes(10_000_000) == 1_500_000  # growth, once loading alone exceeds the budget
    m = MasterService(dataclasses.replace(cfg, alignment_bytes=UNIT, snapshot_writer="inline"), data_dir=tmp_path)
    try:
        m.mount_segment(SegmentDescriptor(node_id="n0", segment_id=0, capacity_bytes=1 << 24))
        put_batch(m, 0, 200)  # 400 changes < due(200 objects) = 790
        put_batch(m, 200, 100)  # 600 < due(300) = 690
        assert m.snapshots_taken == 0
        put_batch(m, 300, 100)  # 700 >= due(400) = 590: the table grew into the budget
        assert m.snapshots_taken == 1
    finally:
        m.close()
    for bad in (dict(restart_budget_s=-1.0), dict(restart_s_per_change=0.0), dict(restart_s_per_object=float("nan"))):
        with pytest.raises(Exception, match="restart_"):
            MasterService(MasterConfig(**bad))


def _index_rows(m: MasterService) -> list:
    return sorted((e.block_hash, e.node, int(e.tier), e.identity, e.segment_id, e.offset_bytes, e.size_bytes)
                  for node in m.index.nodes() for e in m.index.entries_on_node(node))


def test_a_restart_fills_the_index_from_the_snapshots_residency_columns(tmp_path):
    """The residency keys a snapshot stores give the same index as hashing every key again (a snapshot
    without them, as older versions wrote, takes that path), for plain and kv: keys, several replicas,
    and objects that are pending or removed."""
    import msgpack
    import crc32c
    from quillcache.master import ReplicaConfig, kv_object_key
    from quillcache.master.snapshot import _HEAD, _MAGIC
    m = service(tmp_path, snapshot_writer="inline", snapshot_every_records=10**6)
    for i in range(3):
        m.mount_segment(SegmentDescriptor(node_id=f"n{i}", segment_id=i, capacity_bytes=1 << 24, tier=i % 2))
    keys = [f"plain-{i}" for i in range(40)] + [kv_object_key(i * 7919, bytes([i]) * 16) for i in range(40)]
    for i, k in enumerate(keys):
        m.put_start(k, UNIT * (1 + i % 3), ReplicaConfig(replica_num=1 + i % 3))
        if i % 9 != 4:
            m.put_end(k)
    m.remove(keys[3])
    want = _index_rows(m)
    assert len(want) > 80
    m.close()  # an inline snapshot with the residency columns
    again = service(tmp_path, snapshot_every_records=10**6)
    assert _index_rows(again) == want
    again.close()
    path = tmp_path / SNAPSHOT_NAME
    blob = path.read_bytes()
    doc = msgpack.unpackb(blob[_HEAD.size:], raw=False)
    assert "res_hash" in doc
    del doc["res_hash"], doc["res_ident"]
    payload = msgpack.packb(doc, use_bin_type=True)
    path.write_bytes(_HEAD.pack(_MAGIC, crc32c.crc32c(payload), len(payload)) + payload)
    old = service(tmp_path, snapshot_every_records=10**6)
    try:
        assert _index_rows(old) == want
    finally:
        old.close()
    doc["res_hash"], doc["res_ident"] = b"\0" * 8, b"\0" * 16  # not one per object: refused, naming the file
    payload = msgpack.packb(doc, use_bin_type=True)
    path.write_bytes(_HEAD.pack(_MAGIC, crc32c.crc32c(payload), len(payload)) + payload)
    with pytest.raises(Exception, match="residency columns"):
        service(tmp_path, snapshot_every_records=10**6)


def test_a_fork_that_fails_to_start_falls_back_to_an_inline_snapshot(mounted, monkeypatch, caplog):
    """fork() refused (e.g. for memory): the master stays writable, the sealed log keeps every record, and
    the next snapshot is written inline."""
    m, path = mounted

    def no_fork():
        raise OSError(12, "Cannot allocate memory (injected)")

    monkeypatch.setattr(SW.os, "fork", no_fork)
    put_batch(m, 0, 60)  # the snapshot is due: sealing works, the fork does not
    assert not m.snapshot_in_flight and "could not start in the background" in caplog.text
    monkeypatch.undo()
    put_batch(m, 60, 1)  # the next call writes it inline
    assert m.snapshots_taken == 1 and sealed_segments(str(path), RealFs()) == []
    want = table(m)
    m.close()
    again = service(path)
    try:
        assert table(again) == want and len(want) == 61
    finally:
        again.close()


def test_a_temporary_removed_by_an_orphaned_writer_during_recovery_is_not_an_error(tmp_path):
    """A SIGKILLed master's forked writer may still run and remove its own ``master.snap.tmp.<pid>`` (it publishes
    only while its parent lives) between the next master's listing and its cleanup: recovery goes on."""
    m = MasterService(MasterConfig(), data_dir=tmp_path)
    m.mount_segment(SegmentDescriptor(node_id="n", segment_id=0, capacity_bytes=1 << 20))
    m.close()
    (tmp_path / f"{SNAPSHOT_NAME}.tmp.1").write_bytes(b"half a snapshot")

    class Racing(RealFs):  # the orphan removes its temporary right after the listing
        def listdir(self, path: str) -> list[str]:
            names = super().listdir(path)
            gone = tmp_path / f"{SNAPSHOT_NAME}.tmp.1"
            if gone.exists():
                gone.unlink()
            return names

    again = MasterService(MasterConfig(), data_dir=str(tmp_path), fs=Racing())
    assert [s.segment_id for s in again.segments()] == [0]
    again.close()
