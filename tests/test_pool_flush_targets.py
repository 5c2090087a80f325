"""``PooledStore.flush_persist`` asks only the nodes holding persists no flush confirmed yet, all at once (pool review
of 2026-11-29, /tmp/s37/pool F4).

Before: the store asked every control address it ever persisted to, one after the other, each with the time left
on the deadline. A node that died or restarted on new ports was asked at its old address by every later flush:
each flush waited its whole timeout, reported that address forever, and left the nodes asked after it 0.1 s.
Now a confirmed address is not asked again until it is sent new persists, a silent node costs a flush at most its
timeout without shortening the others' wait, and an address whose node the master no longer holds there is reported
once (its persists were never confirmed durable) and then forgotten, its persist client closed.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from polling import wait_until
from quillcache.pool.embedded import EmbeddedPool

MiB = 1 << 20


@pytest.fixture
def pool(tmp_path):
    ssd = [str(tmp_path / f"ssd{i}") for i in range(2)]
    with contextlib.closing(EmbeddedPool(2, 8 * MiB, ssd_dirs=ssd, backend="local")) as p:
        yield p


def _ctls(pool) -> list[str]:
    return sorted(n.control_address for n in pool.nodes)


def test_a_node_restarted_on_new_ports_is_not_asked_at_its_old_address(pool):
    s = pool.store(replicas=2, persist=True, local_cache_bytes=0)
    try:
        s.put("a", b"x" * 4096)
        first = s.flush_persist(timeout_s=10)
        assert sorted(first) == _ctls(pool) and not [i for i in first.values() if "error" in i], first
        old = pool.nodes[0].control_address
        pool.restart_node(0)  # same node id and SSD directory, new ports
        assert pool.nodes[0].control_address != old
        assert len(s.put("b", b"y" * 4096).nodes) == 2
        t0 = time.monotonic()
        out = s.flush_persist(timeout_s=10)
        took = time.monotonic() - t0
        assert sorted(out) == _ctls(pool), out  # before: the old address too, an error after the whole 10 s
        assert not [i for i in out.values() if "error" in i], out
        assert took < 5, f"flush_persist took {took:.2f} s"
        assert old not in s._persist_clients
        assert s.flush_persist(timeout_s=10) == {}  # everything confirmed: nobody is asked
    finally:
        s.close()


@pytest.mark.parametrize("silent_first", [True, False], ids=["silent-asked-first", "silent-asked-last"])
def test_a_silent_node_does_not_starve_the_others_and_stays_reported_until_confirmed(pool, silent_first):
    nodes = sorted(pool.nodes, key=lambda n: n.control_address)
    silent, live = (nodes[0], nodes[1]) if silent_first else (nodes[1], nodes[0])
    entered, release = threading.Event(), threading.Event()
    silent_flush, live_flush = silent.flush, live.flush

    def hangs():  # a stalled node: answers only once released
        entered.set()
        release.wait(30)
        return silent_flush()

    def slow():  # asked while the silent one is (not after it), and its group commit takes a while
        assert entered.wait(5), "the live node was asked before the silent one was"
        time.sleep(0.5)  # simulated work on the node, not a wait of the test
        return live_flush()

    silent.flush, live.flush = hangs, slow
    s = pool.store(replicas=2, persist=True, local_cache_bytes=0)
    try:
        s.put("a", b"x" * 4096)
        t0 = time.monotonic()
        out = s.flush_persist(timeout_s=3)
        took = time.monotonic() - t0
        release.set()
        assert sorted(out) == _ctls(pool), out
        assert "error" not in out[live.control_address], out  # before: 0.1 s left for it, or never asked in time
        err = out[silent.control_address]
        assert "1 persist(s) sent to it are not confirmed durable" in err["error"], err
        assert err["node_id"] == silent.node_id
        assert took < 5, f"flush_persist took {took:.2f} s"
        out = s.flush_persist(timeout_s=5)  # only the unconfirmed node is asked again, and now it answers
        assert list(out) == [silent.control_address] and "error" not in out[silent.control_address], out
        assert s.flush_persist(timeout_s=5) == {}
        assert s._persist_clients == {}
    finally:
        release.set()
        s.close()


def test_a_node_gone_from_the_master_is_reported_once_then_forgotten(pool):
    s = pool.store(replicas=2, persist=True, local_cache_bytes=0)
    try:
        s.put("a", b"x" * 4096)
        wait_until(lambda: s.stats().persist_sent == 2, 10, "both persists sent")
        victim, other = pool.nodes
        ctl = victim.control_address
        pool.close_node(0)  # unmounted before any flush confirmed its persist: the master holds no segment of it
        t0 = time.monotonic()
        out = s.flush_persist(timeout_s=10)
        took = time.monotonic() - t0
        assert sorted(out) == sorted([ctl, other.control_address]), out
        assert "error" not in out[other.control_address], out
        err = out[ctl]["error"]
        assert "1 persist(s) sent to it were never confirmed durable" in err and victim.node_id in err, err
        assert took < 5, f"flush_persist took {took:.2f} s"  # before: the whole 10 s, at every flush
        assert ctl not in s._persist_clients
        assert s.flush_persist(timeout_s=10) == {}
    finally:
        s.close()


def test_concurrent_flushes_never_drop_persists_sent_between_them(pool):
    """Re-review /tmp/s37/rr R3: two flushes that snapshotted the same persists each settled their snapshot; a
    node confirmed by the first and sent new persists before the second ended was then dropped from tracking by
    the second, and no later flush asked it. Flushes now run one at a time."""
    x, c = pool.nodes
    entered, release = threading.Event(), threading.Event()
    x_flush = x.flush

    def hangs():  # x stalls until released
        entered.set()
        release.wait(30)
        return x_flush()

    x.flush = hangs
    s = pool.store(replicas=2, persist=True, local_cache_bytes=0)
    try:
        s.put("a", b"x" * 4096)
        wait_until(lambda: s.stats().persist_sent == 2, 10, "batch a's persists sent")
        results = {}
        t1 = threading.Thread(target=lambda: results.setdefault("t1", s.flush_persist(timeout_s=1.0)))
        t1.start()
        assert entered.wait(10)
        t2 = threading.Thread(target=lambda: results.setdefault("t2", s.flush_persist(timeout_s=20)))
        t2.start()
        t1.join(10)
        assert "error" not in results["t1"][c.control_address], results
        s.put("b", b"y" * 4096)  # sent to both while the second flush still waits on x (x, stalled, drops it)
        wait_until(lambda: s.stats().persist_sent + s.stats().persist_errors == 4, 15, "batch b's persists handled")
        release.set()
        t2.join(30)
        out = s.flush_persist(timeout_s=10)
        assert c.control_address in out and "error" not in out[c.control_address], out  # before: c not asked
    finally:
        release.set()
        s.close()


def test_a_flush_answered_by_a_restarted_process_confirms_nothing(pool):
    """Re-review /tmp/s37/rr R2: a node killed before its group commit and restarted on the same ports answered the
    flush for its own empty queue, and the store reported every persist sent to the dead process durable."""
    s = pool.store(replicas=2, persist=True, local_cache_bytes=0)
    try:
        s.put("a", b"x" * 4096)
        wait_until(lambda: s.stats().persist_sent == 2, 10, "the persists sent")
        node, other = pool.nodes
        node.boot_id = "another-process"  # what a process restarted at this address answers with
        out = s.flush_persist(timeout_s=10)
        err = out[node.control_address]["error"]  # before: the node's info, i.e. "durable"
        assert "the node restarted since they were sent: 1 persist(s)" in err and "never confirmed durable" in err
        assert "error" not in out[other.control_address], out
        assert s.flush_persist(timeout_s=10) == {}  # reported once, then forgotten
        s.put("b", b"y" * 4096)  # the next persist there learns the new process
        wait_until(lambda: s.stats().persist_sent == 4, 10, "the second persists sent")
        out = s.flush_persist(timeout_s=10)
        assert sorted(out) == _ctls(pool) and not [i for i in out.values() if "error" in i], out
        assert out[node.control_address]["boot_id"] == "another-process"
    finally:
        s.close()


def test_persists_sent_while_a_flush_settles_keep_the_process_they_went_to(pool):
    """Round-2 re-review /tmp/s37/rr2 N1: a flush that ended while a persist to the same node was on its way
    forgot the node's boot id, and the persist was then tracked with none: after a restart on the same ports the
    next flush took the new process's answer as confirmation. Each unconfirmed entry now carries the boot id of
    the process its persists went to."""
    node = pool.nodes[0]
    s = pool.store(replicas=2, persist=True, local_cache_bytes=0)
    entered, release = threading.Event(), threading.Event()
    node_flush = node.flush

    def slow_flush():  # the node takes a while to answer this flush
        entered.set()
        release.wait(30)
        return node_flush()

    try:
        s.put("a", b"x" * 4096)
        wait_until(lambda: s.stats().persist_sent == 2, 10, "batch a's persists sent")
        node.flush = slow_flush
        results = {}
        t = threading.Thread(target=lambda: results.setdefault("out", s.flush_persist(timeout_s=20)))
        t.start()
        assert entered.wait(10)
        s.put("b", b"y" * 4096)  # its persists go out while the flush waits for the node's answer
        release.set()
        t.join(30)
        node.flush = node_flush
        wait_until(lambda: s.stats().persist_sent == 4, 10, "batch b's persists sent")
        assert s._persist_unconfirmed[node.control_address][3] is not None  # the process b went to is known
        node.boot_id = "another-process"  # the node restarted on the same ports before b was made durable
        out = s.flush_persist(timeout_s=10)
        assert "never confirmed durable" in out[node.control_address]["error"], out
    finally:
        release.set()
        s.close()
