"""Regression tests of the cluster/pool review's findings: each forces its interleaving with a hook or an
event (no sleep-and-hope) and fails without its fix."""

from __future__ import annotations

import errno
import threading
import time

import pytest
from etcd_fixture import etcd, etcd_client, prefix, require_etcd  # noqa: F401
from polling import wait_until

from quillcache.cluster.client import Backoff, EtcdClient, EtcdError
from quillcache.cluster import etcd as etcd_module
from quillcache.cluster.election import LeaderElection
from quillcache.cluster.etcd import EtcdProcess
from quillcache.cluster.registry import EtcdRegistry
from quillcache.master.types import MasterConfig
from quillcache.cluster.watch import Watch
from quillcache.pool import PoolError
from quillcache.pool.cache import LocalCache
from quillcache.pool.embedded import EmbeddedPool, embedded_store
from quillcache.pool.node import PoolNode

TTL_S = 2  # etcd's smallest lease


# -- 1: a lease whose local deadline passed unnoticed is not reused ------------------------------------------
class HeldFirstAnswerClient(EtcdClient):
    """etcd renews the lease at once, but the FIRST keep-alive answer reaches the keeper only when the
    candidate has given that lease up (it revoked it) or its campaign hit the dead lease: a keeper stuck in
    a late answer, so its deadline passes while it has not noticed (``lost_reason`` stays None)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.armed = True
        self.holding = threading.Event()
        self.release = threading.Event()
        self.revoked: list[int] = []
        self.refused: list[str] = []

    def refresh(self, lease_id: int) -> int:
        ttl = super().refresh(lease_id)
        if self.armed:
            self.armed = False
            self.holding.set()
            self.release.wait(30)  # bounded: a broken test does not hang
        return ttl

    def revoke(self, lease_id: int) -> bool:
        self.revoked.append(lease_id)
        self.release.set()
        return super().revoke(lease_id)

    def txn(self, *args, **kw):
        try:
            return super().txn(*args, **kw)
        except EtcdError as e:
            self.refused.append(str(e))
            self.release.set()
            raise


def test_a_candidate_whose_lease_died_during_its_warm_up_campaigns_again_with_a_new_one(etcd, prefix):
    client = HeldFirstAnswerClient(etcd.endpoint)
    # the warm-up (2.5 s) ends after the local deadline (grant + 2 s) of a keeper stuck in its first answer
    a = LeaderElection(client, "master", "a", "127.0.0.1:5101", ttl_s=TTL_S, prefix=prefix, warmup_s=TTL_S + 0.5)
    try:
        a.start()
        first = wait_until(a.leader, 5, "a wins the key")
        assert first.candidate_id == "a"
        assert client.holding.wait(5), "the keeper sent its first keep-alive"
        assert client.release.wait(15), "a gave its stale lease up (or was refused with it)"
        assert client.refused == [], f"campaigned with a lease etcd no longer knows: {client.refused}"
        wait_until(lambda: a.is_leader, 4 * TTL_S, "a leads with a new lease")
        assert a.epoch > first.epoch and a.leader().candidate_id == "a"
        assert len(client.revoked) >= 1
    finally:
        client.release.set()
        a.resign()
        client.close()
    assert a.leader() is None


class RecordingGrantsClient(HeldFirstAnswerClient):
    """``HeldFirstAnswerClient`` armed by the test, that also records the leases it was granted."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.armed = False
        self.granted: list[int] = []

    def grant(self, ttl_s: int) -> tuple[int, int]:
        lease = super().grant(ttl_s)
        self.granted.append(lease[0])
        return lease


def test_a_standby_whose_lease_etcd_dropped_campaigns_again_with_a_new_one(etcd, etcd_client, prefix):
    client = RecordingGrantsClient(etcd.endpoint)
    b = LeaderElection(etcd.endpoint, "master", "b", "127.0.0.1:5202", ttl_s=TTL_S, prefix=prefix)
    a = LeaderElection(client, "master", "a", "127.0.0.1:5201", ttl_s=TTL_S, prefix=prefix)
    try:
        b.start()
        wait_until(lambda: b.is_leader, 4 * TTL_S, "b leads")
        a.start()
        wait_until(lambda: client.granted, 5, "the standby a holds a lease")
        client.armed = True  # a's next keep-alive answer is held: its keeper cannot see the revoke below
        assert client.holding.wait(5), "a's keeper sent a keep-alive"
        assert etcd_client.revoke(client.granted[0])  # an operator (or a lost etcd state) drops a's lease
        b.resign()  # a campaigns with the lease its keeper still thinks alive: "lease not found"
        wait_until(lambda: a.is_leader, 4 * TTL_S, "a leads with a new lease")
        assert len(client.granted) == 2 and a.leader().candidate_id == "a"
    finally:
        client.release.set()
        b.resign()
        a.resign()
        client.close()


# -- 2: a watch that etcd cancels for a compaction is re-opened ------------------------------------------------
def _compacted_history(client: EtcdClient, prefix: str) -> tuple[int, int]:
    """Three puts under ``prefix``, then a compaction past the first: (first revision, compacted revision)."""
    first = client.put(f"{prefix}/w/a", b"1")
    client.put(f"{prefix}/w/a", b"2")
    last = client.put(f"{prefix}/w/a", b"3")
    client.compact(last)
    return first, last


def test_a_watch_behind_a_compaction_goes_on_from_the_present(etcd_client, prefix):
    first, compacted_at = _compacted_history(etcd_client, prefix)
    seen, compacted = [], []
    with Watch(etcd_client, f"{prefix}/w/", lambda ev: seen.append((ev.kind, ev.key, ev.kv.value)), prefix=True,
               start_revision=first, on_compacted=compacted.append, backoff=Backoff(initial_s=0.05, max_s=0.2)):
        wait_until(lambda: compacted, 5, "on_compacted")
        assert compacted == [compacted_at]
        wait_until(lambda: etcd_client.put(f"{prefix}/w/b", b"later") and seen, 5,
                   "an event after the compaction notice")  # each poll puts again: the re-opened stream sees one
        assert seen[0][:2] == ("put", f"{prefix}/w/b") and seen[0][2] == b"later"


def test_a_watch_goes_on_after_the_revision_on_compacted_read_its_state_at(etcd_client, prefix):
    """The change made between the caller's re-read (inside ``on_compacted``) and the re-opened stream is
    delivered: the watch resumes after the revision ``on_compacted`` returns, not from the present."""
    first, _ = _compacted_history(etcd_client, prefix)
    seen = []

    def resync(_compacted: int) -> int:
        _, read_at = etcd_client.get_prefix(f"{prefix}/w/")
        etcd_client.put(f"{prefix}/w/between", b"x")  # after the read, before the stream is re-opened
        return read_at

    with Watch(etcd_client, f"{prefix}/w/", lambda ev: seen.append(ev.key), prefix=True, start_revision=first,
               on_compacted=resync, backoff=Backoff(initial_s=0.05, max_s=0.2)):
        wait_until(lambda: seen, 5, "the change made after the re-read")
        etcd_client.put(f"{prefix}/w/after", b"y")
        wait_until(lambda: len(seen) == 2, 5, f"the next change; saw {seen}")
    assert seen == [f"{prefix}/w/between", f"{prefix}/w/after"]


# -- 3: a cached entry is pinned in the critical section that finds (or caches) it -----------------------------
class WindowLock:
    """The cache's lock, with a hook: when thread ``who`` lets go of it while ``key``'s entry is cached but NOT
    pinned (the window in which another thread may evict it and reuse its range), ``who`` stops there until
    ``resume``; ``paused`` says it did. ``turn`` is set when ``who`` paused or finished: the other thread's cue."""

    def __init__(self, cache: LocalCache, key: str) -> None:
        self._lock = threading.Lock()
        self.cache, self.key, self.who = cache, key, None
        self.paused, self.resume, self.turn = threading.Event(), threading.Event(), threading.Event()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc) -> None:
        entry = self.cache._lru.get(self.key)
        window = threading.current_thread() is self.who and entry is not None and not entry.pinned()
        self._lock.release()
        if window and not self.paused.is_set():
            self.paused.set()
            self.turn.set()
            self.resume.wait(10)  # bounded: a broken test does not hang


def _race(cache: LocalCache, key: str, call) -> tuple[memoryview | None, bool]:
    """Run ``call()`` (which returns a view of ``key``'s cached entry) in a thread; in its window, if it has
    one, another thread allocates every range it can get (evicting what is unpinned) and fills it with 0xBB.
    The view ``call`` returned, and whether the window existed."""
    hook = cache._lock = WindowLock(cache, key)
    got: dict = {}

    def racer() -> None:
        try:
            got["view"] = call()
        finally:
            hook.turn.set()

    t = threading.Thread(target=racer, name="cache racer")
    hook.who = t
    t.start()
    grabbed = []
    try:
        assert hook.turn.wait(10)
        while (a := cache.allocate(4096)) is not None:  # the other thread: a get/put/prefetch needing room
            cache.writable(a)[:] = b"\xbb" * a.size
            grabbed.append(a)
    finally:
        hook.resume.set()
        t.join(10)
        for a in grabbed:
            cache.release(a)
    return got.get("view"), hook.paused.is_set()


def test_a_cache_hit_is_pinned_before_another_thread_can_evict_it():
    cache = LocalCache(64 * 1024, 32 * 1024)
    a = cache.allocate(8192)
    cache.writable(a)[:8192] = b"A" * 8192
    assert cache.insert("key-A", a, 8192)
    view, window = _race(cache, "key-A", lambda: cache.lookup("key-A"))
    assert view is not None and bytes(view[:8]) == b"A" * 8 and bytes(view) == b"A" * 8192
    assert not window  # no moment at which the found entry was evictable


def test_a_get_caches_and_pins_what_it_read_before_another_thread_can_evict_it():
    with EmbeddedPool(2, 8 << 20) as pool:
        writer = pool.store(local_cache_bytes=0, staging_bytes=1 << 20)
        reader = pool.store(local_cache_bytes=256 * 1024, staging_bytes=256 * 1024)
        try:
            data = bytes(range(256)) * 256  # 64 KiB
            writer.put("obj", data)
            view, window = _race(reader.cache, "obj", lambda: reader.get("obj"))
            assert view is not None and bytes(view[:8]) == data[:8] and bytes(view) == data
            assert not window  # no moment at which the entry read was cached but evictable
            assert bytes(reader.get("obj")) == data and reader.stats().local_hits == 1
        finally:
            writer.close()
            reader.close()


# -- 4: flush() reports a persist that did not become durable ---------------------------------------------------
def test_flush_reports_an_ssd_commit_that_failed_and_persisted_counts_durable_blocks_only(tmp_path, monkeypatch):
    store = embedded_store(nodes=1, dram_bytes=8 << 20, backend="tcp", ssd_dirs=[tmp_path / "ssd"], replicas=1,
                           local_cache_bytes=0, persist=True)
    try:
        node = store.pool.nodes[0]
        store.put("ok", b"o" * 10_000)
        (info,) = store.flush_persist().values()
        assert "error" not in info and info["persisted"] == 1 and info["ssd_blocks"] == 1

        def eio(*_a, **_kw):
            raise OSError(errno.EIO, "Input/output error (injected fsync failure)")

        monkeypatch.setattr(node.ssd._layout, "commit", eio)  # the disk fails the next group commit
        for i in range(5):
            store.put(f"k{i}", bytes([i]) * 10_000)
        (info,) = store.flush_persist().values()
        assert "PersistFailedError" in info["error"] and "5 persist(s)" in info["error"], info
        assert "group commit" in info["error"] and node.node_id in info["error"]
        c = node.counters
        assert (c.persisted, c.persist_failed, len(node.ssd)) == (1, 5, 1)  # only "ok" is durable

        store.put("later", b"l" * 10_000)  # the tier refuses writes now: the next flush says so too
        (info,) = store.flush_persist().values()
        assert "1 persist(s)" in info["error"] and "unhealthy" in info["error"], info
        (info,) = store.flush_persist().values()
        assert "error" not in info  # nothing new since: each loss is reported once
        for key, want in [("ok", b"o" * 10_000), ("k3", bytes([3]) * 10_000), ("later", b"l" * 10_000)]:
            assert bytes(store.get(key)) == want  # the node keeps serving its DRAM
    finally:
        store.close()


# -- 5: a master reply of the wrong length is a clear error --------------------------------------------------------
class ShortReplies:
    """The master, answering one entry short on the methods named (a codec or proxy bug, a bad master)."""

    def __init__(self, inner, *short: str) -> None:
        self._inner, self._short = inner, short

    def __getattr__(self, name: str):
        fn = getattr(self._inner, name)
        return (lambda *a, **kw: fn(*a, **kw)[:-1]) if name in self._short else fn


@pytest.mark.parametrize("method, call", [
    ("batch_put_start", lambda s: s.put_many([("a", b"1" * 100), ("b", b"2" * 100)])),
    ("batch_put_end", lambda s: s.put("c", b"3" * 100)),
    ("get_replicas", lambda s: s.get_many(["stored"])),
    ("exists", lambda s: s.contains(["stored", "stored2"])),
])
def test_a_master_reply_one_answer_short_is_a_clear_error(method, call):
    store = embedded_store(nodes=2, dram_bytes=8 << 20, backend="local", replicas=1, local_cache_bytes=0)
    real = store.master
    try:
        store.put("stored", b"s" * 1000)
        store.put("stored2", b"t" * 1000)
        store.master = ShortReplies(real, method)
        with pytest.raises(PoolError, match=rf"answered {method} of \d+ keys with \d+ answers"):
            call(store)
        store.master = real
        assert bytes(store.get("stored")) == b"s" * 1000  # nothing stored was damaged
        assert store.contains(["a", "b"]) == [False, False]  # a put_start answered short wrote nothing
        if method == "batch_put_end":  # the master had ended it before the short reply: complete, verified
            assert bytes(store.get("c")) == b"3" * 100
    finally:
        store.master = real
        store.close()


# -- 6: etcd's two automatic ports ---------------------------------------------------------------------------------
def test_etcd_started_on_ports_that_collide_starts_again_on_other_ones(monkeypatch):
    """The kernel may hand out one port twice (a socket closed before the next is made): the first pick
    here is that collision, made certain. etcd cannot bind it; ``start()`` picks again and the server runs."""
    require_etcd()
    real_ports, real_port = getattr(etcd_module, "free_ports", None), etcd_module.free_port
    same = real_port()
    picks: list = []

    def colliding_ports(n, host="127.0.0.1"):
        picks.append(n)
        return [same] * n if len(picks) == 1 else real_ports(n, host)

    def colliding_port(host="127.0.0.1"):  # the single-port picker, should start() use it
        picks.append(1)
        return same if len(picks) <= 2 else real_port(host)

    monkeypatch.setattr(etcd_module, "free_ports", colliding_ports, raising=False)
    monkeypatch.setattr(etcd_module, "free_port", colliding_port)
    with EtcdProcess(start_timeout_s=20) as proc:
        assert proc.running() and proc.client_port != proc.peer_port
        client = EtcdClient(proc.endpoint)
        assert client.put("/k", b"v") > 0
        client.close()
    assert len(picks) >= 2  # the collision was really tried first


def test_etcd_ports_are_distinct_and_the_same_port_twice_is_refused():
    ports = etcd_module.free_ports(16)
    assert len(set(ports)) == 16
    with pytest.raises(ValueError, match="client_port and peer_port are both 2379"):
        EtcdProcess(client_port=2379, peer_port=2379)


# -- 7: a node's registry descriptor names the region it serves after a remount -----------------------------------
def test_a_remounted_node_publishes_its_new_region_in_etcd(etcd, prefix):
    offset = [0.0]
    clock = lambda: time.monotonic() + offset[0]  # noqa: E731  the master's clock: expiry without waiting
    with EmbeddedPool(1, 4 << 20, config=MasterConfig(client_ttl_s=5.0), clock=clock, heartbeat_s=0.05,
                      tick_s=0.05) as pool:
        node = PoolNode(pool.master, dram_bytes=4 << 20, etcd=etcd.endpoint, node_id=f"reg{prefix[-12:]}",
                        secret=pool.secret, heartbeat_s=0.05)
        reg = EtcdRegistry(etcd.endpoint)
        try:
            def published():
                return next(s.regions for s in reg.nodes() if s.node_id == node.node_id)

            first = node.region.region_id
            assert [r.region_id for r in published()] == [first]
            node.suspend_heartbeats()
            offset[0] += 60.0  # far past the client TTL: the master's ticker expires the silent node
            wait_until(lambda: node.node_id not in pool.master.clients(), 10, "the master expired the node")
            node.resume_heartbeats()
            wait_until(lambda: node.counters.remounts >= 1, 10, "the node remounted")
            assert node.region.region_id != first
            wait_until(lambda: [r.region_id for r in published()] == [node.region.region_id], 5,
                       f"etcd names the region served now; says {published()}")
        finally:
            reg.close()
            node.close()
