"""``PooledStore`` against an in-process pool (``EmbeddedPool``: an in-process master, PoolNodes serving their
DRAM over the tcp transfer backend on 127.0.0.1, and the client moving real bytes with one-sided READ/WRITE).

Covers: put/get bit-exact with replicas on distinct nodes; a failed WRITE revokes the put (nothing readable,
nothing pending); fallback to the 2nd replica when the 1st is corrupted or its node stops serving, and a
miss (never wrong bytes) when every replica is bad; the read-lease check with an injected clock; the local
cache (hits, pinned views survive eviction; a Hypothesis run of random cache operations); batch forms and
prefetch; same-content re-put; bad input; SSD write-behind + re-announce after a node restart; nodes
expired by the master remount (a new region: stale descriptors refused) and re-announce; a port reused by
another node is never read or written; opt-in ``min_replicas``; the embedded store on the tcp and the
local backend. Random data come from seeded generators (seed in the messages).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.pool import PooledStore, PutFailedError
from quillcache.pool.embedded import EmbeddedPool

MiB = 1 << 20
SEED = 20261125


def _blob(rng, lo=1, hi=MiB) -> bytes:
    return rng.integers(0, 256, int(rng.integers(lo, hi)), dtype=np.uint8).tobytes()


@pytest.fixture
def pool():
    p = EmbeddedPool(3, 32 * MiB)  # 96 MiB: no test here fills it past the eviction watermark
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def store(pool):
    s = pool.store(local_cache_bytes=0, staging_bytes=8 * MiB)
    try:
        yield s
    finally:
        s.close()


def _node_of(pool, node_id):
    return next(n for n in pool.nodes if n is not None and n.node_id == node_id)


def test_put_get_bit_exact_on_distinct_nodes(pool, store):
    rng = np.random.default_rng(SEED)
    data = {f"obj-{i}": _blob(rng) for i in range(40)}
    for k, v in data.items():
        out = store.put(k, v)
        assert out.replicas_written == 2 and not out.existing and out.bytes_moved == 2 * (len(v) + 24)
        assert sorted(out.nodes) == sorted(r.node_id for r in pool.master.get_replica_list(k))
    for k, v in data.items():
        reps = pool.master.get_replica_list(k)
        assert len({r.node_id for r in reps}) == 2, f"seed {SEED}: {k} replicas not on distinct nodes"
        got = store.get(k)
        assert got is not None and got.readonly and bytes(got) == v, f"seed {SEED}: {k}"
    st = store.stats()
    assert st.puts == 40 and st.remote_hits == 40 and st.local_hits == 0 and st.fallbacks == 0
    assert store.get("never-put") is None and store.stats().misses == 1


def test_failed_write_revokes_the_put(pool, store):
    victim = pool.nodes[0]
    victim.engine.close()  # still mounted at the master, but its transfer server is gone
    rng = np.random.default_rng(SEED + 1)
    failed = 0
    for i in range(6):
        key = f"w-{i}"
        try:
            store.put(key, _blob(rng, 1000, 100_000), replicas=3)
        except PutFailedError as e:
            failed += 1
            assert key in str(e) and victim.node_id in str(e)
            assert store.contains([key]) == [False]
            with pytest.raises(Exception):
                pool.master.object_info(key)
    assert failed == 6  # 3 replicas on 3 nodes: every put touches the dead one
    assert pool.service.stats().num_pending == 0 and pool.service.stats().used_bytes == 0
    assert store.stats().put_failures == 6


def test_fallback_on_corrupt_first_replica_and_miss_when_all_bad(pool, store):
    rng = np.random.default_rng(SEED + 2)
    v = _blob(rng, 10_000, 50_000)
    store.put("c", v)
    reps = pool.master.get_replica_list("c")
    first = reps[0]
    buf = _node_of(pool, first.node_id).view()
    buf[first.offset_bytes + 17] ^= 0xFF
    got = store.get("c")
    assert got is not None and bytes(got) == v
    assert store.stats().corrupt_discarded == 1 and store.stats().fallbacks == 1
    second = reps[1]
    _node_of(pool, second.node_id).view()[second.offset_bytes + len(v) + 3] ^= 0x01  # in the trailer
    assert store.get("c") is None
    assert store.stats().corrupt_discarded == 3


def test_fallback_when_a_replica_node_stops_serving(pool, store):
    rng = np.random.default_rng(SEED + 3)
    data = {f"f-{i}": _blob(rng, 1000, 300_000) for i in range(20)}
    for k, v in data.items():
        store.put(k, v)
    pool.nodes[1].engine.close()  # gone for transfers, still mounted: the master still lists its replicas
    for k, v in data.items():
        got = store.get(k)
        assert got is not None and bytes(got) == v, f"seed {SEED + 3}: {k}"
    assert store.stats().fallbacks >= 1


def test_read_lease_expired_mid_read_is_discarded(pool):
    """Injected clock: the read 'ends' after the lease; the bytes are dropped and the key looked up again."""
    ticks = iter([0.0, 100.0, 100.0, 100.5])
    s = pool.store(local_cache_bytes=0, staging_bytes=4 * MiB, lease_ttl_s=10.0, clock=lambda: next(ticks))
    try:
        s.put("l", b"lease" * 1000)
        got = s.get("l")
        assert got is not None and bytes(got) == b"lease" * 1000
        assert s.stats().lease_expired_discards == 1
    finally:
        s.close()
    t = [0.0]

    def always_late() -> float:
        t[0] += 100.0
        return t[0]

    s = pool.store(local_cache_bytes=0, staging_bytes=4 * MiB, lease_ttl_s=10.0, clock=always_late)
    try:
        assert s.get("l") is None  # every read completes after its lease: never returned
        assert s.stats().lease_expired_discards >= 2
    finally:
        s.close()


def test_local_cache_hits_and_pinned_views(pool):
    rng = np.random.default_rng(SEED + 4)
    writer = pool.store(local_cache_bytes=0, staging_bytes=4 * MiB)
    reader = pool.store(local_cache_bytes=2 * MiB, staging_bytes=2 * MiB)
    try:
        data = {f"h-{i}": _blob(rng, 200_000, 400_000) for i in range(12)}
        for k, v in data.items():
            writer.put(k, v)
        held = reader.get("h-0")
        assert bytes(held) == data["h-0"] and reader.stats().remote_hits == 1
        assert bytes(reader.get("h-0")) == data["h-0"] and reader.stats().local_hits == 1
        for k, v in data.items():  # far more than the cache: h-0 is evicted from the LRU...
            assert bytes(reader.get(k)) == v
        assert bytes(held) == data["h-0"]  # ...but the view we still hold never changes
        assert reader.cache.cached_bytes <= 2 * MiB
        # the writer's own puts are not cached (cache 0); a cached store's puts are
        cw = pool.store(local_cache_bytes=4 * MiB, staging_bytes=MiB)
        try:
            cw.put("own", b"o" * 5000)
            assert bytes(cw.get("own")) == b"o" * 5000 and cw.stats().local_hits == 1
        finally:
            cw.close()
    finally:
        writer.close()
        reader.close()


def test_batch_forms_and_prefetch(pool, store):
    rng = np.random.default_rng(SEED + 5)
    items = [(f"b-{i}", _blob(rng, 1, 200_000)) for i in range(30)]
    outs = store.put_many(items)
    assert all(o.replicas_written == 2 for o in outs)
    got = store.get_many([k for k, _ in items] + ["missing", "b-3"])
    assert [bytes(g) for g in got[:30]] == [v for _, v in items]
    assert got[30] is None and bytes(got[31]) == items[3][1]
    assert store.contains(["b-0", "missing"]) == [True, False]
    # one transfer batch for the whole request: 30 + 1 remote objects, in one round
    reader = pool.store(local_cache_bytes=8 * MiB, staging_bytes=2 * MiB)
    try:
        fut = reader.prefetch([k for k, _ in items[:10]] + ["missing"])
        assert fut.result(timeout=30) == [True] * 10 + [False]
        assert [bytes(reader.get(k)) for k, _ in items[:10]] == [v for _, v in items[:10]]
        assert reader.stats().local_hits == 10
    finally:
        reader.close()
    from quillcache.master.errors import LeaseHeldError

    with pytest.raises(LeaseHeldError):  # we just read it: our read lease is live
        store.remove("b-0")
    assert store.remove("b-0", force=True) is True and store.get("b-0") is None
    assert store.remove("b-0") is False


def test_same_content_put_is_existing_other_content_refused(store):
    assert not store.put("same", b"abc" * 100).existing
    assert store.put("same", b"abc" * 100).existing
    with pytest.raises(PutFailedError, match="already exists"):
        store.put("same", b"abd" * 100)
    assert bytes(store.get("same")) == b"abc" * 100


def test_bad_input_is_refused_and_changes_nothing(pool, store):
    with pytest.raises(TypeError):
        store.put(b"k", b"x")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.put("k", 12345)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        store.put("k", b"x", replicas=0)
    with pytest.raises(TypeError):
        store.get("")
    with pytest.raises(ValueError):
        store.put_many([("d", b"1"), ("d", b"2")])
    assert pool.service.stats().num_objects == 0
    with pytest.raises(ValueError):
        PooledStore(pool.master, replicas=0)


def test_ssd_persist_and_reannounce_after_restart(tmp_path):
    dirs = [tmp_path / f"ssd-{i}" for i in range(3)]
    rng = np.random.default_rng(SEED + 6)
    with EmbeddedPool(3, 8 * MiB, ssd_dirs=dirs) as pool:
        s = pool.store(local_cache_bytes=0, staging_bytes=4 * MiB, persist=True, replicas=1)
        data = {f"p-{i}": _blob(rng, 1000, 200_000) for i in range(30)}
        for k, v in data.items():
            s.put(k, v)
        infos = s.flush_persist()
        assert sum(i["persisted"] for i in infos.values()) == 30
        victim = pool.nodes[2]
        mine = [k for k in data if pool.master.get_replica_list(k)[0].node_id == victim.node_id]
        assert mine, f"seed {SEED + 6}: node 2 got no object"
        pool.close_node(2)  # unmount: its objects leave the pool
        assert s.contains(mine) == [False] * len(mine)
        node = pool.restart_node(2)  # same node id, same SSD dir: recovery, then re-announce
        assert node.counters.reannounced == len(mine) and node.counters.reannounce_unfit == 0
        assert s.contains(list(data)) == [True] * len(data)
        for k, v in data.items():
            assert bytes(s.get(k)) == v, f"seed {SEED + 6}: {k}"
        s.close()


@pytest.mark.parametrize("backend", ["tcp", "local"])
def test_embedded_store_owns_its_pool(backend):
    from quillcache.pool import embedded_store

    with embedded_store(2, 4 * MiB, backend=backend, local_cache_bytes=MiB, staging_bytes=MiB, replicas=2) as s:
        assert s.pool.nodes[0].transfer_address.startswith("local://" if backend == "local" else "127.0.0.1:")
        assert s.put("e", b"embedded").replicas_written == 2
        assert bytes(s.get("e")) == b"embedded"
        nodes = list(s.pool.nodes)
    assert all(n._closed for n in nodes)


def test_expired_nodes_remount_and_reannounce(tmp_path):
    """The master (injected clock) expires every node: each heartbeat then answers NEED_REMOUNT, the nodes
    mount again and re-announce their SSD blocks, and every persisted object is readable again."""
    import time

    from quillcache.master.types import MasterConfig

    offset = [0.0]
    clock = lambda: time.monotonic() + offset[0]  # noqa: E731
    dirs = [tmp_path / f"ssd-{i}" for i in range(3)]
    rng = np.random.default_rng(SEED + 7)
    with EmbeddedPool(3, 8 * MiB, ssd_dirs=dirs, config=MasterConfig(client_ttl_s=5.0), clock=clock,
                      heartbeat_s=0.05, tick_s=0.05) as pool:
        s = pool.store(local_cache_bytes=0, staging_bytes=4 * MiB, persist=True, replicas=1)
        data = {f"r-{i}": _blob(rng, 1000, 100_000) for i in range(24)}
        for k, v in data.items():
            s.put(k, v)
        s.flush_persist()
        old_segments = {n.segment_id for n in pool.nodes}
        stale = pool.master.get_replica_list("r-0")[0]
        for n in pool.nodes:
            n.suspend_heartbeats()
        offset[0] += 60.0  # every node is now far past its client TTL
        deadline = time.monotonic() + 20
        while pool.master.clients():  # the master's timer expires them all
            assert time.monotonic() < deadline, "the master did not expire the silent nodes"
            time.sleep(0.02)
        assert s.contains(list(data)) == [False] * len(data)  # their segments went with them
        for n in pool.nodes:
            n.resume_heartbeats()
        while not (all(n.counters.remounts >= 1 for n in pool.nodes)
                   and all(s.contains(list(data)))):
            assert time.monotonic() < deadline, f"nodes did not remount and re-announce: {pool.nodes}"
            time.sleep(0.02)
        assert {n.segment_id for n in pool.nodes}.isdisjoint(old_segments)
        # a descriptor of the expired mount names a region the node no longer serves: refused, nothing written
        from quillcache.transfer import TransferError

        seg = s.engine.open_segment(stale.endpoint)
        with pytest.raises(TransferError):
            s.engine.write(s.region, 0, seg, stale.region_id, stale.offset_bytes, stale.size_bytes)
        for k, v in data.items():
            assert bytes(s.get(k)) == v, f"seed {SEED + 7}: {k}"
        s.close()


def test_a_port_reused_by_another_node_is_never_read_or_written(pool, store):
    """Node 0's transfer server dies while its segment is still mounted, and a NEW node takes its port: the
    client sees another node id behind the endpoint and neither reads nor writes there."""
    from quillcache.pool.node import PoolNode

    rng = np.random.default_rng(SEED + 8)
    data = {f"s-{i}": _blob(rng, 1000, 100_000) for i in range(10)}
    for k, v in data.items():
        store.put(k, v, replicas=3)
    old = pool.nodes[0]
    port = int(old.transfer_address.rsplit(":", 1)[1])
    old.engine.close()
    impostor = PoolNode(pool.master, dram_bytes=4 * MiB, secret=pool.secret, port=port, node_id="impostor")
    try:
        assert impostor.transfer_address == old.transfer_address
        before = bytes(impostor.view())
        fresh = pool.store(local_cache_bytes=0, staging_bytes=4 * MiB)
        try:
            for k, v in data.items():
                assert bytes(fresh.get(k)) == v
            with pytest.raises(PutFailedError, match="not by"):
                fresh.put("x", b"x" * 5000, replicas=3)  # the 3 big nodes (most free bytes), old node 0 among them
        finally:
            fresh.close()
        assert bytes(impostor.view()) == before  # nothing was written into the impostor's memory
    finally:
        impostor.close()


def test_min_replicas_ends_a_put_that_reached_enough_nodes(pool):
    """Opt-in ``min_replicas``: a put whose WRITE reached 2 of 3 nodes ends with 2 replicas written; gets skip
    the unwritten replica (it never verifies) and never return wrong bytes; without it the put is revoked."""
    pool.nodes[0].engine.close()
    s = pool.store(local_cache_bytes=0, staging_bytes=4 * MiB, min_replicas=2)
    strict = pool.store(local_cache_bytes=0, staging_bytes=4 * MiB)
    try:
        with pytest.raises(PutFailedError):
            strict.put("m-strict", b"s" * 10_000, replicas=3)
        out = s.put("m", b"m" * 10_000, replicas=3)
        assert out.replicas_written == 2 and out.bytes_moved == 2 * (10_000 + 24)
        assert pool.nodes[0].node_id not in out.nodes and len(set(out.nodes)) == 2
        assert len(pool.master.get_replica_list("m")) == 3  # the dead node's range stays until its TTL
        for _ in range(3):
            assert bytes(s.get("m")) == b"m" * 10_000
        with pytest.raises(ValueError):
            pool.store(min_replicas=0)
    finally:
        s.close()
        strict.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["get", "drop_view", "drop_key", "scratch"]), st.integers(0, 9),
                          st.integers(64, 20_000)), min_size=1, max_size=80))
def test_local_cache_views_never_change(ops):
    """Random use of the client's cache: a view handed out keeps its bytes whatever is allocated, cached,
    evicted or dropped afterwards (pinned ranges are never reused); the LRU stays within its budget."""
    from quillcache.pool.cache import LocalCache

    cache = LocalCache(96 * 1024, 48 * 1024)
    held: dict[int, tuple[memoryview, bytes]] = {}
    n = 0
    for op, slot, size in ops:
        n += 1
        key = f"k{slot}"
        if op == "get":
            v = cache.lookup(key)
            if v is None:
                a = cache.allocate(size)
                if a is None:
                    continue
                pattern = bytes([n % 251]) * size
                cache.writable(a)[:size] = pattern
                cache.insert(key, a, size)
                v = cache.export(a, size)
            held[n] = (v, bytes(v))
        elif op == "drop_view" and held:
            held.pop(sorted(held)[slot % len(held)])
        elif op == "drop_key":
            cache.drop(key)
        elif op == "scratch":
            a = cache.allocate(size)
            if a is not None:
                cache.writable(a)[:] = b"\xee" * size
                cache.release(a)
        assert cache.cached_bytes <= cache.cache_bytes
        for v, want in held.values():
            assert bytes(v) == want


def test_objects_larger_than_the_client_buffer_use_a_buffer_of_their_own(pool):
    rng = np.random.default_rng(SEED + 9)
    big = rng.integers(0, 256, 3 * MiB, dtype=np.uint8).tobytes()
    s = pool.store(local_cache_bytes=0, staging_bytes=MiB)
    try:
        regions = len(s.engine.regions)
        assert s.put("big", big).replicas_written == 2
        got = s.get("big")
        assert bytes(got) == big and got.readonly
        assert len(s.engine.regions) == regions  # the temporary regions were unregistered
    finally:
        s.close()


def test_a_second_node_under_a_live_nodes_id_is_refused_and_a_dead_ones_id_is_taken_over(pool, store):
    """Starting a node under the id of a node that still serves its segment would unmount that segment (the
    restart rule): it is refused, naming the id and endpoint, and the live node keeps its memory in the pool.
    Once that node stops serving (its transfer server closed, its segment still mounted), the same id starts,
    unmounts the stale segment and mounts its own."""
    from quillcache.pool import NodeIdInUseError
    from quillcache.pool.node import PoolNode

    live = pool.nodes[0]
    store.put("kept", b"k" * 5000, replicas=3)
    with pytest.raises(NodeIdInUseError, match=f"{live.node_id!r} is in use.*{live.transfer_address}"):
        PoolNode(pool.master, dram_bytes=4 * MiB, secret=pool.secret, node_id=live.node_id)
    assert [s.segment_id for s in pool.master.segments() if s.node_id == live.node_id] == [live.segment_id]
    assert bytes(store.get("kept")) == b"k" * 5000
    live.engine.close()  # stops serving; its segment stays mounted, as after a crash
    heir = PoolNode(pool.master, dram_bytes=4 * MiB, secret=pool.secret, node_id=live.node_id)
    try:
        mine = [s.segment_id for s in pool.master.segments() if s.node_id == live.node_id]
        assert mine == [heir.segment_id] and heir.segment_id != live.segment_id
    finally:
        heir.close()
