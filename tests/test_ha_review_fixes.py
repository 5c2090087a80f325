"""Review fixes of master HA, through a real etcd (``etcd_fixture``; skipped, saying how to get etcd, when there is
none): a plain put over a leader's election key (garbage, or its own record without the lease) deposes that leader
and the group elects again (the lease-less key is deleted, with a WARNING naming the key and the endpoint); a key
that does not decode but has a lease is reported once and never deleted by a candidate; one election win promotes
its epoch once although both the follow loop and ``on_elected`` ask for it."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from etcd_fixture import etcd, etcd_client, prefix  # noqa: F401
from polling import wait_until

from quillcache.cluster.descriptors import LeaderInfo, election_key
from quillcache.cluster.election import LeaderElection
from quillcache.master import MasterConfig, NotLeaderError, SegmentDescriptor, StaleEpochError
from quillcache.master.replicated import ReplicatedMode

TTL_S = 2  # etcd's smallest lease
LOGGER = "quillcache.cluster.election"


def candidate(etcd, prefix, cid, port, **kw) -> LeaderElection:  # noqa: F811
    return LeaderElection(etcd.endpoint, "master", cid, f"127.0.0.1:{port}", ttl_s=TTL_S, prefix=prefix,
                          warmup_s=0.1, **kw)


def foreign_warnings(caplog, key: str, endpoint: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == LOGGER
            and key in r.getMessage() and endpoint in r.getMessage()]


@pytest.mark.parametrize("overwrite", ["garbage", "own record without its lease"])
def test_a_plain_put_over_the_leaders_key_deposes_it_and_the_group_elects_again(etcd, etcd_client, prefix,  # noqa: F811
                                                                              caplog, overwrite):
    lost: list[str] = []
    a = candidate(etcd, prefix, "a", 7001, on_lost=lost.append)
    b = candidate(etcd, prefix, "b", 7002)
    key = election_key("master", prefix)
    try:
        old_epoch = a.campaign(timeout_s=10)
        b.start()  # watches a's key
        value = b"garbage-over-the-leader" if overwrite == "garbage" else etcd_client.get(key).value
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            etcd_client.put(key, value)  # no lease: the key no longer goes with a's lease
            wait_until(lambda: not a.is_leader, 5, "a steps down when its key is overwritten")
            wait_until(lambda: lost, 5, "a's on_lost callback (it runs after is_leader turns false)")
            assert "overwritten" in lost[0] and len(lost) == 1
            leader = wait_until(lambda: next((c for c in (a, b) if c.is_leader), None), 6 * TTL_S,
                                "a candidate leads again")
        kv = etcd_client.get(key)
        assert kv.create_revision == leader.epoch > old_epoch and kv.lease != 0
        assert LeaderInfo.decode(kv.value, kv.create_revision).candidate_id == leader.candidate_id
        # (no foreign-key WARNING is asserted here: the deposed leader's own clean-up may remove the overwritten
        # key before a candidate reads it; the lease-less and undecodable cases below assert theirs)
    finally:
        a.resign()
        b.resign()


def test_a_garbage_key_without_a_lease_is_deleted_with_one_warning(etcd, etcd_client, prefix, caplog):  # noqa: F811
    key = election_key("master", prefix)
    etcd_client.put(key, b"\xff\x00garbage")
    c = candidate(etcd, prefix, "c", 7101)
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            epoch = c.campaign(timeout_s=4 * TTL_S)
        assert c.is_leader and etcd_client.get(key).create_revision == epoch
        warned = foreign_warnings(caplog, key, etcd.endpoint)
        assert len(warned) == 1 and "garbage" in warned[0], caplog.text
    finally:
        c.resign()


def test_an_undecodable_key_with_a_lease_is_reported_once_and_never_deleted(etcd, etcd_client, prefix,  # noqa: F811
                                                                            caplog):
    key = election_key("master", prefix)
    lease, _ttl = etcd_client.grant(60)
    etcd_client.put(key, b"not-a-leader-record", lease)
    c = candidate(etcd, prefix, "c", 7201)
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            with pytest.raises(TimeoutError):
                c.campaign(timeout_s=2.5 * TTL_S)  # re-reads the key (every TTL) more than once meanwhile
        kv = etcd_client.get(key)
        assert kv is not None and kv.value == b"not-a-leader-record" and kv.lease == lease
        warned = foreign_warnings(caplog, key, etcd.endpoint)
        assert len(warned) == 1 and "not-a-leader-record" in warned[0], caplog.text
        etcd_client.revoke(lease)  # its holder goes: the key goes with the lease, and the candidate wins
        assert c.campaign(timeout_s=4 * TTL_S) and c.is_leader
    finally:
        etcd_client.revoke(lease)
        c.resign()


def _write(master, key: str) -> None:
    from quillcache.master.server import MasterEndpoint
    ep = MasterEndpoint(master)
    r = ep.put_start(key, 10)
    ep.put_end(key, put_id=r.put_id)


def test_a_master_group_recovers_from_garbage_over_its_leaders_key(etcd, etcd_client, prefix, tmp_path):  # noqa: F811
    from quillcache.master.ha import HaMaster
    from quillcache.master.server import MasterEndpoint

    masters = []
    try:
        for cid in ("a", "b"):
            m = HaMaster(str(tmp_path / cid), MasterConfig(), etcd=etcd.endpoint, name="m", candidate=cid,
                         ttl_s=TTL_S, prefix=prefix)
            masters.append(m)
            assert m.start(f"127.0.0.1:{7300 + len(masters)}")
        a, b = masters
        assert a.wait_decided(30) == "leader"
        MasterEndpoint(a).mount_segment(SegmentDescriptor(node_id="n0", segment_id=0, capacity_bytes=1 << 30))
        _write(a, "before")
        etcd_client.put(election_key("m", prefix), b"garbage-over-the-leader")
        with pytest.raises((StaleEpochError, NotLeaderError)):
            _write(a, "refused")  # fenced, or refused once the election saw the put

        def leader():
            for m in masters:
                with m.lock:
                    if m.role == "leader" and m.election.is_leader:
                        return m
            return None

        new = wait_until(leader, 8 * TTL_S, "a master leads again after the garbage put")
        _write(new, "after")
        assert new.service.exists(["before", "refused", "after"]) == [True, False, True]
    finally:
        for m in masters:
            m.close()


def test_a_fenced_leader_whose_watch_missed_the_put_gives_up_the_epoch(etcd, etcd_client, prefix,  # noqa: F811
                                                                       tmp_path):
    from quillcache.master.ha import HaMaster
    from quillcache.master.server import MasterEndpoint

    m = HaMaster(str(tmp_path / "a"), MasterConfig(), etcd=etcd.endpoint, name="m", candidate="a", ttl_s=TTL_S,
                 prefix=prefix)
    try:
        assert m.start("127.0.0.1:7401")
        assert m.wait_decided(30) == "leader"
        old_epoch = m.epoch
        MasterEndpoint(m).mount_segment(SegmentDescriptor(node_id="n0", segment_id=0, capacity_bytes=1 << 30))
        _write(m, "before")
        m.election._monitor.cancel()  # a watch stream that died silently: only the fence tells
        etcd_client.put(election_key("m", prefix), b"garbage-over-the-leader")
        with pytest.raises(StaleEpochError):
            _write(m, "refused")
        wait_until(lambda: m.role == "leader" and m.epoch > old_epoch and m.election.is_leader, 8 * TTL_S,
                   "the only master campaigns again and leads a new epoch")
        _write(m, "after")
        assert m.service.exists(["before", "refused", "after"]) == [True, False, True]
    finally:
        m.close()


def test_one_election_win_promotes_its_epoch_once(etcd, prefix, tmp_path, monkeypatch):  # noqa: F811
    from quillcache.master.ha import HaMaster

    promoted: list[int] = []
    real_promote = ReplicatedMode.promote

    def counting_promote(self, epoch: int) -> None:
        promoted.append(epoch)
        real_promote(self, epoch)

    monkeypatch.setattr(ReplicatedMode, "promote", counting_promote)
    m = HaMaster(str(tmp_path / "x"), MasterConfig(), etcd=etcd.endpoint, name="m", candidate="x", ttl_s=TTL_S,
                 prefix=prefix)
    done = threading.Event()
    real_on_elected = m._on_elected

    def late_on_elected(epoch: int) -> None:
        # a campaign thread descheduled after the election set its epoch: the follow loop promotes first
        deadline = time.monotonic() + 10
        while m.role != "leader" and time.monotonic() < deadline:
            time.sleep(0.02)  # the poll interval of a deadline-bounded wait
        real_on_elected(epoch)
        done.set()

    m._on_elected = late_on_elected  # start() hands this to the election
    try:
        assert m.start("127.0.0.1:1")
        assert done.wait(30)
        assert m.role == "leader" and promoted == [m.epoch], promoted
        assert m.service.lsn == 1  # one EPOCH record
    finally:
        m.close()
