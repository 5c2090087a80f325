"""A pool node's write-behind keeps working once its SSD tier is full, and a node without one says so (soak review
of 2026-11-29, /tmp/s36/soak findings 1 and 4).

Before: the tier never evicts and the node deleted a record only when the same key was persisted again, so under
new keys the tier filled and every later persist was refused for good (``StoreFullError`` at each flush), while
the tier kept only keys the pool had long dropped. Now a full tier deletes its oldest records, keys the master no
longer holds first, and stores the new one. And a persist sent to a node started without ``--ssd`` returned 0
with a clean flush: nothing said the blocks were never durable.
"""

from __future__ import annotations

import contextlib

import pytest

from quillcache.pool import writebehind as wbmod
from quillcache.pool.embedded import EmbeddedPool
from quillcache.pool.keys import store_key

MiB = 1 << 20
DRAM = 8 * MiB  # the node's SSD tier is four times that: 32 MiB
OBJ = 256 * 1024


def _payload(i: int) -> bytes:
    return bytes([i % 251]) * OBJ


def _small_ssd_pool(tmp_path, ssd_bytes: int, dram_bytes: int) -> EmbeddedPool:
    from quillcache.pool.node import PoolNode

    class SmallSsdPool(EmbeddedPool):
        def _start_node(self, i):
            return PoolNode(self.master, dram_bytes=self.dram_bytes, ssd_dir=self.ssd_dirs[i], ssd_bytes=ssd_bytes,
                            node_id=self._node_ids[i], secret=self.secret, backend=self.backend,
                            heartbeat_s=self.heartbeat_s)

    return SmallSsdPool(1, dram_bytes, ssd_dirs=[str(tmp_path / "ssd0")], backend="local")


@pytest.fixture
def pool(tmp_path):
    with contextlib.closing(_small_ssd_pool(tmp_path, 4 * DRAM, DRAM)) as p:  # the node's default SSD size
        yield p


def _fill(pool, n: int, *, keep_hot: str | None = None) -> tuple[list[str], list[dict]]:
    """Put ``n`` new keys with persist (far more than the SSD tier holds), flushing every 8; a ``keep_hot`` key is
    read before each put so that the master keeps it while every other key goes."""
    s = pool.store(replicas=1, persist=True, local_cache_bytes=0)
    keys, flushes = [], []
    try:
        for i in range(n):
            if keep_hot is not None:
                assert s.get(keep_hot) is not None
            key = f"k-{i:05d}"
            s.put(key, _payload(i))
            keys.append(key)
            if i % 8 == 7:
                flushes.extend(s.flush_persist().values())
        flushes.extend(s.flush_persist().values())
    finally:
        s.close()
    return keys, flushes


def test_a_full_tier_evicts_its_oldest_records_and_keeps_persisting(pool):
    node = pool.nodes[0]
    capacity = node.ssd.capacity_bytes
    keys, flushes = _fill(pool, 3 * capacity // OBJ)  # three tiers' worth of new keys
    assert not [f["error"] for f in flushes if "error" in f]  # before: StoreFullError at every flush once full
    assert node.counters.ssd_evicted > 0 and node.counters.persist_skipped == 0
    held = {store_key(k) for k in keys[-10:]}
    assert held <= set(node.ssd.keys())  # the newest records are there
    assert store_key(keys[0]) not in node.ssd  # the oldest went
    assert node.ssd.used_bytes <= capacity
    assert node.info()["ssd_evicted"] == node.counters.ssd_evicted


def test_keys_the_pool_still_holds_are_evicted_last(pool):
    s = pool.store(replicas=1, persist=True, local_cache_bytes=0)
    try:
        s.put("hot", b"h" * OBJ)  # persisted first: the oldest record of the tier
        assert not [f for f in s.flush_persist().values() if "error" in f]
    finally:
        s.close()
    node = pool.nodes[0]
    _, flushes = _fill(pool, 2 * node.ssd.capacity_bytes // OBJ, keep_hot="hot")
    assert not [f["error"] for f in flushes if "error" in f]
    assert pool.master.exists(["hot"]) == [True]
    assert node.counters.ssd_evicted > 0
    assert store_key("hot") in node.ssd  # oldest, but the master still holds it: evicted after the dropped keys


def test_when_the_master_cannot_be_asked_age_alone_decides(pool, monkeypatch):
    node = pool.nodes[0]

    def unreachable(keys):
        raise ConnectionError("master unreachable")

    monkeypatch.setattr(node.write_behind, "_held", unreachable)
    keys, flushes = _fill(pool, 2 * node.ssd.capacity_bytes // OBJ)
    assert not [f["error"] for f in flushes if "error" in f]
    assert node.counters.ssd_evicted > 0 and store_key(keys[-1]) in node.ssd and store_key(keys[0]) not in node.ssd


def test_a_record_larger_than_the_tier_is_still_refused(pool, monkeypatch):
    """Eviction cannot make room for what never fits: the persist is refused and reported, as before."""
    node = pool.nodes[0]
    monkeypatch.setattr(wbmod, "EVICT_SLACK_FRACTION", 0.0)
    s = pool.store(replicas=1, persist=True, local_cache_bytes=0)
    try:
        s.put("small", b"s" * OBJ)
        assert not [f for f in s.flush_persist().values() if "error" in f]
        monkeypatch.setattr(node.ssd, "_capacity", OBJ)  # the tier shrinks below any new record
        s.put("big", b"b" * (OBJ + 4096))
        (result,) = s.flush_persist().values()
        assert "StoreFullError" in result["error"]
    finally:
        s.close()


def test_a_node_without_an_ssd_tier_refuses_persists_and_the_store_reports_it(tmp_path):
    pool = EmbeddedPool(2, DRAM, ssd_dirs=[str(tmp_path / "ssd0"), None], backend="local")
    try:
        s = pool.store(replicas=2, persist=True, local_cache_bytes=0)
        try:
            for i in range(3):
                s.put(f"k{i}", _payload(i))
                out = s.flush_persist()
                with_ssd, without = (out[n.control_address] for n in pool.nodes)
                assert "error" not in with_ssd
                assert "no SSD tier" in without["error"]  # before: a clean info(), ssd_blocks 0
            assert s.stats().persist_no_ssd >= 2 and s.stats().persist_errors == 0
        finally:
            s.close()
        assert pool.nodes[0].counters.persisted == 3
    finally:
        pool.close()


def test_a_record_larger_than_the_holes_eviction_leaves_is_stored(tmp_path):
    """Re-review M1: the pool drops every other key, so evicting them first leaves holes smaller than a big
    record; a round counted the tier's free bytes, saw enough, deleted nothing more and refused the record (and
    every later one of that size). Only what a round frees counts now."""
    with contextlib.closing(_small_ssd_pool(tmp_path, 4 * MiB, 32 * MiB)) as pool:
        node = pool.nodes[0]
        s = pool.store(replicas=1, persist=True, local_cache_bytes=0)
        n = 0
        while node.counters.ssd_evicted == 0 and n < 64:  # fill the tier exactly, 128 KiB records
            s.put(f"k{n:03d}", bytes([n % 251]) * (124 * 1024))
            n += 1
            s.flush_persist()
        for i in range(1, n, 2):
            s.remove(f"k{i:03d}", force=True)
        for big in ("big", "big2"):
            s.put(big, big.encode()[:1] * (600 * 1024))
            assert not [f["error"] for f in s.flush_persist().values() if "error" in f]
            assert store_key(big) in node.ssd
        assert node.counters.persist_skipped == 0
        s.close()


def test_a_large_record_among_many_small_ones_is_stored(tmp_path):
    """Re-review M2: a round looked at the 1,024 oldest records only, for 3 rounds, so a tier of small records
    refused a record it could hold, after deleting 3,072 records for it."""
    with contextlib.closing(_small_ssd_pool(tmp_path, 16 * MiB, 64 * MiB)) as pool:
        node = pool.nodes[0]
        s = pool.store(replicas=1, persist=True, local_cache_bytes=0)
        items = [(f"s{i:05d}", bytes([i % 251]) * 1000) for i in range(16 * MiB // 4096)]
        for j in range(0, len(items), 256):
            s.put_many(items[j:j + 256])
        assert not [f for f in s.flush_persist().values() if "error" in f]
        s.put("big", b"B" * (13 * MiB))
        assert not [f["error"] for f in s.flush_persist().values() if "error" in f]
        assert store_key("big") in node.ssd
        s.close()


# ---- second re-review (/tmp/s36/rr2 M1, M2, L1): the write-behind on a tier built here -----------------------------
PAGE = 4096


def _write_behind(ssd, held):
    from quillcache.pool.node import NodeCounters

    return wbmod.WriteBehind("n", memoryview(bytearray(1 << 20)), ssd, NodeCounters(), held=held)


def _fill_pages(wb, keys) -> None:
    small = bytearray(PAGE - 64)  # one page with its record header
    for k in keys:
        wb._put_making_room(store_key(k), k, small)
    wb.ssd.flush()


def test_held_records_in_every_slab_still_leave_room_for_a_slab_sized_record(tmp_path):
    """The pool holds one record in every slab: deleting every dropped record never empties a slab, so a record of
    one slab was refused after 8 rounds had evicted most of the tier. Now a round that freed enough but left only
    holes is followed by rounds by age alone, held records included."""
    from quillcache.store.ssd import SsdTier

    slabs, pages = 32, 16
    with contextlib.closing(SsdTier(str(tmp_path / "t"), capacity_bytes=slabs * pages * PAGE,
                                    slab_bytes=pages * PAGE)) as ssd:
        keys = [f"k{i:05d}" for i in range(slabs * pages)]
        held = set(keys[3::pages])
        wb = _write_behind(ssd, lambda ks: [k in held for k in ks])
        _fill_pages(wb, keys)
        assert ssd.free_bytes == 0
        wb._put_making_room(store_key("big"), "big", bytearray(pages * PAGE - 64))  # raised StoreFullError before
        assert store_key("big") in ssd
        assert wb.counters.ssd_evicted < len(keys) // 2  # not most of the tier


def test_held_records_get_a_second_chance_before_younger_dropped_ones():
    """Held records among the oldest were deleted before any younger record the pool had dropped, once they filled
    the chunks a round asks about."""
    from quillcache.store.ssd import SsdTier

    hot_n = wbmod._EVICT_SCAN_CHUNKS * wbmod.EVICT_CANDIDATES
    n = hot_n + 4000
    ssd = SsdTier(None, account_only=True, capacity_bytes=n * PAGE)
    keys = [f"k{i:05d}" for i in range(n)]
    hot = set(keys[:hot_n])  # persisted first, read ever since
    wb = _write_behind(ssd, lambda ks: [k in hot for k in ks])
    _fill_pages(wb, keys)
    wb._put_making_room(store_key("new"), "new", bytearray(PAGE - 64))
    assert store_key("new") in ssd and wb.counters.ssd_evicted > 0
    assert all(store_key(k) in ssd for k in hot)


def test_a_master_that_cannot_answer_is_asked_once_per_round():
    """Each of up to 16 chunks asked it again, each waiting out the master timeout, on the persist worker."""
    from quillcache.store.ssd import SsdTier

    n = 20_000
    ssd = SsdTier(None, account_only=True, capacity_bytes=n * PAGE)
    calls = []

    def unreachable(ks):
        calls.append(len(ks))
        raise TimeoutError("master did not answer")

    keys = [f"k{i:05d}" for i in range(n)]
    wb = _write_behind(ssd, lambda ks: [False] * len(ks))
    _fill_pages(wb, keys)
    wb._held = unreachable
    wb._put_making_room(store_key("new"), "new", bytearray(PAGE - 64))
    assert store_key("new") in ssd and len(calls) == 1
    assert store_key(keys[0]) not in ssd and store_key(keys[-1]) in ssd  # age alone


def test_records_persisted_with_the_one_that_needs_room_survive_it(tmp_path):
    """Third re-review (/tmp/s36/rr3 M1): a fallback that emptied a whole slab deleted the records persisted in the
    same flush (reported durable) and every held one on a one-slab tier; by age, they go last."""
    with contextlib.closing(_small_ssd_pool(tmp_path, 4 * MiB, 32 * MiB)) as pool:
        node = pool.nodes[0]
        s = pool.store(replicas=1, persist=True, local_cache_bytes=0)
        n = 0
        while node.ssd.free_bytes >= 128 * 1024:  # one record per flush: the fill itself never evicts
            s.put(f"k{n:03d}", bytes([n % 251]) * (124 * 1024))
            n += 1
            s.flush_persist()
        for i in range(1, n, 2):
            s.remove(f"k{i:03d}", force=True)
        held = [f"k{i:03d}" for i in range(0, n, 2)]
        s.put("fresh1", b"x" * 4000)
        s.put("fresh2", b"y" * 4000)
        s.put("big", b"B" * (600 * 1024))
        assert not [f["error"] for f in s.flush_persist().values() if "error" in f]
        assert all(store_key(k) in node.ssd for k in ("big", "fresh1", "fresh2"))
        assert sum(store_key(k) in node.ssd for k in held) >= len(held) // 2
        s.close()
