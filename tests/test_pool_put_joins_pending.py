"""A put that finds the same bytes' put in flight writes and ends it, instead of reporting ``existing`` for an
object that may never become readable (pool review of 2026-11-29, /tmp/s37/pool finding F2).

Before: a master killed between a put's start and its end (the start is logged) left a PENDING object whose
writer had given up; every later put of the same key and bytes, the writer's own retry included, was answered
``existing=True`` while ``get`` found nothing, for up to ``zombie_preempt_s`` (or ``zombie_reclaim_s`` when nobody
put it again). Here the dead writer is a put_start made straight on the master, never ended.
"""

from __future__ import annotations

import contextlib

import pytest

from quillcache.master import PutRequest, ReplicaConfig
from quillcache.pool.embedded import EmbeddedPool
from quillcache.pool.frame import TRAILER_BYTES, digest_of, encode_trailer

MiB = 1 << 20
DATA = bytes(range(256)) * 64


@pytest.fixture
def pool():
    with contextlib.closing(EmbeddedPool(2, 8 * MiB, backend="local")) as p:
        yield p


def _dead_writers_put_start(pool, key: str, data: bytes):
    """What a writer that died after its put_start leaves: a PENDING put of these bytes' digest."""
    digest = digest_of(encode_trailer(key, memoryview(data)))
    [r] = pool.master.batch_put_start([PutRequest(key=key, size_bytes=len(data) + TRAILER_BYTES, digest=digest,
                                                  config=ReplicaConfig(replica_num=1))], client_id=None)
    assert not r.existing
    return r


def test_a_retry_completes_the_put_a_dead_writer_left_in_flight(pool):
    _dead_writers_put_start(pool, "k", DATA)
    s = pool.store(replicas=1, local_cache_bytes=0)
    try:
        out = s.put("k", DATA)
        assert not out.existing and out.replicas_written == 1  # before: existing=True, nothing written
        assert s.get("k") == DATA  # before: None
        assert s.contains(["k"]) == [True]
    finally:
        s.close()


def test_when_the_other_writer_ends_first_the_put_reports_existing_and_the_bytes_are_readable(pool):
    r = _dead_writers_put_start(pool, "k", DATA)
    s = pool.store(replicas=1, local_cache_bytes=0)
    real = s._transfer

    def transfer_then_other_ends(reqs):  # the other writer ends its put while this one writes the same bytes
        out = real(reqs)
        pool.master.batch_put_end(["k"], put_ids=[r.put_id])
        return out

    s._transfer = transfer_then_other_ends
    try:
        out = s.put("k", DATA)
        assert out.existing
        assert s.get("k") == DATA
    finally:
        s.close()


def test_other_bytes_under_a_key_in_flight_are_still_refused(pool):
    _dead_writers_put_start(pool, "k", DATA)
    s = pool.store(replicas=1, local_cache_bytes=0)
    try:
        with pytest.raises(Exception, match="being written"):
            s.put("k", b"other bytes")
        assert s.get("k") is None
    finally:
        s.close()
