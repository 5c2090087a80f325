"""A put that finds the same bytes' put in flight is acknowledged only once that put ends (pool review of
2026-11-29, /tmp/s37/pool finding F2, and its re-review /tmp/s37/rr finding R1).

Before: a master killed between a put's start and its end (the start is logged) left a PENDING object whose
writer had given up; every later put of the same key and bytes, the writer's own retry included, was answered
``existing=True`` while ``get`` found nothing. A first fix had the later put write into the pending put's ranges
and end it; the re-review showed the first writer's revoke frees those ranges at once, so the late WRITE could
land on an object placed there next. Now the later put waits (up to the store's ``timeout_s``) for the pending
put to end, and fails, writing nothing, if it does not; a put after ``zombie_preempt_s`` pre-empts the stuck one.
Here the dead writer is a put_start made straight on the master, never ended.
"""

from __future__ import annotations

import contextlib
import time

import pytest
from polling import wait_until

from quillcache.master import MasterConfig, PutRequest, ReplicaConfig
from quillcache.pool.embedded import EmbeddedPool
from quillcache.pool.errors import PutFailedError
from quillcache.pool.frame import TRAILER_BYTES, digest_of, encode_trailer

MiB = 1 << 20
DATA = bytes(range(256)) * 64
PREEMPT_S = 1.0


@pytest.fixture
def pool():
    cfg = MasterConfig(zombie_preempt_s=PREEMPT_S)
    with contextlib.closing(EmbeddedPool(1, 8 * MiB, backend="local", config=cfg)) as p:
        yield p


def _dead_writers_put_start(pool, key: str, data: bytes):
    """What a writer that died after its put_start leaves: a PENDING put of these bytes' digest."""
    digest = digest_of(encode_trailer(key, memoryview(data)))
    [r] = pool.master.batch_put_start([PutRequest(key=key, size_bytes=len(data) + TRAILER_BYTES, digest=digest,
                                                  config=ReplicaConfig(replica_num=1))])
    assert not r.existing
    return r


def test_a_put_of_bytes_in_flight_fails_unwritten_until_the_stuck_put_can_be_preempted(pool):
    r = _dead_writers_put_start(pool, "k", DATA)
    rep = r.replicas[0]
    s = pool.store(replicas=1, local_cache_bytes=0, timeout_s=0.3)
    try:
        with pytest.raises(PutFailedError, match="in flight and did not end"):  # before: existing=True
            s.put("k", DATA)
        assert s.get("k") is None
        ram = pool.nodes[0].view()  # nothing written into the other writer's ranges (R1)
        assert not any(ram[rep.offset_bytes:rep.offset_bytes + rep.size_bytes])
        # once the stuck put is zombie_preempt_s old, a put pre-empts it and writes the key
        wait_until(lambda: _put_ok(s, "k", DATA), timeout_s=PREEMPT_S + 10, what="a put pre-empting the stuck one")
        assert s.get("k") == DATA
    finally:
        s.close()


def _put_ok(s, key: str, data: bytes) -> bool:
    try:
        return not s.put(key, data).existing
    except PutFailedError:
        return False


def test_a_put_waits_for_the_other_writer_to_end_and_reports_existing(pool):
    r = _dead_writers_put_start(pool, "k", DATA)
    s = pool.store(replicas=1, local_cache_bytes=0, timeout_s=5.0)
    real = s._batch

    def batch(method, items, **kw):  # the other writer ends its put while this one waits on it
        if method == "exists":
            pool.master.batch_put_end(["k"], put_ids=[r.put_id])
        return real(method, items, **kw)

    s._batch = batch
    try:
        out = s.put("k", DATA)
        assert out.existing and out.bytes_moved == 0
    finally:
        s.close()


def test_other_bytes_under_a_key_in_flight_are_still_refused(pool):
    _dead_writers_put_start(pool, "k", DATA)
    s = pool.store(replicas=1, local_cache_bytes=0)
    try:
        with pytest.raises(PutFailedError, match="being written"):
            s.put("k", b"other bytes")
        assert s.get("k") is None
    finally:
        s.close()


def test_other_bytes_completed_while_waiting_are_never_taken_for_this_put(pool):
    """Round-2 re-review /tmp/s37/rr2 N2: the wait looked only at ``exists``; a first writer that revoked and a third
    that put OTHER bytes meanwhile made this put answer existing=True for bytes it never wrote."""
    r = _dead_writers_put_start(pool, "k", DATA)
    s = pool.store(replicas=1, local_cache_bytes=0)
    real = s._batch
    other = b"other bytes" * 100

    def batch(method, items, **kw):  # while this put looks: the first writer revokes, a third puts other bytes
        if method == "exists" and not hasattr(batch, "done"):
            batch.done = True
            pool.master.batch_put_revoke(["k"], put_ids=[r.put_id])
            t = pool.store(replicas=1, local_cache_bytes=0)
            t.put("k", other)
            t.close()
        return real(method, items, **kw)

    s._batch = batch
    try:
        with pytest.raises(PutFailedError, match="already exists"):  # before: existing=True
            s.put("k", DATA)
        assert bytes(s.get("k")) == other
    finally:
        s.close()


def test_a_revoked_awaited_put_frees_the_key_for_this_one_and_fresh_keys_do_not_wait(pool):
    """N3: the whole batch waited for the stuck key before writing any of it, and a put whose awaited put was revoked
    waited out timeout_s although the key was free. Now the stuck item is tried again, alone, after the batch."""
    r = _dead_writers_put_start(pool, "k", DATA)
    s = pool.store(replicas=1, local_cache_bytes=0, timeout_s=30)
    real_round = s._put_round
    seen = []

    def put_round(keys, views, trailers, rep):
        if seen:  # a later round: the fresh key of the batch is already written, and the first writer gives up now
            seen.append(pool.master.exists(["fresh"])[0])
            pool.master.batch_put_revoke(["k"], put_ids=[r.put_id])
        else:
            seen.append(keys)
        return real_round(keys, views, trailers, rep)

    s._put_round = put_round
    try:
        t0 = time.monotonic()
        out = s.put_many([("fresh", b"f" * 100), ("k", DATA)])
        assert time.monotonic() - t0 < 10  # before: the whole timeout_s (here 30 s), then a failure
        assert [o.existing for o in out] == [False, False]
        assert seen[0] == ["fresh", "k"] and seen[1] is True
        assert bytes(s.get("k")) == DATA and bytes(s.get("fresh")) == b"f" * 100
    finally:
        s.close()


# ---- round-3 re-review (/tmp/s37/rr3 P1-P4)

def test_an_object_replaced_between_the_two_answers_is_not_taken_for_the_first(pool):
    """P1: the second put_start answered existing for ANOTHER put of the same bytes (the key dropped after
    ``exists`` and a new writer started it and died); that put was taken for the complete one first seen."""
    t = pool.store(replicas=1, local_cache_bytes=0)
    t.put("k", DATA)
    t.close()
    s = pool.store(replicas=1, local_cache_bytes=0, timeout_s=0.3)
    real = s._batch

    def batch(method, items, **kw):
        out = real(method, items, **kw)
        if method == "exists" and not hasattr(batch, "done"):  # after it saw the object complete
            batch.done = True
            pool.master.remove("k", force=True)
            _dead_writers_put_start(pool, "k", DATA)
        return out

    s._batch = batch
    try:
        with pytest.raises(PutFailedError, match="in flight and did not end"):  # before: existing=True
            s.put("k", DATA)
        assert s.get("k") is None
    finally:
        s.close()


def test_a_waiting_put_counts_once_in_the_stats(pool):
    """P2: every round counted the waiting item as a failure again."""
    _dead_writers_put_start(pool, "k", DATA)
    s = pool.store(replicas=1, local_cache_bytes=0, timeout_s=0.3)
    try:
        out = s.put_many([("k", DATA), ("fresh", b"f" * 100)])
        assert isinstance(out[0], PutFailedError) and not isinstance(out[1], Exception)
        st = s.stats()
        assert (st.puts, st.put_failures) == (1, 1)  # before: one failure per round
    finally:
        s.close()


def test_a_later_round_that_fails_keeps_the_batch_outcomes(pool):
    """P3: a master that stopped answering in a later round made the whole put_many raise, and the items
    written in the first round lost their outcomes. P4: a store closed while an item waits gives it
    PoolClosedError (before: a TypeError, and a put started on the master and left in flight)."""
    from quillcache.pool.errors import MasterUnavailableError, PoolClosedError

    _dead_writers_put_start(pool, "k", DATA)
    s = pool.store(replicas=1, local_cache_bytes=0, timeout_s=5)
    real_round = s._put_round
    rounds = []

    def put_round(*a):
        rounds.append(1)
        if len(rounds) == 2:
            raise MasterUnavailableError("the master did not answer (injected)")
        return real_round(*a)

    s._put_round = put_round
    try:
        out = s.put_many([("fresh", b"f" * 100), ("k", DATA)])
        assert not isinstance(out[0], Exception) and isinstance(out[1], MasterUnavailableError)
    finally:
        s.close()
    s = pool.store(replicas=1, local_cache_bytes=0, timeout_s=5)
    real_check = s._check_open
    checks = []

    def check_open():
        checks.append(1)
        if len(checks) == 2:  # closed while the item waits, before its next round
            s.close()
        real_check()

    s._check_open = check_open
    try:
        [out] = s.put_many([("k", DATA)])
        assert isinstance(out, PoolClosedError)
    finally:
        s.close()


def test_puts_this_round_started_are_given_back_when_it_raises(pool):
    """P4: when something failed after put_start and before the puts were written, they stayed in flight at the
    master, and a retry was refused (OBJECT_ALREADY_EXISTS) until zombie_preempt_s."""
    from quillcache.pool.errors import MasterUnavailableError

    t = pool.store(replicas=1, local_cache_bytes=0)
    t.put("done", DATA)  # answered existing: the round then asks exists, which fails here
    t.close()
    s = pool.store(replicas=1, local_cache_bytes=0)
    real = s._batch

    def batch(method, items, **kw):
        if method == "exists":
            raise MasterUnavailableError("the master did not answer (injected)")
        return real(method, items, **kw)

    s._batch = batch
    try:
        with pytest.raises(MasterUnavailableError):
            s.put_many([("fresh", b"f" * 100), ("done", DATA)])
        assert "fresh" not in pool.master.keys()  # before: a PENDING put of it, refusing other bytes for 30 s
    finally:
        s.close()
