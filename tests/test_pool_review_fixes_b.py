"""Regression tests for the pool review of 2026-11-29, one per finding (in-process ``EmbeddedPool``s):

F1. a key removed and re-put with new content has its node's SSD record replaced at the persist, so a node
    restart brings back the new bytes, never the old;
F2. ``min_replicas=k`` is a floor: a put written to fewer than ``k`` replicas is revoked, also when the master
    placed fewer;
F3. ``flush_persist`` reports a node that a persist could not be sent to (those blocks were dropped);
F4. ``remove`` leaves no cached copy that a get racing it re-cached;
F5. a key longer than the master accepts is refused by every call the same way, before any RPC.
"""

from __future__ import annotations

import threading

import pytest

from quillcache.pool.embedded import EmbeddedPool
from quillcache.pool.errors import PutFailedError


@pytest.fixture
def one_node_ssd(tmp_path):
    pool = EmbeddedPool(1, 16 << 20, ssd_dirs=[str(tmp_path / "ssd0")], backend="local")
    try:
        yield pool
    finally:
        pool.close()


def test_a_re_put_key_comes_back_from_ssd_with_its_new_bytes(one_node_ssd):
    pool = one_node_ssd
    s = pool.store(replicas=1, persist=True, local_cache_bytes=0)
    try:
        s.put("k", b"A" * 1000)
        assert all("error" not in v for v in s.flush_persist().values())
        assert s.remove("k", force=True)
        s.put("k", b"B" * 1000)
        assert all("error" not in v for v in s.flush_persist().values())
    finally:
        s.close()
    pool.restart_node(0)
    s2 = pool.store(replicas=1, local_cache_bytes=0)
    try:
        v = s2.get("k")
        assert v is not None and bytes(v) == b"B" * 1000
        del v
    finally:
        s2.close()


def test_min_replicas_is_a_floor_when_the_master_places_fewer():
    pool = EmbeddedPool(1, 16 << 20, backend="local")
    try:
        s = pool.store(replicas=2, min_replicas=2, local_cache_bytes=0)
        try:
            with pytest.raises(PutFailedError, match="1 replica\\(s\\) written, fewer than min_replicas=2"):
                s.put("k", b"x" * 100)
            assert s.contains(["k"]) == [False]  # revoked, never acknowledged
            s1 = pool.store(replicas=2, min_replicas=1, local_cache_bytes=0)
            try:
                assert s1.put("k", b"x" * 100).replicas_written == 1
            finally:
                s1.close()
        finally:
            s.close()
    finally:
        pool.close()


def test_flush_persist_reports_a_persist_that_could_not_be_sent(one_node_ssd):
    pool = one_node_ssd
    node = pool.nodes[0]
    real, calls = node.persist, []

    def fails_once(items):
        calls.append(len(items))
        if len(calls) == 1:
            raise TimeoutError("simulated: the persist call timed out")
        return real(items)

    node.persist = fails_once
    s = pool.store(replicas=1, persist=True, local_cache_bytes=0)
    try:
        s.put("k", b"A" * 1000)
        (info,) = s.flush_persist().values()
        assert "1 persist(s) could not be sent to the node: " in info["error"] and "simulated" in info["error"]
        s.put("k2", b"B" * 1000)  # the next flush is about what came since
        (info,) = s.flush_persist().values()
        assert "error" not in info and info["persisted"] == 1
    finally:
        s.close()


def test_remove_leaves_no_copy_a_racing_get_cached():
    pool = EmbeddedPool(1, 16 << 20, backend="local")
    try:
        s = pool.store(replicas=1, local_cache_bytes=1 << 20)
        try:
            s.put("k", b"OLD" * 100)
            s.cache.drop("k")
            real = pool.master.remove

            def remove_while_a_get_runs(key, **kw):
                t = threading.Thread(target=lambda: s.get(key))
                t.start()
                t.join()
                return real(key, **kw)

            pool.master.remove = remove_while_a_get_runs
            try:
                assert s.remove("k", force=True)
            finally:
                pool.master.remove = real
            assert s.get("k") is None
        finally:
            s.close()
    finally:
        pool.close()


def test_a_key_longer_than_the_master_accepts_is_refused_the_same_way_by_every_call():
    from quillcache.master.types import MAX_KEY_CHARS

    pool = EmbeddedPool(1, 16 << 20, backend="local")
    try:
        s = pool.store(replicas=1, local_cache_bytes=0)
        try:
            key = "x" * (MAX_KEY_CHARS + 1)
            for call in (lambda: s.put(key, b"x"), lambda: s.get(key), lambda: s.contains([key]),
                         lambda: s.remove(key, force=True)):
                with pytest.raises(ValueError, match=f"a pool key is at most {MAX_KEY_CHARS} characters"):
                    call()
            s.put("x" * MAX_KEY_CHARS, b"ok")  # the longest accepted key works
            assert s.contains(["x" * MAX_KEY_CHARS]) == [True]
        finally:
            s.close()
    finally:
        pool.close()
