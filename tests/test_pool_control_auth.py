"""A pool node's state-changing control calls need a proof on the pool secret (``quillcache.pool.control_auth``).

Before, anyone who could reach a node's control port could queue persists and ask for flushes (server review of
2026-11-29, /tmp/s34/servers M1); the node's transfer port, beside it, already authenticated every connection.
Checked over the real control port of a node on the tcp backend: no proof, a malformed one, one made with another
secret, one too old, and one for other arguments are refused with ``ControlAuthError`` and queue nothing; the
pooled store's own calls carry proofs and persist as before; ``info`` stays open; the local backend checks nothing.
"""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.pool.control_auth import MAX_SKEW_S, check, control_key, sign
from quillcache.pool.embedded import EmbeddedPool
from quillcache.pool.errors import ControlAuthError
from quillcache.rpc import RpcClient

MiB = 1 << 20


@pytest.fixture
def pool(tmp_path):
    p = EmbeddedPool(1, 16 * MiB, ssd_dirs=[str(tmp_path / "ssd0")], backend="tcp")
    try:
        yield p
    finally:
        p.close()


def _object(pool) -> tuple[str, int, int]:
    s = pool.store(replicas=1, local_cache_bytes=0)
    try:
        s.put("real", b"r" * 5000)
    finally:
        s.close()
    (rep,) = pool.master.get_replica_list("real")
    return "real", rep.offset_bytes, rep.size_bytes


def test_persist_and_flush_without_a_valid_proof_are_refused_and_queue_nothing(pool, caplog):
    node = pool.nodes[0]
    item = _object(pool)
    key = control_key(pool.secret)
    other = control_key("not-the-pool-secret")
    now_s = 1_000_000.0
    cases = [
        ("no proof", None, "needs a proof"),
        ("malformed", [1, b"short"], "malformed proof"),
        ("other secret", sign(other, "persist", [item]), "does not match"),
        ("too old", sign(key, "persist", [item], now_s=now_s), "from this node's clock"),
        ("other arguments", sign(key, "persist", [("real", item[1] + 64, item[2])]), "does not match"),
    ]
    caplog.set_level(logging.WARNING, logger="quillcache.pool.node")
    with RpcClient(node.control_address, timeout_s=10) as c:
        for what, auth, needle in cases:
            with pytest.raises(ControlAuthError, match=needle):
                c.call("persist", [item], auth=auth)
        with pytest.raises(ControlAuthError, match="needs a proof"):
            c.call("flush")
        assert c.call("info")["persisted"] == 0  # info needs no proof; nothing was queued
        assert c.call("persist", [item], auth=sign(key, "persist", [item])) == 1
        assert c.call("flush", auth=sign(key, "flush", []))["persisted"] == 1
    assert any("refused (no valid proof)" in r.getMessage() or "needs a proof" in r.getMessage()
               for r in caplog.records), "a refused call leaves a log line"


def test_the_pooled_store_signs_its_persists(pool):
    s = pool.store(replicas=1, persist=True, local_cache_bytes=0)
    try:
        s.put_many([(f"k{i}", bytes([i]) * 700) for i in range(5)])
        (info,) = s.flush_persist().values()
        assert "error" not in info, info
        assert info["persisted"] == 5
    finally:
        s.close()


def test_a_store_with_another_secret_is_refused_and_told_so(pool):
    from quillcache.pool.store import PooledStore

    item = _object(pool)  # (written with the right secret)
    s = PooledStore(pool.master, secret="another-secret-entirely", backend="tcp", persist=True, local_cache_bytes=0)
    try:
        s._queue_persist({pool.nodes[0].control_address: [item]})
        (info,) = s.flush_persist().values()
        assert "ControlAuthError" in info["error"] and "does not match" in info["error"]
    finally:
        s.close()
    assert pool.nodes[0].info()["persisted"] == 0


def test_the_local_backend_checks_nothing(tmp_path):
    with EmbeddedPool(1, 4 * MiB, ssd_dirs=[str(tmp_path / "ssd0")], backend="local") as p:
        with RpcClient(p.nodes[0].control_address, timeout_s=10) as c:
            assert c.call("persist", []) == 0 and "persisted" in c.call("flush")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text(min_size=1, max_size=20), st.integers(0, 2**63), st.integers(0, 2**63)),
                max_size=8), st.floats(-MAX_SKEW_S * 0.99, MAX_SKEW_S * 0.99))
def test_a_proof_checks_for_its_own_arguments_within_the_skew_and_for_no_others(items, skew_s):
    key = control_key(b"s3cret")
    now_s = 2_000_000.0
    auth = sign(key, "persist", items, now_s=now_s + skew_s)
    assert check(key, "persist", items, auth, now_s=now_s) is None
    assert check(key, "persist", [list(t) for t in items], auth, now_s=now_s) is None  # tuples decode as lists
    assert check(key, "flush", items, auth, now_s=now_s) is not None
    assert check(key, "persist", items + [("x", 0, 0)], auth, now_s=now_s) is not None
    assert check(control_key(b"other"), "persist", items, auth, now_s=now_s) is not None
    assert check(key, "persist", items, auth, now_s=now_s + 2 * MAX_SKEW_S) is not None
