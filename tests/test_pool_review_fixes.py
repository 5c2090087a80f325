"""Regression tests for the pool review (rev-pool findings 3, 5, 7, 8, 11)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from quillcache.pool.embedded import EmbeddedPool
from quillcache.pool.frame import check, frame
from quillcache.pool.node import PoolNode
from quillcache.pool.writebehind import _FlushRequest
from quillcache.transfer import Op, TransferEngine, TransferError, TransferRequest
from quillcache.transfer.regions import RegionTable
from quillcache.transfer.types import RegionError

MiB = 1 << 20


# ---------------------------------------------------------------- 3: own re-put vs own local cache
def test_own_put_of_new_content_replaces_the_cached_copy():
    with EmbeddedPool(2, 4 * MiB, backend="local") as pool:
        a = pool.store(local_cache_bytes=1 * MiB, staging_bytes=1 * MiB)
        b = pool.store(local_cache_bytes=0, staging_bytes=1 * MiB)
        try:
            a.put("k", b"old-content-v1")
            assert bytes(a.get("k")) == b"old-content-v1"  # now in a's cache
            assert b.remove("k")  # another client removes it: a's cache is (by design) not told
            out = a.put_many([("k", b"NEW-CONTENT-v2"), ("j", b"other")])
            assert not out[0].existing
            assert bytes(b.get("k")) == b"NEW-CONTENT-v2"
            assert bytes(a.get("k")) == b"NEW-CONTENT-v2"  # its own write, not the stale cached bytes
        finally:
            a.close()
            b.close()


# ---------------------------------------------------------------- 5: flush() racing close()
def test_flush_racing_close_returns_instead_of_waiting_for_ever(tmp_path):
    with EmbeddedPool(1, 4 * MiB, ssd_dirs=[str(tmp_path)], backend="local") as pool:
        n = pool.nodes[0]
        real_put = n.write_behind._q.put
        closer: list[threading.Thread] = []

        def put(item, *args, **kwargs):
            if isinstance(item, _FlushRequest) and not closer:
                # flush() has passed its closed check: let close() run now, before the request is queued
                t = threading.Thread(target=n.close, daemon=True)
                closer.append(t)
                t.start()
                t.join(0.5)
            real_put(item, *args, **kwargs)

        n.write_behind._q.put = put
        done = threading.Event()
        threading.Thread(target=lambda: (n.flush(), done.set()), daemon=True).start()
        returned = done.wait(10)
        closer[0].join(15)
        assert returned, "flush() racing close() never returned"
        assert not closer[0].is_alive()
        n.flush()  # after close: returns at once


# ---------------------------------------------------------------- 7: frame.check on any contiguous view
def test_check_accepts_char_and_multidim_views_and_names_the_key_for_strided_ones():
    f = frame("key", b"payload")
    assert bytes(check(memoryview(f).cast("c"), "key")) == b"payload"
    assert bytes(check(memoryview(f).cast("b"), "key")) == b"payload"
    assert bytes(check(np.frombuffer(f, dtype=np.uint8).reshape(1, -1), "key")) == b"payload"
    strided = np.frombuffer(f + f, dtype=np.uint8)[::2]
    with pytest.raises(TypeError, match="'key'.*C-contiguous"):
        check(strided, "key")


# ---------------------------------------------------------------- 8: keys that are not UTF-8
def test_a_key_with_a_lone_surrogate_is_refused_by_name():
    with EmbeddedPool(1, 4 * MiB, backend="local") as pool:
        s = pool.store(local_cache_bytes=0, staging_bytes=1 * MiB)
        try:
            for call in (lambda: s.put("a\ud800", b"x"), lambda: s.get("a\ud800"),
                         lambda: s.get_many(["ok", "a\ud800"]), lambda: s.contains(["a\ud800"]),
                         lambda: s.remove("a\ud800")):
                with pytest.raises(ValueError, match="UTF-8"):
                    call()
            assert s.put("caf\u00e9-\u2603", b"x").replicas_written == 1  # non-ASCII UTF-8 is fine
            assert bytes(s.get("caf\u00e9-\u2603")) == b"x"
        finally:
            s.close()
    with pytest.raises(ValueError, match="UTF-8"):
        check(frame("k", b"x"), "\udfff")


# ---------------------------------------------------------------- 11: a node restarted at the same address
def test_a_replica_of_a_previous_node_process_at_the_same_address_reaches_no_memory():
    with EmbeddedPool(1, 4 * MiB, backend="tcp") as pool:
        s = pool.store(local_cache_bytes=0, staging_bytes=1 * MiB)
        old = new = None
        try:
            old = PoolNode(pool.master, dram_bytes=1 * MiB, node_id="restarted", secret=pool.secret)
            port = int(old.transfer_address.rsplit(":", 1)[1])
            s.put("k", b"A" * 1000, replicas=2)
            rep = next(r for r in pool.master.get_replicas(["k"])[0] if r.node_id == "restarted")
            old.close()  # "killed"; the same node id comes back on the same port
            new = PoolNode(pool.master, dram_bytes=1 * MiB, node_id="restarted", secret=pool.secret, port=port)
            assert new.transfer_address == old.transfer_address
            before = bytes(new.view()[rep.offset_bytes:rep.offset_bytes + rep.size_bytes])
            # a client that had the segment open before the restart: its WRITE is refused by the new process
            seg = s._segment(rep)
            (ok, why), = s._transfer([TransferRequest(Op.WRITE, s.region.region_id, 0, seg, rep.region_id,
                                                      rep.offset_bytes, rep.size_bytes)])[0]
            assert not ok, "a WRITE meant for the previous process landed in the new one"
            s2 = pool.store(local_cache_bytes=0, staging_bytes=1 * MiB)
            try:  # a client that opens the segment now refuses the replica before moving a byte
                with pytest.raises(TransferError, match="stale replica"):
                    s2._segment(rep)
            finally:
                s2.close()
            src = bytearray(b"Z" * rep.size_bytes)
            with TransferEngine("tcp", secret=pool.secret, serve=False) as eng:
                reg = eng.register_region(src)
                seg = eng.open_segment(new.transfer_address)
                with pytest.raises(TransferError):
                    eng.write(reg, 0, seg, rep.region_id, rep.offset_bytes, rep.size_bytes, timeout_s=5)
            assert bytes(new.view()[rep.offset_bytes:rep.offset_bytes + rep.size_bytes]) == before
        finally:
            s.close()
            for n in (old, new):
                if n is not None:
                    n.close()


def test_region_ids_can_start_at_a_given_id_but_never_go_back_or_leave_u32():
    t = RegionTable()
    assert t.register(bytearray(8)).region_id == 1
    t.start_ids_at(1000)
    assert t.register(bytearray(8)).region_id == 1000
    t.start_ids_at(5)  # never backwards: ids are not reused
    assert t.register(bytearray(8)).region_id == 1001
    with pytest.raises(ValueError, match="first region id"):
        t.start_ids_at(1 << 32)
    t.start_ids_at((1 << 32) - 1)
    assert t.register(bytearray(8)).region_id == (1 << 32) - 1
    with pytest.raises(RegionError, match="exhausted"):
        t.register(bytearray(8))
