"""Regression tests for finding M1 of the servers review (the pool node's control port and its ``persist``):

- an item whose trailer names no object costs a trailer read, never a copy of its range (in the call, and in the
  worker when the range changed after the call);
- one call carries at most ``MAX_PERSIST_ITEMS`` items, and the control server refuses a frame past
  ``CONTROL_MAX_FRAME_BYTES`` (which fits the largest legitimate call);
- the persist queue is bounded: a call over it is refused whole with ``PersistRefusedError``, the pooled store's
  ``flush_persist`` reports those blocks, and the node's next ``flush`` says they are not durable;
- skipped and refused items are logged, rate-limited, with a summary line per window;
- an SSD directory another tier holds is refused before the node maps its DRAM or binds a port, and
  ``quillcache node`` on it prints one line naming the directory and exits non-zero.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polling import wait_until as _poll

from quillcache.pool import node as nodemod
from quillcache.pool import writebehind as wbmod
from quillcache.pool.embedded import EmbeddedPool
from quillcache.pool.errors import PersistFailedError
from quillcache.pool.frame import TRAILER_BYTES
from quillcache.rpc import RpcClient, RpcRejectedError
from quillcache.rpc.errors import RpcErrorCode

MiB = 1 << 20
DRAM = 16 * MiB


@pytest.fixture
def pool(tmp_path):
    p = EmbeddedPool(1, DRAM, ssd_dirs=[str(tmp_path / "ssd0")], backend="local")
    try:
        yield p
    finally:
        p.close()


def _put(pool, key: str, data: bytes) -> tuple[int, int]:
    """Put ``key`` (no persist) and return its replica's (offset, framed size) in the node's buffer."""
    s = pool.store(replicas=1, local_cache_bytes=0)
    try:
        s.put(key, data)
    finally:
        s.close()
    (rep,) = pool.master.get_replica_list(key)
    return rep.offset_bytes, rep.size_bytes


class _StalledWorker:
    """Holds the node's persist worker inside a flush until ``release()``: what is queued meanwhile waits."""

    def __init__(self, node) -> None:
        self.node, self.gate, self.entered = node, threading.Event(), threading.Event()
        real = node.ssd.flush

        def flush(*a, **kw):
            self.entered.set()
            self.gate.wait(30)
            node.ssd.flush = real
            return real(*a, **kw)

        node.ssd.flush = flush
        self.flusher = threading.Thread(target=self._flush, daemon=True)
        self.flusher.start()
        assert self.entered.wait(10), "the persist worker never reached the stalled flush"

    def _flush(self) -> None:
        try:
            self.node.flush()
        except PersistFailedError:
            pass

    def release(self) -> None:
        self.gate.set()
        self.flusher.join(10)


# ---------------------------------------------------------------- the trailer is read before the range is copied
def test_bogus_whole_segment_items_are_skipped_in_the_call_and_do_not_stall_flush(pool):
    node = pool.nodes[0]
    cap = node.capacity_bytes
    items = [["bogus", 0, cap]] * 4000  # what the reproducer sent: whole-segment ranges of a key that is not there
    with RpcClient(node.control_address, timeout_s=10) as c:
        assert c.call("persist", items) == 0  # none queued: no trailer at the end of the segment
        t0 = time.monotonic()
        info = c.call("flush")
        assert time.monotonic() - t0 < 5.0
    assert info["persist_skipped"] == 4000 and info["persisted"] == 0


def test_the_worker_reads_the_trailer_before_copying_a_range_that_changed_after_the_call(pool, monkeypatch):
    node = pool.nodes[0]
    off, size = _put(pool, "real", b"x" * 100_000)
    copies = []
    real_header = wbmod.record_header
    monkeypatch.setattr(wbmod, "record_header", lambda key: (copies.append(key), real_header(key))[1])
    stall = _StalledWorker(node)
    try:
        assert node.persist([("real", off, size)]) == 1  # its trailer reads right now: queued
        node.view()[off + size - TRAILER_BYTES:off + size] = bytes(TRAILER_BYTES)  # the range is reused meanwhile
    finally:
        stall.release()
    node.flush()
    assert copies == [], "the worker copied a range whose trailer names no object"
    assert node.counters.persist_skipped == 1 and node.counters.persisted == 0


def test_a_real_object_is_still_persisted(pool):
    node = pool.nodes[0]
    off, size = _put(pool, "real", b"y" * 5000)
    assert node.persist([("real", off, size)]) == 1
    assert node.flush()["persisted"] == 1


# ---------------------------------------------------------------- per-call cap and the control frame bound
def test_a_call_over_the_item_cap_is_refused_whole(pool):
    node = pool.nodes[0]
    off, size = _put(pool, "real", b"z" * 1000)
    with RpcClient(node.control_address, timeout_s=10) as c:
        with pytest.raises(nodemod.PersistRefusedError) as ei:  # typed on the client side
            c.call("persist", [["real", off, size]] * (nodemod.MAX_PERSIST_ITEMS + 1))
        assert f"at most {nodemod.MAX_PERSIST_ITEMS} items per call" in str(ei.value)
        assert c.call("info")["persist_refused"] == nodemod.MAX_PERSIST_ITEMS + 1
        assert c.call("persist", [["real", off, size]] * nodemod.MAX_PERSIST_ITEMS) == nodemod.MAX_PERSIST_ITEMS


def test_the_control_server_frame_bound_fits_the_largest_call_and_refuses_more(pool):
    node = pool.nodes[0]
    bound = node.server.max_frame_bytes
    assert bound == nodemod.CONTROL_MAX_FRAME_BYTES and bound < 64 * MiB
    big = ["k" * nodemod.MAX_KEY_CHARS, (1 << 64) - 1, (1 << 64) - 1]
    largest = msgpack.packb([1, (1 << 64) - 1, "persist", [[big] * nodemod.MAX_PERSIST_ITEMS], {}])
    assert len(largest) <= bound
    with RpcClient(node.control_address, timeout_s=30) as c:
        with pytest.raises(RpcRejectedError) as ei:
            c.call("persist", [["k" * 4096, 0, 100]] * (2 * nodemod.MAX_PERSIST_ITEMS))
        assert ei.value.code is RpcErrorCode.FRAME_TOO_LARGE
        assert c.call("info")["node_id"] == node.node_id  # still serving


# ---------------------------------------------------------------- the bounded queue
def test_a_full_queue_refuses_the_call_and_the_next_flush_reports_it(pool):
    node = pool.nodes[0]
    objs = [_put(pool, f"k{i}", bytes([i]) * 20_000) for i in range(3)]
    wb = node.write_behind
    gate, entered, real = threading.Event(), threading.Event(), wb._persist_one

    def slow(*a):  # the worker holds its first batch (still counted in the queue) until the gate opens
        entered.set()
        gate.wait(30)
        return real(*a)

    wb._persist_one = slow
    try:
        wb.queue_bytes = objs[0][1] + objs[1][1]  # room for two of them
        assert node.persist([("k0", *objs[0])]) == 1
        assert entered.wait(10)
        assert node.persist([("k1", *objs[1])]) == 1
        with pytest.raises(nodemod.PersistRefusedError, match="persist queue holds 2 items"):
            node.persist([("k2", *objs[2]), ("not-an-object", 0, node.capacity_bytes)])
        assert node.counters.persist_refused == 1  # the item whose trailer reads as an object's
    finally:
        gate.set()
    with pytest.raises(PersistFailedError, match="1 persist.s. since the last flush not durable: persist of 1 items"):
        node.flush()
    info = node.flush()  # reported once
    assert info["persisted"] == 2
    assert node.persist([("k2", *objs[2])]) == 1  # room again once the worker drained the queue
    assert node.flush()["persisted"] == 3


def test_the_pooled_store_reports_a_refused_persist_as_not_durable(pool):
    node = pool.nodes[0]
    node.write_behind.queue_items = 0  # every call is over the queue's bound
    s = pool.store(replicas=1, persist=True, local_cache_bytes=0)
    try:
        s.put("k", b"data" * 100)
        (info,) = s.flush_persist().values()
        assert "1 persist(s) could not be sent to the node" in info["error"]
        assert "PersistRefusedError" in info["error"]
    finally:
        s.close()
    with pytest.raises(PersistFailedError, match="not durable"):
        node.flush()


# ---------------------------------------------------------------- rate-limited log lines
def test_skipped_persists_are_logged_rate_limited_with_a_summary(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(wbmod, "SKIP_LOG_WINDOW_S", 0.3)
    caplog.set_level(logging.WARNING, logger="quillcache.pool.node")
    with EmbeddedPool(1, DRAM, ssd_dirs=[str(tmp_path / "ssd0")], backend="local") as p:
        node = p.nodes[0]
        for _ in range(50):
            assert node.persist([("bogus", 0, node.capacity_bytes)] * 10) == 0

        def lines():
            return [r.getMessage() for r in caplog.records if r.name == "quillcache.pool.node"]

        _poll(lambda: any("skipped or refused in the last" in m for m in lines()), 10, "the summary line")
        one_by_one = [m for m in lines() if "items skipped (malformed" in m and "in the last" not in m]
        assert len(one_by_one) == wbmod.SKIP_LOG_BURST
        assert "'bogus'" in one_by_one[0]
        (summary,) = [m for m in lines() if "skipped or refused in the last" in m]
        assert "500 skipped in the call" in summary and "45 event(s) not logged one by one" in summary


# ---------------------------------------------------------------- an SSD directory in use
def test_an_ssd_dir_in_use_is_refused_before_dram_or_ports(tmp_path, monkeypatch):
    from quillcache.durability.dirlock import DataDirInUseError
    from quillcache.store.ssd import SsdTier

    def refuse(what):
        def started(*a, **kw):
            raise AssertionError(f"the {what} was started before the SSD directory was checked")
        return started

    monkeypatch.setattr(nodemod, "RpcServer", refuse("control server"))
    monkeypatch.setattr(nodemod.mmap, "mmap", refuse("DRAM mapping"))
    d = tmp_path / "ssd"
    holder = SsdTier(str(d), capacity_bytes=4 * MiB, slab_bytes=1 * MiB)
    try:
        with pytest.raises(DataDirInUseError, match=str(d)):
            nodemod.PoolNode("tcp://127.0.0.1:9", dram_bytes=1 * MiB, ssd_dir=d, backend="local",
                             mount_timeout_s=0.1)
    finally:
        holder.close()


def test_quillcache_node_on_an_ssd_dir_in_use_prints_one_line_naming_it(tmp_path):
    from quillcache.store.ssd import SsdTier
    from quillcache.transfer import SECRET_ENV

    d = tmp_path / "ssd"
    holder = SsdTier(str(d), capacity_bytes=4 * MiB, slab_bytes=1 * MiB)
    try:
        env = dict(os.environ, **{SECRET_ENV: "s" * 32})
        r = subprocess.run([sys.executable, "-m", "quillcache", "node", "--master", "tcp://127.0.0.1:9", "--dram",
                            "1MiB", "--ssd", str(d)], env=env, capture_output=True, text=True, timeout=120)
    finally:
        holder.close()
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and str(d) in err[0] and "in use" in err[0], r.stderr


def test_the_pooled_store_sends_a_large_batch_in_calls_the_node_accepts(pool, monkeypatch):
    # with a cap of 4 items per call, a put_many of 10 keys to one node must arrive as three calls, all
    # accepted (before the store chunked, one call of 10 was refused whole and reported as not durable)
    from quillcache.pool import persist_client as pcmod

    monkeypatch.setattr(wbmod, "MAX_PERSIST_ITEMS", 4)
    monkeypatch.setattr(pcmod, "MAX_PERSIST_ITEMS", 4)
    node = pool.nodes[0]
    s = pool.store(replicas=1, persist=True, local_cache_bytes=0)
    try:
        s.put_many([(f"k{i}", bytes([i]) * 300) for i in range(10)])
        (info,) = s.flush_persist().values()
        assert "error" not in info, info
    finally:
        s.close()
    node.flush()  # nothing lost on the node either
    assert node.info()["persist_refused"] == 0


# ---------------------------------------------------------------- the store's calls fit the node's bounds
@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.text(min_size=1, max_size=30), st.integers(0, 10**9), st.integers(0, 10**9)),
                max_size=60), st.integers(1, 8), st.integers(4, 64))
def test_persist_chunks_keep_every_item_in_order_within_both_bounds(items, max_items, max_key_chars):
    from quillcache.pool import persist_client as pcmod

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pcmod, "MAX_PERSIST_ITEMS", max_items)
        mp.setattr(pcmod, "MAX_KEY_CHARS", max_key_chars)
        chunks = pcmod.persist_chunks(items)
    assert [it for c in chunks for it in c] == items
    for c in chunks:
        assert 1 <= len(c) <= max_items
        assert len(c) == 1 or sum(len(k.encode()) for k, _, _ in c) <= max_items * max_key_chars


def test_the_largest_non_ascii_batch_is_sent_in_calls_that_fit_the_control_frame():
    # the re-review's L1: 4,096 keys of 2,200 'é' (4,400 UTF-8 bytes each) made one 18.1 MB call against a
    # 16.9 MB frame limit, so the node refused the whole batch
    from quillcache.pool.store import persist_chunks
    from quillcache.rpc.codec import DEFAULT_CODEC
    from quillcache.rpc.wire import encode_request

    items = [("é" * 2200 + str(i), (1 << 64) - 1, (1 << 64) - 1) for i in range(nodemod.MAX_PERSIST_ITEMS)]
    chunks = persist_chunks(items)
    assert len(chunks) == 2 and [it for c in chunks for it in c] == items
    proof = [2**62, b"\0" * 32]
    for c in chunks:
        assert len(encode_request(DEFAULT_CODEC, 2**63, "persist", [c], {"auth": proof})) <= \
            nodemod.CONTROL_MAX_FRAME_BYTES


def test_a_failed_call_after_accepted_ones_reports_only_the_rest_as_lost(pool, monkeypatch):
    # the re-review's L2: every item of the node's batch was counted lost, also those its earlier calls delivered
    import quillcache.rpc as rpcmod
    from quillcache.pool import persist_client as pcmod

    calls = []

    class Flaky:
        def __init__(self, *a, **kw) -> None:
            pass

        def call(self, method, *args, **kwargs):
            if method == "info":  # which process the persists go to (asked once before them)
                return {"boot_id": "b"}
            calls.append((method, len(args[0]) if args else 0))
            if method == "persist" and len(calls) == 2:
                raise ConnectionError("the node went away")
            return {"persisted": 0} if method == "flush" else len(args[0])

        def close(self) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

    monkeypatch.setattr(rpcmod, "RpcClient", Flaky)
    monkeypatch.setattr(pcmod, "MAX_PERSIST_ITEMS", 4)
    s = pool.store(replicas=1, persist=True, local_cache_bytes=0)
    try:
        s._queue_persist({"tcp://127.0.0.1:9": [(f"k{i}", 0, 100) for i in range(10)]})
        (info,) = s.flush_persist().values()
        assert calls[:2] == [("persist", 4), ("persist", 4)]
        assert info["error"].startswith("6 persist(s) could not be sent"), info
    finally:
        s.close()
