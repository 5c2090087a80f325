"""Regression tests of the master review's findings 1-5 (/tmp/s29/rev-master-report.txt); each fails without
its fix:

1. a call whose operation-log record would be larger than the WAL takes is refused before it is applied
   (RecordEncodeError, nothing changed, the service stays writable); should the WAL still refuse a record,
   the service turns failed instead of keeping an unlogged change;
2. recovery with a snapshot newer than the active log file deletes each covered sealed segment once;
3. kv: keys are parsed only in lowercase hex (two keys differing in hex case are two index entries); a
   snapshot made with the old mapping does not fill the index with its stored residency columns, and an
   on-disk index next to it is rebuilt;
4. a fork that fails leaks neither end of the snapshot writer's pipe;
5. follow() turns the service failed for a record that does not decode, and an HA standby whose service
   failed reopens it and catches up (real etcd; skipped without it).
"""

from __future__ import annotations

import errno
import os
import shutil

import msgpack
import pytest

from etcd_fixture import etcd, prefix  # noqa: F401
from polling import wait_until
from quillcache.durability import wal
from quillcache.durability.fs import RealFs
from quillcache.index import open_index
from quillcache.index.keys import ResidencyEntry
from quillcache.master import (MasterConfig, MasterService, PutRequest, SegmentDescriptor,
                               residency_key)
from quillcache.master import replicated
from quillcache.master import snapshot_writer as SW
from quillcache.master._residency import residency_key1, residency_keys
from quillcache.master.errors import LogFailedError, MasterError, RecordEncodeError
from quillcache.master.oplog import sealed_segments
from quillcache.master.snapshot import _HEAD, _MAGIC, SNAPSHOT_NAME
from quillcache.types import CacheTier

UNIT = 64


def seg(node: str, sid: int, capacity_bytes: int = 4096 * UNIT) -> SegmentDescriptor:
    return SegmentDescriptor(node_id=node, segment_id=sid, capacity_bytes=capacity_bytes)


def cfg(**kw) -> MasterConfig:
    base = dict(alignment_bytes=UNIT, index_kind="flat", snapshot_writer="inline", snapshot_every_s=86400.0)
    base.update(kw)
    return MasterConfig(**base)


@pytest.fixture
def masters():
    opened: list[MasterService] = []
    yield opened
    for m in opened:
        if not m._closed:
            m.close()


# ---------------------------------------------------------------- #1 a call past the WAL's record limit
@pytest.mark.parametrize("form", ["batch", "columns", "leader"])
def test_a_call_past_the_wal_record_limit_is_refused_before_it_changes_anything(tmp_path, masters, monkeypatch,
                                                                                  form):
    monkeypatch.setattr(wal, "MAX_PAYLOAD_BYTES", 1 << 20)  # (the real 256 MiB takes ~66k keys of 4 KiB)
    d = str(tmp_path / "m")
    m = MasterService(cfg(), data_dir=d, replicate=(lambda recs: None) if form == "leader" else None)
    masters.append(m)
    if form == "leader":
        m.promote(1)
    m.mount_segment(seg("n0", 0))
    m.put_start("small", 10)
    lsn = m.lsn
    keys = [f"{i:04d}" + "x" * 4000 for i in range(300)]  # ~1.2 MB of keys in one record
    with pytest.raises(RecordEncodeError, match="over the limit"):
        if form == "columns":
            m.batch_put_start_columns(keys, [10] * len(keys))
        else:
            m.batch_put_start([PutRequest(key=k, size_bytes=10) for k in keys])
    assert m.failed is None and m.lsn == lsn and m.keys() == ["small"]
    assert m.exists(keys[:1]) == [False]
    m.check_invariants()
    m.put_end("small")  # still writable: the log is where memory is
    m.batch_put_start([PutRequest(key=k, size_bytes=10) for k in keys[:100]])  # a smaller batch fits
    want = sorted(m.keys())
    m.close()
    again = MasterService(cfg(), data_dir=d)
    masters.append(again)
    assert sorted(again.keys()) == want and len(want) == 101


@pytest.mark.parametrize("leader", [False, True])
def test_a_record_the_wal_still_refuses_turns_the_service_failed(tmp_path, masters, monkeypatch, leader):
    """The backstop: a record the check in _record let through (headroom patched away) that the WAL
    refuses (ValueError) turns the service failed; the change is never answered nor made durable."""
    monkeypatch.setattr(wal, "MAX_PAYLOAD_BYTES", 1 << 20)
    monkeypatch.setattr(replicated, "_BATCH_HEADROOM", -(1 << 20))
    d = str(tmp_path / "m")
    m = MasterService(cfg(), data_dir=d, replicate=(lambda recs: None) if leader else None)
    masters.append(m)
    if leader:
        m.promote(1)
    m.mount_segment(seg("n0", 0))
    keys = [f"{i:04d}" + "x" * 4000 for i in range(300)]
    with pytest.raises(LogFailedError, match="exceeds"):
        m.batch_put_start([PutRequest(key=k, size_bytes=10) for k in keys])
    assert isinstance(m.failed, ValueError)
    with pytest.raises(LogFailedError):
        m.exists(keys[:1])
    m.close()
    again = MasterService(cfg(), data_dir=d)
    masters.append(again)
    assert again.keys() == []


# ---------------------------------------------------------------- #2 covered segments deleted once
def test_a_snapshot_newer_than_the_active_log_restarts_at_once(tmp_path, masters):
    live, crashed = str(tmp_path / "live"), str(tmp_path / "crashed")
    m = MasterService(cfg(), data_dir=live)
    masters.append(m)
    m.mount_segment(seg("n0", 0))

    def ops(tag: str, n: int) -> None:
        for i in range(n):
            m.put_start(f"{tag}{i}", 64)
            m.put_end(f"{tag}{i}")

    ops("a", 2)
    m._log.seal()  # two sealed segments (snapshots whose drop_through never ran), then the active file
    ops("b", 2)
    m._log.seal()
    ops("c", 2)
    assert len(sealed_segments(live, RealFs())) == 2
    shutil.copytree(live, crashed, ignore=shutil.ignore_patterns("master.lock"))
    ops("d", 3)  # the leader goes on; a crash leaves its snapshot installed over the older log
    with open(os.path.join(crashed, SNAPSHOT_NAME), "wb") as f:
        f.write(m.snapshot_bytes())
    again = MasterService(cfg(), data_dir=crashed)  # was FileNotFoundError (a segment unlinked twice)
    masters.append(again)
    assert again.lsn == m.lsn and sorted(again.keys()) == sorted(m.keys())
    assert sealed_segments(crashed, RealFs()) == []


# ---------------------------------------------------------------- #3 kv: keys are lowercase hex only
LOWER = "kv:00000000000000ab:" + "cd" * 16
UPPER = "kv:00000000000000AB:" + "cd" * 16


def _blake(key: str) -> tuple[int, bytes]:
    import hashlib
    d = hashlib.blake2b(key.encode(), digest_size=24).digest()
    return int.from_bytes(d[:8], "big"), d[8:]


def test_kv_keys_that_differ_in_hex_case_are_two_index_entries(masters):
    hashes, idents = residency_keys([LOWER, UPPER])
    assert residency_key(LOWER) == residency_key1(LOWER) == (0xAB, b"\xcd" * 16)
    assert residency_key(UPPER) == residency_key1(UPPER) == (int(hashes[1]), idents[16:]) == _blake(UPPER)
    m = MasterService(cfg())
    masters.append(m)
    m.mount_segment(seg("n0", 0))
    for k in (LOWER, UPPER):
        m.put_start(k, 64)
        m.put_end(k)
    m.remove(UPPER)
    assert m.exists([LOWER, UPPER]) == [True, False]
    assert [(e.block_hash, e.identity) for e in m.index.locate([0xAB])[0]] == [(0xAB, b"\xcd" * 16)]
    assert m.index.locate([_blake(UPPER)[0]]) == [[]]


def _as_old_snapshot(path: str) -> None:
    """Rewrite ``path``'s snapshot as the old mapping wrote it: no res_version, kv: keys of either case
    parsed into the residency columns."""
    import crc32c
    import numpy as np
    blob = open(path, "rb").read()
    doc = msgpack.unpackb(blob[_HEAD.size:], raw=False)
    assert doc.pop("res_version") == 2
    old = [(int(k[3:19], 16), bytes.fromhex(k[20:])) if k.startswith("kv:") else residency_key(k) for k in doc["keys"]]
    doc["res_hash"] = np.asarray([h for h, _ in old], dtype="<u8").tobytes()
    doc["res_ident"] = b"".join(i for _, i in old)
    payload = msgpack.packb(doc, use_bin_type=True)
    with open(path, "wb") as f:
        f.write(_HEAD.pack(_MAGIC, crc32c.crc32c(payload), len(payload)) + payload)


def test_a_snapshot_with_the_old_kv_mapping_does_not_fill_the_index_from_its_columns(tmp_path, masters):
    d = str(tmp_path / "m")
    m = MasterService(cfg(), data_dir=d)
    m.mount_segment(seg("n0", 0))
    for k in (UPPER, "plain"):
        m.put_start(k, 64)
        m.put_end(k)
    m.close()
    _as_old_snapshot(os.path.join(d, SNAPSHOT_NAME))
    again = MasterService(cfg(), data_dir=d)
    masters.append(again)
    assert again.index.locate([0xAB]) == [[]]  # not under the old (parsed) key
    assert [e.identity for e in again.index.locate([_blake(UPPER)[0]])[0]] == [_blake(UPPER)[1]]
    again.remove(UPPER, force=True)
    assert again.index.locate([_blake(UPPER)[0]]) == [[]]


def test_an_on_disk_index_next_to_an_old_snapshot_is_rebuilt(tmp_path, masters):
    d = str(tmp_path / "m")
    conf = cfg(index_kind="art", index_on_disk=True)
    m = MasterService(conf, data_dir=d)
    m.mount_segment(seg("n0", 0))
    m.put_start(UPPER, 64)
    m.put_end(UPPER)
    m.close()
    _as_old_snapshot(os.path.join(d, SNAPSHOT_NAME))
    index = open_index("art", os.path.join(d, "index"), fs=RealFs())  # what the old mapping had written
    (entry,) = [e for n in index.nodes() for e in index.entries_on_node(n)]
    index.remove([entry.key])
    index.put([ResidencyEntry(0xAB, "n0", CacheTier(entry.tier), b"\xcd" * 16, entry.segment_id,
                              entry.offset_bytes, entry.size_bytes)])
    index.close()
    again = MasterService(conf, data_dir=d)
    masters.append(again)
    assert again.index.locate([0xAB]) == [[]]
    assert len(again.index.locate([_blake(UPPER)[0]])[0]) == 1


# ---------------------------------------------------------------- #4 a failed fork leaks no fd
@pytest.mark.skipif(not hasattr(os, "fork") or not os.path.isdir("/proc/self/fd"), reason="needs fork and /proc")
def test_a_fork_that_fails_closes_both_ends_of_the_pipe(tmp_path, masters, monkeypatch):
    m = MasterService(cfg(), data_dir=str(tmp_path / "m"))
    masters.append(m)

    def no_fork():
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    writer = SW.ForkSnapshotWriter()
    before = sorted(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "fork", no_fork)
    for _ in range(3):
        with pytest.raises(OSError, match="Cannot allocate"):
            writer.start(RealFs(), m.data_dir, m._state)
    monkeypatch.undo()
    assert sorted(os.listdir("/proc/self/fd")) == before and not writer.busy


# ---------------------------------------------------------------- #5 follow failures
def test_a_record_that_does_not_decode_turns_a_follower_failed(tmp_path, masters):
    m = MasterService(cfg(), data_dir=str(tmp_path / "m"), replicate=lambda recs: None)
    masters.append(m)
    with pytest.raises(ValueError, match="not msgpack"):
        m.follow([(m.lsn + 1, b"\xc1")])
    assert isinstance(m.failed, ValueError)
    with pytest.raises(LogFailedError):  # until its owner reopens it
        m.follow([(m.lsn + 1, b"\xc1")])


def test_a_standby_whose_follow_failed_reopens_and_catches_up(etcd, prefix, tmp_path):  # noqa: F811
    from quillcache.master.ha import HaMaster
    from quillcache.master.server import MasterEndpoint

    def ha(cid: str) -> HaMaster:
        return HaMaster(str(tmp_path / cid), MasterConfig(), etcd=etcd.endpoint, name="m", candidate=cid, ttl_s=2,
                        prefix=prefix)

    def follows(standby: HaMaster) -> bool:
        try:
            return standby.service.failed is None and standby.service.exists(["after"]) == [True]
        except MasterError:
            return False

    lead, standby = ha("a"), None
    try:
        assert lead.start("127.0.0.1:1") and lead.wait_decided(30) == "leader"
        ep = MasterEndpoint(lead)
        ep.mount_segment(seg("n0", 0))
        standby = ha("b")
        assert standby.start("127.0.0.1:2") and standby.wait_decided(30) == "standby"
        wait_until(lambda: standby.service.lsn == lead.service.lsn, 10, "the standby follows")
        with standby.lock:
            with pytest.raises(ValueError):
                standby.service.follow([(standby.service.lsn + 1, b"\xc1")])  # a record it could not apply
            assert standby.service.failed is not None
        r = ep.put_start("after", 10)
        ep.put_end("after", put_id=r.put_id)
        wait_until(lambda: follows(standby), 10, "the failed standby reopens and follows again")
    finally:
        if standby is not None:
            standby.close()
        lead.close()


def test_close_racing_the_campaign_loops_next_campaign_leaves_no_leader_key(etcd, prefix, tmp_path,  # noqa: F811
                                                                             monkeypatch):
    """A campaign the loop begins between its stop check and close()'s resign is not waited for by that resign;
    close() resigns again once the loops have ended, so no key (and no lease keeping it) outlives the master."""
    import threading

    from quillcache.cluster import election as E
    from quillcache.cluster.client import EtcdClient
    from quillcache.master.ha import HaMaster

    resigned = threading.Event()
    real_campaign, real_resign = E.LeaderElection.campaign, E.LeaderElection.resign

    def late_campaign(self, *a, **kw):  # the loop passed its stop check; close() resigns before this campaigns
        resigned.wait(10)
        return real_campaign(self, *a, **kw)

    def noting_resign(self):
        real_resign(self)
        resigned.set()

    monkeypatch.setattr(E.LeaderElection, "campaign", late_campaign)
    monkeypatch.setattr(E.LeaderElection, "resign", noting_resign)
    m = HaMaster(str(tmp_path / "a"), MasterConfig(), etcd=etcd.endpoint, name="m", candidate="a", ttl_s=2,
                 prefix=prefix)
    try:
        assert m.start("127.0.0.1:1")
        key = m.election.key
    finally:
        m.close()
    client = EtcdClient(etcd.endpoint)
    try:
        assert client.get(key) is None, "a campaign begun as close() resigned still holds the leader key"
    finally:
        client.close()
    assert not [t.name for t in threading.enumerate() if t.is_alive() and "etcd-lease" in t.name and "(a)" in t.name]
