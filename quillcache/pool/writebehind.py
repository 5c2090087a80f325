"""``WriteBehind``: a pool node's write-behind of completed objects from its DRAM buffer to its SSD tier.

Contract:
- ``persist(items)`` with ``items = [(key, offset, size, put_id)]`` (``put_id``, the master's id of the put
  that wrote the object, may be left out) queues write-behind and returns how many it queued: a worker thread
  copies each range out of the DRAM buffer ONCE into its SSD record, verifies the frame (trailer + crc32c over key
  and payload) and ``SsdTier.put_async``s it; a range that does not verify (its object was evicted and the range
  reused, a bad offset) is skipped and counted, never stored; a key whose SSD record holds other bytes (removed,
  then re-put with new content) has that record replaced, unless the record is known to hold a LATER put's object
  (the put ids of records persisted or re-announced since the node's last mount are kept): a late persist of an
  earlier put is skipped (``persist_superseded``; not a failure: that object is no longer the key's).
- ``drop_if_stale(sk, trailer)``: the worker deletes record ``sk`` if it still ends with ``trailer`` (the
  master refused it at re-announce as older than its last word on the key), in order with persists.
- ``flush()`` waits until every queued persist has been handled and makes them durable, or raises
  ``PersistFailedError`` naming how many and why when any persist since the previous flush was not made durable
  (the SSD tier refused it, its group commit failed, or the persist was refused, below).
- What one ``persist`` can cost is bounded (the node's control port, which calls it, takes a proof of the pool
  secret, but the local backend checks none and a holder of the secret must not stall the node either): a
  call carries at most ``MAX_PERSIST_ITEMS`` items; an item's ``TRAILER_BYTES`` at ``offset + size -
  TRAILER_BYTES`` must read as a frame trailer of ``size - TRAILER_BYTES`` payload bytes, checked in the call
  and again before the worker copies the range, so an item that names no object costs O(trailer), never a copy
  of its range; at most ``queue_items`` items (at least ``MAX_PERSIST_ITEMS``) and ``queue_bytes`` bytes of
  ranges (at least, and by default, the DRAM buffer once: any one object fits) wait for the worker, so a
  ``flush()`` waits for at most that much copying. A call over either bound is refused whole, nothing of it
  queued, with ``PersistRefusedError`` (a ``PersistFailedError``); when the queue was full, its items whose
  trailer reads as an object's are also counted not durable for the next ``flush()``.
- Counted in the node's counters (``persisted`` counts durable blocks only; ``persist_skipped``,
  ``persist_failed``, ``persist_refused``); skipped and refused items are logged at most ``SKIP_LOG_BURST``
  lines per ``SKIP_LOG_WINDOW_S``, then one summary line per window (``skip_log``).
- A full tier makes room (the tier itself never evicts): when ``put_async`` raises ``StoreFullError`` (not
  ``DiskFullError``, which evicting does not cure), the worker runs rounds of eviction, each deleting records
  until the round has freed the record's footprint plus ``EVICT_SLACK_FRACTION`` of the tier (free bytes the
  tier already had may lie in holes too small for the record, so only what the round frees counts), making the
  deletes durable (one group commit: the tier reuses a block's space only then) and trying the record again, up to
  ``_EVICT_ROUNDS`` rounds. A round takes the OLDEST records (in the order they were persisted; records recovered
  at open come first, in the tier's order) in chunks of ``EVICT_CANDIDATES``, up to ``_EVICT_SCAN_CHUNKS``
  chunks, asking the master which keys it still holds (``held(keys)``: the node's ``exists``, no lease taken; a
  record whose key is not known yet counts as not held): it deletes those the master dropped and gives the held
  ones a second chance (moved to the end of the order, as if persisted now); once the master fails to answer, the
  rest of the round goes by age alone. Short of its target after that, it deletes by age (the records it did not
  ask about, then the held ones it moved). When a round freed as much as the record needs and the record still
  does not fit (slab layout: the room lies in holes between held records), the next rounds go by age alone, held
  records included: the oldest go first, the records persisted last go last. A record larger than the tier is
  refused before anything is deleted. Evicted records are counted (``ssd_evicted``) and never re-announced.
- ``stop()`` ends the worker after what is queued (idempotent); ``flush()`` after it returns at once.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from quillcache._checks import check_int
from quillcache._ratelog import BurstLog
from quillcache.master.types import MAX_KEY_CHARS
from quillcache.pool.errors import CorruptObjectError, PersistFailedError, PersistRefusedError, PoolClosedError
from quillcache.pool.frame import MAGIC, TRAILER_BYTES, VERSION, check
from quillcache.pool.keys import record_header, store_key
from quillcache.rpc.errors import quote

__all__ = ["EVICT_CANDIDATES", "EVICT_SLACK_FRACTION", "MAX_PERSIST_ITEMS", "PERSIST_QUEUE_ITEMS", "SKIP_LOG_BURST",
           "SKIP_LOG_WINDOW_S", "WriteBehind", "skip_log"]

log = logging.getLogger("quillcache.pool.node")  # the node's lines, under the node's logger

MAX_PERSIST_ITEMS = 4096  # items one persist call may carry
PERSIST_QUEUE_ITEMS = 16 * MAX_PERSIST_ITEMS  # default bound of the items waiting for the persist worker
SKIP_LOG_BURST = 5  # skipped or refused persists logged one by one per window ...
SKIP_LOG_WINDOW_S = 10.0  # ... the rest summed up in one line per window of this length
EVICT_SLACK_FRACTION = 1 / 16  # a round of eviction frees this share of the tier beyond the record: rounds are rare
EVICT_CANDIDATES = 1024  # records per question to the master (a chunk of the oldest)
_EVICT_ROUNDS = 8  # rounds tried for one record before it is refused (holes too small for it can need several)
_EVICT_SCAN_CHUNKS = 16  # chunks of EVICT_CANDIDATES a round asks the master about before it evicts by age


def skip_log(node_id: str, what: str = "persist items skipped or refused") -> BurstLog:
    """Node ``node_id``'s rate-limited log of refused or skipped ``what`` (``quillcache._ratelog``)."""
    return BurstLog(log, what, window_s=SKIP_LOG_WINDOW_S, burst=SKIP_LOG_BURST, prefix=f"node {node_id}: ")


_NO_VERSION = -1  # a persist item without a put id (three fields): replaces any record of its key, as before


class _DropIfStale:
    """A queued ``drop_if_stale``: delete record ``sk`` if it still ends with ``trailer``."""

    __slots__ = ("sk", "trailer")

    def __init__(self, sk, trailer: bytes) -> None:
        self.sk, self.trailer = sk, trailer


class _FlushRequest(threading.Event):
    """A ``flush()`` in the persist queue, set when handled; ``error`` (set before) says what is not durable."""

    error: str | None = None


class WriteBehind:
    """Write-behind of ``buf``'s objects to ``ssd`` for node ``node_id`` (module docstring); ``counters`` is
    the node's (``persisted``, ``persist_skipped``, ``persist_failed``, ``persist_refused``)."""

    def __init__(self, node_id: str, buf: memoryview, ssd, counters, *, queue_items: int = PERSIST_QUEUE_ITEMS,
                 queue_bytes: int | None = None,
                 held: Callable[[Sequence[str]], Sequence[object]] | None = None) -> None:
        self.node_id, self.buf, self.ssd, self.counters = node_id, buf, ssd, counters
        self._held = held  # keys -> answers, True where the master still holds the key (None: age alone)
        self._order_lock = threading.Lock()
        # the tier's records oldest first: store key -> pool key (None until known: recovered at open)
        self._order: OrderedDict = OrderedDict((sk, None) for sk in ssd.keys())
        # store key -> put id of the object its record holds, where known (persisted or re-announced since the
        # node's last mount; under _order_lock): a persist of an earlier put never replaces it
        self._versions: dict = {}
        self.capacity_bytes = len(buf)
        self.queue_items = check_int("persist_queue_items", queue_items, MAX_PERSIST_ITEMS)
        self.queue_bytes = check_int("persist_queue_bytes", self.capacity_bytes if queue_bytes is None
                                     else queue_bytes, self.capacity_bytes)
        self._q: queue.Queue = queue.Queue()
        self._q_lock = threading.Lock()  # stop and flush's request: no request is queued behind the stop
        self._queued_items = self._queued_bytes = 0  # waiting for the worker (under _q_lock)
        self._lost_lock = threading.Lock()
        self._lost_n = 0  # persists that will never be durable since the last flush (under _lost_lock)
        self._lost_why: str | None = None  # the first one's cause
        self._skip_log = skip_log(node_id)
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="pool-node-persist", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the worker after what is queued (idempotent) and log a due summary."""
        with self._q_lock:
            if self._stopped:
                return
            self._stopped = True
            self._q.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._skip_log.tick(final=True)

    def persist(self, items: list) -> int:
        """Queue ``[(key, offset, size)]`` (module docstring); returns how many were queued. An item that is
        malformed, out of the buffer, or whose trailer does not read as an object of its size is skipped (counted,
        logged rate-limited). ``PersistRefusedError`` when the call is over ``MAX_PERSIST_ITEMS`` or would pass the
        queue's bounds: then nothing of it is queued."""
        if self._stopped:
            raise PoolClosedError(f"node {self.node_id} is closed")
        if not isinstance(items, (list, tuple)):
            raise TypeError(f"persist takes a list of (key, offset, size), got {type(items).__name__}")
        if len(items) > MAX_PERSIST_ITEMS:
            self.counters.persist_refused += len(items)
            self._skip_log.note("refused (too many items)", "persist of %d items refused: at most %d items per call",
                                len(items), MAX_PERSIST_ITEMS, n=len(items))
            raise PersistRefusedError(f"node {self.node_id}: persist of {len(items)} items refused: at most "
                                      f"{MAX_PERSIST_ITEMS} items per call; nothing of it was queued")
        good, bad = [], 0
        for it in items:
            if (isinstance(it, (list, tuple)) and len(it) in (3, 4) and isinstance(it[0], str)
                    and 0 < len(it[0]) <= MAX_KEY_CHARS and all(type(x) is int and x >= 0 for x in it[1:])
                    and TRAILER_BYTES <= it[2] and it[1] + it[2] <= self.capacity_bytes
                    and self._trailer_problem(it[1], it[2]) is None):
                good.append((it[0], it[1], it[2], it[3] if len(it) == 4 else _NO_VERSION))
            else:
                bad += 1
                if bad == 1:
                    first = it
        if bad:
            self.counters.persist_skipped += bad
            self._skip_log.note("skipped in the call", "persist: %d of %d items skipped (malformed, out of the "
                                "buffer, or no object's trailer at their end), the first: %s", bad, len(items),
                                quote(first), n=bad)
        if not good:
            return 0
        size = sum(it[2] for it in good)
        with self._q_lock:
            if self._stopped:
                raise PoolClosedError(f"node {self.node_id} is closed")
            over = (f"{self.queue_items} items" if self._queued_items + len(good) > self.queue_items
                    else f"{self.queue_bytes} bytes" if self._queued_bytes + size > self.queue_bytes
                    else None)
            if over is None:
                self._queued_items += len(good)
                self._queued_bytes += size
                self._q.put(good)
                return len(good)
            queued_n, queued_b = self._queued_items, self._queued_bytes
        why = (f"persist of {len(good)} items ({size} bytes) refused: the persist queue holds {queued_n} items "
               f"({queued_b} bytes), at most {over}")
        self.counters.persist_refused += len(good)
        self._not_durable(why, len(good))  # each one's trailer reads as an object's: real blocks, not made durable
        self._skip_log.note("refused (queue full)", "%s", why, n=len(good))
        raise PersistRefusedError(f"node {self.node_id}: {why}; nothing of it was queued")

    def flush(self) -> None:
        """Wait for every queued persist and make them durable (at once after ``stop()``). PersistFailedError
        (naming how many and the first cause) when a persist since the previous flush is not durable."""
        req = _FlushRequest()
        with self._q_lock:  # checked and queued together: stop() queues its end after this, never between
            if self._stopped:
                return
            self._q.put(req)
        req.wait()
        if req.error is not None:
            raise PersistFailedError(f"node {self.node_id}: {req.error}")

    def _trailer_problem(self, off: int, size: int) -> str | None:
        """Why the ``TRAILER_BYTES`` at the end of ``[off, off + size)`` do not read as the trailer of an object of
        ``size`` bytes, or None (the crc32c, over key and payload, is checked after the copy)."""
        t = self.buf[off + size - TRAILER_BYTES:off + size]
        if bytes(t[:4]) != MAGIC or int.from_bytes(t[4:6], "big") != VERSION or bytes(t[6:8]) != b"\0\0":
            return "no frame trailer at the end of the range"
        length = int.from_bytes(t[8:16], "big")
        if length != size - TRAILER_BYTES:
            return f"the trailer says {length} payload bytes, the range holds {size - TRAILER_BYTES}"
        if bytes(t[20:24]) != b"\0\0\0\0":
            return "reserved trailer bytes are not zero"
        return None

    def learn(self, sk, key: str) -> None:
        """The pool key of a record recovered at open (the node's re-announce reads them)."""
        with self._order_lock:
            if sk in self._order and self._order[sk] is None:
                self._order[sk] = key

    def _on_commit(self, sk, err) -> None:
        if err is None:
            self.counters.persisted += 1
        else:  # the tier dropped the block
            with self._order_lock:
                self._order.pop(sk, None)
                self._versions.pop(sk, None)
            self.counters.persist_failed += 1
            self._not_durable(str(err))

    def _not_durable(self, why: str, n: int = 1) -> None:
        """``n`` persists since the last flush will never be durable: the next flush reports them."""
        with self._lost_lock:
            self._lost_n, self._lost_why = self._lost_n + n, self._lost_why or why

    def _loop(self) -> None:
        while True:
            wait_s = self._skip_log.wait_s()
            try:
                batch = self._q.get(timeout=SKIP_LOG_WINDOW_S if wait_s is None else wait_s)
            except queue.Empty:  # a summary of skipped items may be due
                self._skip_log.tick()
                continue
            try:
                if batch is None:
                    return
                if isinstance(batch, _FlushRequest):
                    self._flush_now(batch)
                    continue
                if isinstance(batch, _DropIfStale):
                    self._drop_if_stale(batch)
                    continue
                try:
                    for key, off, size, version in batch:
                        self._persist_one(key, off, size, version)
                finally:
                    with self._q_lock:
                        self._queued_items -= len(batch)
                        self._queued_bytes -= sum(it[2] for it in batch)
            except Exception:
                log.exception("node %s: persist worker", self.node_id)
            finally:
                self._q.task_done()

    def _flush_now(self, req: _FlushRequest) -> None:
        try:
            self.ssd.flush()  # a failed commit fired the callbacks (counted) before raising
        except Exception as e:
            with self._lost_lock:
                self._lost_why = self._lost_why or f"{type(e).__name__}: {e}"
        finally:
            with self._lost_lock:
                if self._lost_why is not None:
                    req.error = f"{self._lost_n} persist(s) since the last flush not durable: {self._lost_why}"
                self._lost_n, self._lost_why = 0, None
            req.set()

    def note_version(self, sk, put_id: int) -> None:
        """The record ``sk`` now holds the pool's object of put ``put_id`` (it was re-announced under that put)."""
        with self._order_lock:
            if sk in self._order:
                self._versions[sk] = put_id

    def forget_versions(self) -> None:
        """Forget every record's put id (the node mounted again: the master's put ids may have started over)."""
        with self._order_lock:
            self._versions.clear()

    def drop_if_stale(self, sk, trailer: bytes) -> None:
        """Queue the deletion of record ``sk`` if it still ends with ``trailer`` (the master refused it as older
        than the pool's last word on its key): done by the worker, in order with persists, so a record of the key
        persisted meanwhile is kept (it has a put id; the refused record, recovered at open, has none)."""
        with self._q_lock:
            if not self._stopped:
                self._q.put(_DropIfStale(sk, bytes(trailer)))

    def _drop_if_stale(self, item: _DropIfStale) -> None:
        from quillcache.store.errors import BlockNotFoundError, StoreError

        with self._order_lock:  # persisted (or re-announced) since the mount: a put's record, not the refused one
            if item.sk in self._versions:
                return
        try:
            rec = self.ssd.get(item.sk)
            if bytes(memoryview(rec)[-TRAILER_BYTES:]) != item.trailer:
                return
            self.ssd.delete(item.sk)
        except BlockNotFoundError:
            return
        except StoreError as e:
            log.warning("node %s: stale SSD record %s not deleted: %s", self.node_id, item.sk, e)
            return
        with self._order_lock:
            self._order.pop(item.sk, None)
            self._versions.pop(item.sk, None)
        self.counters.ssd_stale_dropped += 1

    def _persist_one(self, key: str, off: int, size: int, version: int = -1) -> None:
        from quillcache.store.errors import StoreError

        why = self._trailer_problem(off, size)  # O(trailer): the range is copied only when this reads right
        if why is None:
            head = record_header(key)
            rec = bytearray(len(head) + size)
            rec[:len(head)] = head
            rec[len(head):] = self.buf[off:off + size]
            try:
                check(memoryview(rec)[len(head):], key)
            except CorruptObjectError as e:
                why = str(e)
        if why is not None:  # evicted and the range reused, or never this key's
            self.counters.persist_skipped += 1
            self._skip_log.note("skipped (did not verify)", "persist of %s at %d (%d bytes) skipped: %s",
                                quote(key), off, size, why)
            return
        sk = store_key(key)
        try:
            if sk in self.ssd:  # an earlier version (removed, then re-put) is replaced unless the same ...
                with self._order_lock:
                    held = self._versions.get(sk, _NO_VERSION)
                if version != _NO_VERSION and held > version:  # ... or a later put's (a late persist of an old one)
                    self.counters.persist_superseded += 1
                    self._skip_log.note("skipped (superseded)", "persist of %s (put %d) skipped: the SSD record "
                                        "holds the later put %d", quote(key), version, held)
                    return
                if self.ssd.get(sk) == rec:
                    with self._order_lock:
                        self._order[sk] = key
                        self._order.move_to_end(sk)
                        if version > held:
                            self._versions[sk] = version
                    return
                self.ssd.delete(sk)
                with self._order_lock:
                    self._order.pop(sk, None)
                    self._versions.pop(sk, None)
            self._put_making_room(sk, key, rec, version)
        except StoreError as e:
            self.counters.persist_skipped += 1
            self._not_durable(f"{type(e).__name__}: {e}")
            self._skip_log.note("refused by the SSD tier", "persist of %s refused by the SSD tier: %s",
                                quote(key), e)

    def _put_making_room(self, sk, key: str, rec: bytearray, version: int = _NO_VERSION) -> None:
        """``put_async`` of the record, after rounds of eviction while the tier is full (module docstring)."""
        from quillcache.store.errors import DiskFullError, StoreFullError

        need = self.ssd.footprint_bytes(len(rec))
        fragmented = False
        for attempt in range(_EVICT_ROUNDS + 1):
            try:
                self.ssd.put_async(sk, rec, self._on_commit)
                break
            except DiskFullError:
                raise
            except StoreFullError:  # a record the tier could never hold is refused before anything is deleted
                if need > self.ssd.capacity_bytes or attempt == _EVICT_ROUNDS:
                    raise
                made = self._evict(need, second_chance=not fragmented)
                if made is None:
                    raise
                # a round freed enough bytes and the record still does not fit: the room is in holes between
                # held records; the next rounds go by age alone
                fragmented = made >= need
        if sk not in self.ssd:  # a commit that put_async started failed: its callback dropped the block
            return
        with self._order_lock:  # (never held while the tier's lock is taken: callbacks take this one under it)
            self._order[sk] = key
            self._order.move_to_end(sk)
            if version != _NO_VERSION:
                self._versions[sk] = version

    def _held_of(self, chunk: list) -> set | None:
        """The keys of ``chunk`` the master still holds; None when it cannot be asked (age alone decides)."""
        asked = [key for _, key in chunk if key is not None]
        if self._held is None or not asked:
            return set()
        try:
            return {k for k, a in zip(asked, list(self._held(asked))) if a is True}
        except Exception as e:
            self._skip_log.note("eviction by age alone", "SSD tier full: the master could not be asked which keys "
                                "it holds (%s); evicting the oldest records", e)
            return None

    def _delete(self, sk) -> int:
        """Delete one record now (durable at the next commit); the footprint it frees (0 when it was gone)."""
        try:
            size = self.ssd.size_of(sk)
            self.ssd.delete(sk)
        except KeyError:  # gone meanwhile (a failed commit dropped it)
            size = None
        with self._order_lock:
            self._order.pop(sk, None)
            self._versions.pop(sk, None)
        return 0 if size is None else self.ssd.footprint_bytes(size)

    def _evict(self, need_bytes: int, *, second_chance: bool = True) -> int | None:
        """One round (module docstring): delete records until this round freed ``need_bytes`` plus the slack, then
        commit the deletes; returns the bytes freed, None when there was nothing to delete. Only what the round
        frees counts (the tier's free bytes may lie in holes too small for the record). Without
        ``second_chance`` the round goes by age alone."""
        target = need_bytes + int(self.ssd.capacity_bytes * EVICT_SLACK_FRACTION)
        freed = deleted = dropped = 0
        seen: set = set()  # asked this round: a held record moved to the end is not asked again
        for _ in range(_EVICT_SCAN_CHUNKS if second_chance else 0):
            if freed >= target:
                break
            with self._order_lock:
                chunk = []
                for item in self._order.items():
                    if item[0] in seen:
                        break  # the records moved to the end this round: every older one was asked
                    chunk.append(item)
                    if len(chunk) == EVICT_CANDIDATES:
                        break
            if not chunk:
                break
            held = self._held_of(chunk)
            if held is None:  # the master did not answer: this chunk and the rest of the round by age
                break
            for sk, key in chunk:
                if freed >= target:
                    break
                seen.add(sk)
                if key in held:  # a second chance: to the end of the order
                    with self._order_lock:
                        if sk in self._order:
                            self._order.move_to_end(sk)
                    continue
                n = self._delete(sk)
                freed, deleted, dropped = freed + n, deleted + (n > 0), dropped + (n > 0)
        while freed < target:  # by age: records not asked about, then the held ones moved to the end
            with self._order_lock:
                sk = next(iter(self._order), None)
            if sk is None:
                break
            n = self._delete(sk)
            freed, deleted = freed + n, deleted + (n > 0)
        if not deleted:
            return None
        self.counters.ssd_evicted += deleted
        log.info("node %s: SSD tier full: evicted %d records (%d of them the master said it no longer holds)",
                 self.node_id, deleted, dropped)
        self.ssd.flush()  # the deletes durable: only then is their space reused
        return freed
