"""The node registry: descriptors, the in-memory registry on a fake clock, and the etcd registry on a real etcd
(register, list, watch joins/updates/leaves, a node's lease expiring after its process is SIGKILLed)."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from etcd_fixture import NODE_SCRIPT, Child, etcd, etcd_client, prefix  # noqa: F401
from polling import wait_until

from quillcache.cluster.client import EtcdUnavailableError
from quillcache.cluster.descriptors import DescriptorError, LeaderInfo, RegionInfo, SegmentDescriptor, election_key
from quillcache.cluster.etcd import free_port
from quillcache.cluster.registry import (NODE_REGISTRIES, EtcdRegistry, InMemoryRegistry, NodeIdTakenError,
                                         UnknownNodeError, make_registry)
from quillcache.registry import UnknownNameError


def seg(node_id: str, port: int = 7000, regions=((0, 1024),), capacity: int | None = None) -> SegmentDescriptor:
    infos = tuple(RegionInfo(rid, size) for rid, size in regions)
    return SegmentDescriptor(node_id=node_id, endpoint=f"10.0.0.1:{port}", transport="tcp", regions=infos,
                             capacity_bytes=capacity if capacity is not None else sum(s for _, s in regions))


class Recorder:
    """A watch callback that keeps (kind, node_id) pairs; ``wait_for`` polls with a deadline."""

    def __init__(self) -> None:
        self.events = []
        self._lock = threading.Lock()

    def __call__(self, ev) -> None:
        with self._lock:
            self.events.append(ev)

    def pairs(self) -> list[tuple[str, str]]:
        with self._lock:
            return [(e.kind, e.node_id) for e in self.events]

    def wait_for(self, pair: tuple[str, str], timeout_s: float = 5.0) -> None:
        wait_until(lambda: pair in self.pairs(), timeout_s, f"event {pair}; got {self.pairs()}")


# -- descriptors --------------------------------------------------------------------------------------------
def test_descriptor_round_trips_through_msgpack():
    d = seg("n1", regions=((0, 4096), (3, 8192)), capacity=1 << 20)
    assert SegmentDescriptor.from_bytes(d.to_bytes()) == d
    assert d.registered_bytes == 12288


@pytest.mark.parametrize("kwargs, match", [
    (dict(node_id="", endpoint="h:1", transport="tcp"), "node_id"),
    (dict(node_id="a/b", endpoint="h:1", transport="tcp"), "node_id"),
    (dict(node_id="n", endpoint="nohost", transport="tcp"), "endpoint"),
    (dict(node_id="n", endpoint="h:70000", transport="tcp"), "endpoint"),
    (dict(node_id="n", endpoint="h:1", transport=""), "transport"),
    (dict(node_id="n", endpoint="h:1", transport="tcp", regions=(RegionInfo(1, 8), RegionInfo(1, 8)),
          capacity_bytes=16), "unique"),
    (dict(node_id="n", endpoint="h:1", transport="tcp", regions=(RegionInfo(1, 8),), capacity_bytes=4),
          "capacity_bytes=4 must be >= 8"),
])
def test_descriptor_refuses_bad_fields_naming_them(kwargs, match):
    with pytest.raises(DescriptorError, match=match):
        SegmentDescriptor(**kwargs)


@pytest.mark.parametrize("rid, size", [(-1, 8), (0, 0), (True, 8), (0, 1.5)])
def test_region_info_refuses_bad_ids_and_sizes(rid, size):
    with pytest.raises(DescriptorError):
        RegionInfo(rid, size)


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x93\x01\x02\x03", b"\x81\xa1v\x02"])
def test_damaged_values_raise_descriptor_error(data):
    with pytest.raises(DescriptorError):
        SegmentDescriptor.from_bytes(data)
    with pytest.raises(DescriptorError):
        LeaderInfo.decode(data, 1)


# -- registry by name ------------------------------------------------------------------------------------------
def test_registries_are_registered_by_name():
    assert NODE_REGISTRIES.names() == ["memory", "etcd"]
    assert isinstance(make_registry("memory"), InMemoryRegistry)
    with pytest.raises(UnknownNameError, match="'memory'"):
        make_registry("zookeeper")
    with pytest.raises(TypeError, match="ttl"):
        make_registry("memory", tll_s=3)


# -- in memory ------------------------------------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_memory_registry_lists_watches_and_expires_on_its_clock():
    clock = FakeClock()
    reg = InMemoryRegistry(ttl_s=10.0, clock=clock)
    early = Recorder()
    reg.register(seg("b"))
    reg.watch(early)  # replays b
    reg.register(seg("a"))
    reg.register(seg("a", port=7001))  # update
    assert [s.node_id for s in reg.nodes()] == ["a", "b"]
    clock.now = 6.0
    reg.heartbeat("a")
    clock.now = 10.0  # b's TTL is over, a's runs to 16
    assert [s.node_id for s in reg.nodes()] == ["a"]
    with pytest.raises(UnknownNodeError, match="register it again"):
        reg.heartbeat("b")
    assert reg.unregister("a") and not reg.unregister("a")
    assert early.pairs() == [("join", "b"), ("join", "a"), ("update", "a"), ("leave", "b"), ("leave", "a")]
    assert early.events[3].segment == seg("b")  # a leave carries the last descriptor
    revisions = [e.revision for e in early.events[1:]]
    assert revisions == sorted(revisions)


def test_memory_registry_without_ttl_keeps_nodes_and_master_address():
    reg = InMemoryRegistry()
    reg.register(seg("n"))
    assert reg.expire() == [] and reg.nodes() == [seg("n")]
    assert reg.master_address() is None
    reg.set_master_address("127.0.0.1:5000")
    assert reg.master_address() == "127.0.0.1:5000"
    with pytest.raises(DescriptorError):
        reg.set_master_address("nowhere")
    rec = Recorder()
    handle = reg.watch(rec, replay=False)
    handle.cancel()
    reg.close()
    assert reg.nodes() == [] and rec.pairs() == []


def test_register_takes_only_descriptors():
    with pytest.raises(TypeError, match="SegmentDescriptor"):
        InMemoryRegistry().register({"node_id": "n"})


# -- etcd -----------------------------------------------------------------------------------------------------
def test_etcd_registry_register_list_watch(etcd, prefix):
    with EtcdRegistry(etcd.endpoint, prefix=prefix, ttl_s=2) as reg, \
            EtcdRegistry(etcd.endpoint, prefix=prefix, ttl_s=2) as other:
        reg.register(seg("b", regions=((0, 4096), (1, 4096))))
        rec = Recorder()
        handle = other.watch(rec)
        rec.wait_for(("join", "b"))
        reg.register(seg("a"))
        rec.wait_for(("join", "a"))
        reg.register(seg("a", port=7002))
        rec.wait_for(("update", "a"))
        assert other.nodes() == [seg("a", port=7002), seg("b", regions=((0, 4096), (1, 4096)))]
        assert reg.unregister("a") and not reg.unregister("a")
        rec.wait_for(("leave", "a"))
        assert [s.node_id for s in other.nodes()] == ["b"]
        handle.cancel()
        assert rec.pairs() == [("join", "b"), ("join", "a"), ("update", "a"), ("leave", "a")]
        assert rec.events[-1].segment == seg("a", port=7002)
    with EtcdRegistry(etcd.endpoint, prefix=prefix) as after:  # closing revoked the lease: b left at once
        assert after.nodes() == []


def test_node_id_live_under_another_lease_is_refused(etcd, prefix):
    with EtcdRegistry(etcd.endpoint, prefix=prefix, ttl_s=2) as one, \
            EtcdRegistry(etcd.endpoint, prefix=prefix, ttl_s=2) as two:
        one.register(seg("n"))
        with pytest.raises(NodeIdTakenError, match="'n' is live under another registration"):
            two.register(seg("n", port=7009))
        assert one.nodes() == [seg("n")]


def test_node_leaves_when_its_process_dies_and_its_lease_expires(etcd, prefix):
    ttl_s = 2
    with EtcdRegistry(etcd.endpoint, prefix=prefix) as watcher:
        rec = Recorder()
        watcher.watch(rec, replay=False)
        child = Child(NODE_SCRIPT, etcd.endpoint, prefix, "doomed", str(ttl_s))
        try:
            assert child.readline(30) == "ok"
            rec.wait_for(("join", "doomed"))
            time.sleep(ttl_s)  # let it renew a few times: a live node must not leave
            assert [s.node_id for s in watcher.nodes()] == ["doomed"]
            child.signal(signal.SIGKILL)
            killed = time.monotonic()
            rec.wait_for(("leave", "doomed"), timeout_s=3 * ttl_s)
            took = time.monotonic() - killed
        finally:
            child.close()
        assert took <= ttl_s + 1.0, took  # the lease's TTL, plus etcd's expiry check period (0.5 s)
        assert watcher.nodes() == []
        assert rec.events[-1].segment.endpoint == "127.0.0.1:7001"


def test_master_address_is_the_election_record(etcd, etcd_client, prefix):
    with EtcdRegistry(etcd.endpoint, prefix=prefix) as reg:
        assert reg.master_address() is None
        etcd_client.put(election_key("master", prefix), LeaderInfo.encode("m1", "10.1.1.1:5555"))
        assert reg.master_address() == "10.1.1.1:5555"
        assert reg.master().candidate_id == "m1" and reg.master().epoch > 0


def test_etcd_registry_by_name(etcd, prefix):
    reg = make_registry("etcd", endpoint=etcd.endpoint, prefix=prefix, ttl_s=3)
    try:
        assert isinstance(reg, EtcdRegistry) and reg.nodes() == []
    finally:
        reg.close()


def test_etcd_registry_with_etcd_down_names_the_endpoint():
    endpoint = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(EtcdUnavailableError, match=f"etcd at {endpoint} is not reachable") as info:
        make_registry("etcd", endpoint=endpoint, connect_timeout_s=0.5)
    assert info.value.endpoint == endpoint
    assert time.monotonic() - started < 5


def test_registry_registers_again_under_a_new_lease_when_etcd_drops_its_lease(etcd, etcd_client, prefix):
    from quillcache.cluster.descriptors import node_key
    with EtcdRegistry(etcd.endpoint, prefix=prefix, ttl_s=2) as reg, EtcdRegistry(etcd.endpoint, prefix=prefix) as w:
        rec = Recorder()
        w.watch(rec, replay=False)
        reg.register(seg("n"))
        rec.wait_for(("join", "n"))
        old_lease = etcd_client.get(node_key("n", prefix)).lease
        etcd_client.revoke(old_lease)  # as if etcd had lost it
        rec.wait_for(("leave", "n"))
        wait_until(lambda: rec.pairs().count(("join", "n")) == 2, 5, f"re-registration; saw {rec.pairs()}")
        kv = etcd_client.get(node_key("n", prefix))
        assert kv.lease not in (0, old_lease) and SegmentDescriptor.from_bytes(kv.value) == seg("n")
