"""Regression tests of the second cluster review's findings (election, watch, registry, descriptors): each
forces its interleaving with a hook or an event and fails without its fix."""

from __future__ import annotations

import gc
import socket
import threading

import msgpack
import psutil
import pytest
from etcd_fixture import etcd, etcd_client, prefix  # noqa: F401
from polling import wait_until

from quillcache.cluster import election as election_module
from quillcache.cluster.client import EtcdClient
from quillcache.cluster.descriptors import DescriptorError, LeaderInfo, RegionInfo, SegmentDescriptor
from quillcache.cluster.election import LeaderElection
from quillcache.cluster.registry import EtcdRegistry, InMemoryRegistry
from quillcache.cluster.watch import Watch, WatchEvent

TTL_S = 2  # etcd's smallest lease


def _segment(node_id: str, capacity: int) -> SegmentDescriptor:
    return SegmentDescriptor(node_id=node_id, endpoint="127.0.0.1:7001", transport="tcp",
                             regions=(RegionInfo(1, capacity),), capacity_bytes=capacity)


def _threads(prefix_: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix_) and t.is_alive()]


# -- 1: resign() while a campaign on another thread is granting its lease -----------------------------------
class HeldGrantClient(EtcdClient):
    """The first lease grant waits (etcd answering slowly) until the test lets it through."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.in_grant = threading.Event()
        self.release = threading.Event()

    def grant(self, ttl_s: int) -> tuple[int, int]:
        if not self.in_grant.is_set():
            self.in_grant.set()
            self.release.wait(10)  # bounded: a broken test does not hang
        return super().grant(ttl_s)


def test_resign_during_a_campaigns_lease_grant_leaves_no_key_and_no_keeper(etcd, etcd_client, prefix):
    client = HeldGrantClient(etcd.endpoint)
    el = LeaderElection(client, "race", "a", "127.0.0.1:5301", ttl_s=TTL_S, prefix=prefix, warmup_s=0.2)
    out: dict = {}

    def campaign() -> None:
        try:
            out["epoch"] = el.campaign(timeout_s=20)
        except Exception as e:  # what the campaign ended with is checked below
            out["error"] = e

    t = threading.Thread(target=campaign)
    t.start()
    try:
        assert client.in_grant.wait(5), "the campaign asks for a lease"
        resigner = threading.Thread(target=el.resign)
        resigner.start()
        wait_until(el._cancel.is_set, 5, "resign() has begun")
        client.release.set()  # the grant answers after resign() began
        resigner.join(15)
        assert not resigner.is_alive(), "resign() returned"
        assert not t.is_alive(), "resign() returned only after the campaign it cancelled ended"
        assert isinstance(out.get("error"), election_module.NotLeaderError), out
        assert etcd_client.get(el.key) is None, "a resigned candidate holds no leader key"
        assert not _threads("etcd-lease election race (a)"), "no lease of the resigned candidate is kept alive"
    finally:
        client.release.set()
        t.join(15)
        el.resign()
        client.close()


# -- 2: a standby whose watch stream died silently still takes the free seat --------------------------------
class DeadWatch:
    """A watch whose stream died without a FIN/RST: it never delivers anything."""

    opened = threading.Event()

    def __init__(self, *args, **kw) -> None:
        DeadWatch.opened.set()

    def cancel(self) -> None:
        pass

    def __enter__(self) -> DeadWatch:
        return self

    def __exit__(self, *exc) -> None:
        pass


def test_a_standby_with_a_silent_watch_takes_the_seat_when_the_leader_resigns(etcd, prefix, monkeypatch):
    a = LeaderElection(etcd.endpoint, "silent", "a", "127.0.0.1:5311", ttl_s=TTL_S, prefix=prefix, warmup_s=0.1)
    b = LeaderElection(etcd.endpoint, "silent", "b", "127.0.0.1:5312", ttl_s=TTL_S, prefix=prefix, warmup_s=0.1)
    try:
        a.campaign(timeout_s=20)
        DeadWatch.opened.clear()
        monkeypatch.setattr(election_module, "Watch", DeadWatch)
        b.start()
        assert DeadWatch.opened.wait(10), "b lost the txn and waits on its (dead) watch"
        a.resign()
        wait_until(lambda: b.is_leader, 4 * TTL_S, "b leads although its watch never reported the delete")
    finally:
        a.resign()
        b.resign()


def test_an_idle_watch_stream_is_probed_so_a_dead_flow_breaks_within_seconds(etcd_client, prefix):
    if not all(hasattr(socket, n) for n in ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT")):
        pytest.skip("this platform has no per-socket TCP keep-alive timing")
    w = Watch(etcd_client, f"{prefix}/idle", lambda ev: None)
    try:
        assert w.created.wait(5), "etcd confirmed the watch"
        sock = wait_until(lambda: w._sock, 5, "the stream's socket")
        get = lambda opt: sock.getsockopt(socket.IPPROTO_TCP, opt)  # noqa: E731
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        dead_after_s = get(socket.TCP_KEEPIDLE) + get(socket.TCP_KEEPINTVL) * get(socket.TCP_KEEPCNT)
        assert dead_after_s <= 30, f"a silently dead watch flow is noticed only after {dead_after_s} s"
    finally:
        w.cancel()


# -- 4: each leadership's key monitor ends with it; a stale monitor's event is ignored --------------------
def test_losing_leadership_ends_its_key_monitor_and_a_late_event_of_an_old_epoch_is_ignored(etcd_client, prefix):
    el = LeaderElection(etcd_client, "mon", "a", "127.0.0.1:5321", ttl_s=TTL_S, prefix=prefix, warmup_s=0.1)
    monitor_name = "etcd-watch election mon leader"
    try:
        first = el.campaign(timeout_s=20)
        assert len(_threads(monitor_name)) == 1
        etcd_client.revoke(el._keeper.lease_id)  # the lease is lost: leadership ends
        wait_until(lambda: not el.is_leader, 5, "a steps down")
        wait_until(lambda: not _threads(monitor_name), 5, "the lost leadership's key monitor ended")
        second = el.campaign(timeout_s=20)
        assert second > first and len(_threads(monitor_name)) == 1
        kv = etcd_client.get(el.key)
        late = WatchEvent(kind="delete", key=el.key, kv=kv, prev=None, revision=second - 1)
        el._on_key_event(late, first)  # the earlier key's delete, delivered late by its monitor
        assert el.is_leader and el.epoch == second
    finally:
        el.resign()
    assert not _threads(monitor_name)


# -- 6: a change made while a new watcher's replay runs reaches it after the replay ------------------------
def test_a_registration_during_an_in_memory_watch_replay_arrives_after_it_in_order():
    reg = InMemoryRegistry()
    reg.register(_segment("a", 100))
    reg.register(_segment("b", 100))
    seen: list[tuple[str, str, int, int]] = []

    def callback(ev) -> None:
        seen.append((ev.kind, ev.node_id, ev.segment.capacity_bytes, ev.revision))
        if len(seen) == 1:  # another thread updates b while the replay is under way
            t = threading.Thread(target=reg.register, args=(_segment("b", 999),))
            t.start()
            t.join(10)
            assert not t.is_alive(), "a register() during a replay does not wait for it"

    reg.watch(callback)
    assert [s[:3] for s in seen] == [("join", "a", 100), ("join", "b", 100), ("update", "b", 999)]
    assert [s[3] for s in seen] == sorted(s[3] for s in seen)
    reg.register(_segment("c", 1))
    assert seen[-1][:2] == ("join", "c"), "after the replay, changes arrive at once"


# -- 9: a leader record's candidate_id must be a non-empty str ----------------------------------------------
@pytest.mark.parametrize("candidate_id", [None, 7, ["x"], {"a": 1}, ""])
def test_a_leader_record_with_a_bad_candidate_id_is_refused_by_name(candidate_id):
    raw = msgpack.packb({"v": 1, "candidate_id": candidate_id, "address": "127.0.0.1:5"})
    with pytest.raises(DescriptorError, match="candidate_id"):
        LeaderInfo.decode(raw, 3)
    assert LeaderInfo.decode(LeaderInfo.encode("m1", "127.0.0.1:5"), 3).candidate_id == "m1"


# -- 10: a registry or election made from an endpoint closes the client it made ----------------------------
def _etcd_sockets(etcd_port: int) -> int:
    gc.collect()
    return sum(1 for c in psutil.Process().net_connections(kind="tcp")
               if c.raddr and c.raddr.port == etcd_port and c.status == psutil.CONN_ESTABLISHED)


def test_closing_a_registry_or_election_made_from_an_endpoint_closes_its_connections(etcd, prefix):
    port = int(etcd.endpoint.rsplit(":", 1)[1])
    rounds = 4
    before = _etcd_sockets(port)
    for i in range(rounds):
        reg = EtcdRegistry(etcd.endpoint, prefix=prefix, ttl_s=TTL_S)
        reg.register(_segment(f"n{i}", 10))
        reg.close()
        el = LeaderElection(etcd.endpoint, "fd", f"c{i}", "127.0.0.1:5331", ttl_s=TTL_S, prefix=prefix,
                            warmup_s=0.0)
        el.campaign(timeout_s=20)
        el.resign()
    leaked = _etcd_sockets(port) - before
    assert leaked <= 1, f"{leaked} connections to etcd left open by {rounds} closed registries and elections"
