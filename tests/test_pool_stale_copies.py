"""A node's SSD copy never brings back bytes older than the pool's last word on their key (pool review of
2026-11-29, /tmp/s37/pool findings F1 and F3).

Before: a key removed, or removed and put again with new bytes, came back with its OLD bytes when the node holding
an SSD copy restarted (re-announce put back any key the master did not hold), and a late persist of a removed
object's range replaced the SSD record of the key's newer object, whose flush had been acknowledged. Now the master
remembers the last word on keys it dropped (``batch_put_start_returning`` refuses older copies; the node deletes
them) and a persist carries its put id, so an earlier put's never replaces a later put's record.
"""

from __future__ import annotations

import contextlib

import pytest

from quillcache.pool.embedded import EmbeddedPool
from quillcache.pool.frame import TRAILER_BYTES
from quillcache.pool.keys import decode_record, store_key

MiB = 1 << 20


@pytest.fixture
def pool(tmp_path):
    with contextlib.closing(EmbeddedPool(1, 8 * MiB, ssd_dirs=[str(tmp_path / "ssd0")], backend="local")) as p:
        yield p


def _restart_and_get(pool, key: str):
    node = pool.restart_node(0)  # closes (unmounts: its DRAM copies leave the pool), reopens the same SSD dir
    s = pool.store(replicas=1, local_cache_bytes=0)
    try:
        return node, s.get(key)
    finally:
        s.close()


def _ssd_payload(node, key: str) -> bytes:
    _, framed = decode_record(node.ssd.get(store_key(key)))
    return bytes(framed[:framed.nbytes - TRAILER_BYTES])


def test_a_removed_key_does_not_come_back_and_its_record_is_deleted(pool):
    s = pool.store(replicas=1, persist=True, local_cache_bytes=0)
    s.put("k", b"A" * 4096)
    s.put("kept", b"K" * 4096)
    assert all("error" not in r for r in s.flush_persist().values())
    assert s.remove("k")
    s.close()
    node, got = _restart_and_get(pool, "k")
    assert got is None  # before: b"A" * 4096
    assert node.counters.reannounce_stale == 1
    node.write_behind.flush()  # the worker deleted the stale record, in order with persists
    assert store_key("k") not in node.ssd and node.counters.ssd_stale_dropped == 1
    s = pool.store(replicas=1, local_cache_bytes=0)
    assert s.get("kept") == b"K" * 4096  # a record the pool only dropped (its node restarted) comes back
    s.close()


def test_a_key_put_again_with_new_bytes_never_comes_back_with_the_old_ones(pool):
    s = pool.store(replicas=1, persist=True, local_cache_bytes=0)
    s.put("k", b"A" * 4096)
    assert all("error" not in r for r in s.flush_persist().values())
    s.remove("k")
    s.close()
    s = pool.store(replicas=1, persist=False, local_cache_bytes=0)
    s.put("k", b"B" * 4096)  # in DRAM only: lost with the node, which is allowed; A coming back is not
    assert s.get("k") == b"B" * 4096
    s.close()
    node, got = _restart_and_get(pool, "k")
    assert got is None  # before: b"A" * 4096
    assert node.counters.reannounce_stale == 1


def test_a_late_persist_of_an_earlier_put_never_replaces_a_later_puts_record(pool):
    node = pool.nodes[0]
    s = pool.store(replicas=1, persist=False, local_cache_bytes=0)
    s.put("k", b"A" * 4096)
    s.put("spacer", b"S" * 4096)  # keeps A's freed range from taking B (larger), so A's bytes stay readable there
    a = pool.master.object_info("k")
    s.remove("k")
    s.put("k", b"B" * 8192)
    b = pool.master.object_info("k")
    assert a.replicas[0].offset_bytes != b.replicas[0].offset_bytes and b.put_id > a.put_id
    node.persist([("k", b.replicas[0].offset_bytes, b.size_bytes, b.put_id)])
    node.write_behind.flush()
    assert _ssd_payload(node, "k") == b"B" * 8192
    # the earlier put's persist arrives late (its sender's queue was held up); its range still verifies as "k"
    node.persist([("k", a.replicas[0].offset_bytes, a.size_bytes, a.put_id)])
    node.write_behind.flush()
    assert _ssd_payload(node, "k") == b"B" * 8192  # before: A replaced B's record
    assert node.counters.persist_superseded == 1
    s.close()
    node, got = _restart_and_get(pool, "k")
    assert got == b"B" * 8192


def test_a_reannounced_record_keeps_its_put_id_for_later_persists(pool):
    s = pool.store(replicas=1, persist=True, local_cache_bytes=0)
    s.put("k", b"A" * 4096)
    assert all("error" not in r for r in s.flush_persist().values())
    s.close()
    node, got = _restart_and_get(pool, "k")
    assert got == b"A" * 4096 and node.counters.reannounced == 1
    now = pool.master.object_info("k")
    # a persist naming an older put than the re-announced object's is superseded; the record stays
    node.persist([("k", now.replicas[0].offset_bytes, now.size_bytes, now.put_id - 1)])
    node.write_behind.flush()
    assert node.counters.persist_superseded == 1 and _ssd_payload(node, "k") == b"A" * 4096


def test_persist_items_are_checked_whole():
    from quillcache.pool import writebehind as wb

    class Counters:
        persist_skipped = persist_refused = 0

    class Ssd:
        def keys(self):
            return []

    c = Counters()
    w = wb.WriteBehind("n", memoryview(bytearray(4096)), Ssd(), c)
    # a fifth field, a negative or bool put id: malformed, skipped (counted), nothing queued
    assert w.persist([("k", 0, 64, 1, 2), ("k", 0, 64, -1), ("k", 0, 64, True)]) == 0
    assert c.persist_skipped == 3


def test_a_stale_drop_never_deletes_a_record_persisted_since_the_mount(pool):
    """Re-review /tmp/s37/rr R4: a key put again with the SAME bytes and persisted between the master's refusal of
    the old record and the queued delete: the delete compared trailers only and took the new record with it."""
    node = pool.nodes[0]
    s = pool.store(replicas=1, persist=True, local_cache_bytes=0)
    s.put("k", b"A" * 4096)
    assert all("error" not in r for r in s.flush_persist().values())
    s.close()
    rec = node.ssd.get(store_key("k"))
    node.write_behind.drop_if_stale(store_key("k"), bytes(memoryview(rec)[-TRAILER_BYTES:]))  # same trailer
    node.write_behind.flush()
    assert store_key("k") in node.ssd and node.counters.ssd_stale_dropped == 0
