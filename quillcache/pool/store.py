"""``PooledStore``: the pool's client (what the engines' connectors and the harness use).

Longer than 600 lines because the single and batch forms of put and get share their placement, WRITE/READ,
verification, lease and fallback steps, which are kept next to each other in one class rather than split
across modules that would each need the store's locks and buffer. (The write-behind requests to nodes and
their flushes are :mod:`.persist_client`, mixed in.)

Protocol (Mooncake's, REFERENCE §4): the master places and indexes objects; the bytes move one-sided
between this process's registered buffer and the nodes' DRAM segments over the transfer engine.

- ``put(key, data)``: frame the payload (:mod:`quillcache.pool.frame`: the object the master sizes is
  ``payload + 24``), ``put_start`` (content digest = the trailer's length and crc32c, so a repeated put of
  the same content answers ``existing``), ONE batched WRITE to every replica, ``put_end``. Any failed WRITE
  revokes the put (``put_revoke``) and raises :class:`PutFailedError`: nothing half-written is ever
  readable. Fewer replicas than asked is accepted when the master placed fewer (best effort).
  ``min_replicas=k`` (opt-in; default None = the rule above) instead ends a put whose WRITEs completed on at
  least ``k`` replicas even if others failed, and revokes one written to fewer than ``k`` whatever the reason
  (also when the master placed fewer: ``k`` is a floor; ``replicas_written`` says how many hold it): the failed
  replicas' ranges stay in the index until the master drops them with their node at its client TTL. A get
  skips one whose bytes do not verify (crc32c over key + payload), but one still holding this same key's
  earlier frame of that size (removed, then re-put with new content) verifies: a get may return that OLD
  content, so use it only for keys naming immutable content. It trades a replica for availability while a
  dead node is still mounted (the master places new replicas on it until then).
  With ``persist=True`` each written replica's node is then told to write the object behind to its SSD tier
  (batched per node, sent by a background thread: never on the put's critical path); a node without an SSD tier
  refuses once (``NoSsdTierError``) and is sent no more persists (``flush_persist`` names it). ``flush_persist``
  asks, all at once, only the nodes holding persists that no flush confirmed yet (its docstring says when an
  address is forgotten); it never reports as durable a persist a node did not confirm.
- ``get(key)``: a hit in the local cache, else ``get_replicas`` (one RPC; the read lease is taken as
  ending ``lease_ttl_s`` after a clock reading made BEFORE the RPC, i.e. never later than the master's),
  ONE READ straight into this process's registered buffer, frame check (crc32c over key + payload). If
  the read completed after the lease ended the bytes are discarded and the key is looked up again once;
  any failure (transfer FAILED/TIMEOUT, corrupt bytes, an unreachable node) falls back to the next
  replica; ``None`` when no replica answers correctly or the key is not in the pool. Bytes that did not
  verify are never returned.
- Returned views are read-only memoryviews of this process's buffer, valid for as long as they are
  referenced (the range is pinned until the last view of it goes: :mod:`quillcache.pool.cache`); there is
  no copy between the wire and the caller.
- Batch forms: ``put_many``/``get_many`` make ONE master call per phase and ONE transfer batch for all
  their blocks (fallbacks add a round each); ``prefetch(keys)`` runs ``get_many`` on a background thread
  and fills the local cache; ``contains`` asks ``exists`` (no lease, no access-time change).
- Replica order: replicas on nodes that failed recently (``suspect_s``) are tried last.
- Every batch reply of the master must hold one answer per key: one of another length raises
  :class:`PoolError` naming the method and both lengths, and none of its answers is used (after a bad
  ``batch_put_end`` reply the puts of the call are revoked; those the master had ended stay complete).
- Local cache: this store's ``remove`` and its own put of new content drop its cached copy. Other clients'
  caches are not invalidated (by design): after another client removes or re-puts a key, they may serve
  their cached copy until it is evicted.
- Thread-safe: the master client, the engine and the cache are; counters are under a lock.

Embedded mode (everything in one process): :func:`quillcache.pool.embedded.embedded_store` (a function, not
a ``PooledStore.embedded`` classmethod: the embedded pool builds stores, so a classmethod here would make an
import cycle, which ``tests/test_import_graph.py`` forbids).

Parameters: ``lease_ttl_s`` must not exceed the master's lease TTL (default: ``MasterConfig``'s);
``local_cache_bytes`` is the LRU budget of verified objects kept in this process (0: no cache),
``staging_bytes`` more of the same registered buffer for reads and puts in flight.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields

from quillcache.alloc.buffers import aligned_empty
from quillcache.master.client import MasterClient
from quillcache.master.errors import MasterError, ObjectNotFoundError, ObjectNotReadyError
from quillcache.master.types import MAX_KEY_CHARS, MasterConfig, PutRequest, ReplicaConfig, ReplicaDescriptor
from quillcache.pool.cache import Alloc, LocalCache
from quillcache.pool.control_auth import control_key
from quillcache.pool.errors import (CorruptObjectError, MasterUnavailableError, PoolClosedError, PoolError,
                                    PutFailedError)
from quillcache.pool.frame import TRAILER_BYTES, check, digest_of, encode_trailer
from quillcache.pool.node import parse_region_name
from quillcache.pool.persist_client import PersistClient, persist_chunks

__all__ = ["PoolStats", "PooledStore", "PutOutcome", "persist_chunks"]

log = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass(frozen=True)
class PutOutcome:
    """One acknowledged put: ``replicas_written`` replicas on ``nodes`` hold its bytes and the object is
    readable. ``existing``: the pool already held this key with the same content, complete (nothing was written).
    A put that finds the same content's put in flight (started, not ended: a writer still writing, or one that died
    or lost the master meanwhile) waits up to the store's ``timeout_s`` for it to end: ended, it is ``existing``;
    not ended, the put fails (``PutFailedError``, nothing written): acknowledging it would report an object that may
    never be readable. A later put pre-empts such a put once it is ``zombie_preempt_s`` old (MasterConfig)."""

    key: str
    replicas_written: int
    existing: bool
    bytes_moved: int
    transfer_s: float
    nodes: tuple[str, ...] = ()  # node ids holding the bytes (written now, or the existing object's)


@dataclass(frozen=True)
class _InFlight:
    """``_put_round``'s answer for an item whose put_start found the same bytes' put in flight (not complete)."""

    put_id: int


@dataclass
class PoolStats:
    puts: int = 0
    put_failures: int = 0
    gets: int = 0
    local_hits: int = 0
    remote_hits: int = 0
    misses: int = 0
    fallbacks: int = 0
    corrupt_discarded: int = 0
    lease_expired_discards: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    transfer_s: float = 0.0
    persist_sent: int = 0
    persist_errors: int = 0
    persist_no_ssd: int = 0  # persists not sent: their node has no SSD tier (it said so once: NoSsdTierError)

    def copy(self) -> PoolStats:
        return PoolStats(**{f.name: getattr(self, f.name) for f in fields(self)})


class _Dest:
    """Where one object's framed bytes live locally: a cache range, or a temporary registered buffer."""

    __slots__ = ("alloc", "region", "offset", "size", "temp", "temp_region")

    def __init__(self, alloc: Alloc | None, region: int, offset: int, size: int, temp=None, temp_region=None):
        self.alloc, self.region, self.offset, self.size = alloc, region, offset, size
        self.temp, self.temp_region = temp, temp_region


def _check_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise TypeError(f"a pool key is a non-empty str, got {key!r:.80}")
    if len(key) > MAX_KEY_CHARS:  # the master's rule, refused here the same way by every call
        raise ValueError(f"a pool key is at most {MAX_KEY_CHARS} characters, got {len(key)}: {key[:40]!r}...")
    if not key.isascii():
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: no UTF-8 form for the frame's crc or the master's wire
            raise ValueError(f"a pool key must be UTF-8 text, got {key!r:.80}") from None
    return key


class PooledStore(PersistClient):
    """See the module docstring."""

    def __init__(self, master: MasterClient | str, engine=None, *, local_cache_bytes: int = 64 * MiB,
                 staging_bytes: int = 32 * MiB, replicas: int = 2, persist: bool = False, timeout_s: float = 5.0,
                 lease_ttl_s: float | None = None, secret: str | bytes | None = None, backend: str = "tcp",
                 master_timeout_s: float = 5.0, master_retry_s: float = 10.0, suspect_s: float = 5.0,
                 min_replicas: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        from quillcache.transfer import SECRET_ENV, TransferEngine

        if not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if min_replicas is not None and (not isinstance(min_replicas, int) or min_replicas < 1):
            raise ValueError(f"min_replicas must be None or an int >= 1, got {min_replicas!r}")
        self.replicas = replicas
        self.min_replicas = min_replicas
        self.persist_on = bool(persist)
        self.timeout_s = float(timeout_s)
        self.lease_ttl_s = float(lease_ttl_s if lease_ttl_s is not None else MasterConfig().lease_ttl_s)
        self.suspect_s = float(suspect_s)
        self.clock = clock
        self._closed = False
        self._owned: list = []  # closed with the store (an embedded pool: quillcache.pool.embedded)
        self.pool = None
        self._owns_master = not isinstance(master, MasterClient)
        self.master = (MasterClient(master, timeout_s=master_timeout_s, retry_s=master_retry_s)
                       if self._owns_master else master)
        self._owns_engine = engine is None
        if engine is None:
            engine = TransferEngine(backend, **({} if backend == "local" else {"secret": secret, "serve": False}))
        self.engine = engine
        key_secret = secret if secret is not None else os.environ.get(SECRET_ENV)  # the engine's own rule
        self._control_key = (control_key(key_secret) if getattr(engine, "backend_name", backend) != "local"
                             and key_secret else None)  # proofs for nodes' persist and flush (control_auth)
        self.cache = LocalCache(local_cache_bytes + staging_bytes, local_cache_bytes)
        self.region = engine.register_region(self.cache.view, name=f"pool-client-{id(self):x}", writable=True)
        self._segments: dict[str, tuple] = {}  # endpoint -> (engine segment id, control address, node id, region ids)
        self._seg_lock = threading.Lock()
        self._suspect: dict[str, float] = {}
        self._ctl_failed: set[str] = set()  # control addresses of nodes whose transfers failed
        self._no_ssd: dict[str, str] = {}  # control address -> why: nodes without an SSD tier (persists not sent)
        self._stats = PoolStats()
        self._stats_lock = threading.Lock()
        self._init_persist()
        self._prefetcher: ThreadPoolExecutor | None = None

    # ================================================================ lifetime
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_persist()
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True, cancel_futures=True)
        self._close_persist_clients()
        if self._owns_engine:
            self.engine.close()
        else:
            try:
                self.engine.unregister_region(self.region, timeout_s=5.0)
            except Exception:
                pass
        self.cache.close()
        if self._owns_master:
            self.master.close()
        for o in reversed(self._owned):
            o.close()

    def __enter__(self) -> PooledStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("the PooledStore is closed")

    def _count(self, **kw) -> None:
        with self._stats_lock:
            s = self._stats
            for k, v in kw.items():
                setattr(s, k, getattr(s, k) + v)

    def stats(self) -> PoolStats:
        with self._stats_lock:
            return self._stats.copy()

    def _master(self, fn, *args, **kwargs):
        from quillcache.rpc import RpcConnectionError, RpcTimeoutError

        try:
            return fn(*args, **kwargs)
        except (RpcTimeoutError, RpcConnectionError) as e:
            raise MasterUnavailableError(f"the master did not answer {getattr(fn, '__name__', fn)}: {e}") from e

    def _batch(self, method: str, items: list, **kwargs) -> list:
        """The master's batch ``method``: exactly one answer per item, in order; PoolError naming the method
        and both lengths otherwise (answers that cannot be matched to their keys are never used)."""
        reply = self._master(getattr(self.master, method), items, **kwargs)
        if not isinstance(reply, (list, tuple)) or len(reply) != len(items):
            got = f"{len(reply)} answers" if isinstance(reply, (list, tuple)) else f"a {type(reply).__name__}"
            raise PoolError(f"the master answered {method} of {len(items)} keys with {got}: a protocol error, "
                            f"none of its answers is used")
        return reply

    # ================================================================ segments
    def _segment(self, rep: ReplicaDescriptor) -> int:
        """The engine's segment id for ``rep``'s endpoint (opened on first use); ``TransferError`` when the
        endpoint is unreachable, is served by another node than ``rep``'s (a port reused after a crash), or no
        longer serves ``rep``'s region (a remount, or a restart of the node: region ids start at random)."""
        from quillcache.transfer import TransferError

        endpoint = rep.endpoint
        with self._seg_lock:
            got = self._segments.get(endpoint)
        if got is None or rep.region_id not in got[3]:  # new, or the node re-registered its region (remount)
            info = self.engine.open_segment(endpoint, timeout_s=min(self.timeout_s, 2.0))
            ctl = node = None
            for r in info.regions:
                parsed = parse_region_name(r.name)
                if parsed is not None:
                    ctl, node = parsed
                    break
            got = (info.segment_id, ctl, node, frozenset(r.region_id for r in info.regions))
            with self._seg_lock:
                self._segments[endpoint] = got
        if got[2] != rep.node_id:
            raise TransferError(f"{endpoint} is served by node {got[2]!r}, not by {rep.node_id!r} (a stale replica)")
        if rep.region_id not in got[3]:  # even freshly opened: the node remounted or restarted since the lookup
            raise TransferError(f"{endpoint} (node {rep.node_id!r}) serves no region {rep.region_id} any more "
                                f"(a stale replica)")
        return got[0]

    def _mark_failed(self, endpoint: str) -> None:
        with self._seg_lock:
            got = self._segments.pop(endpoint, None)  # re-open (fresh region list) next time
            self._suspect[endpoint] = self.clock()
            if got is not None and got[1]:
                self._ctl_failed.add(got[1])

    def _order(self, reps: Sequence[ReplicaDescriptor]) -> list[ReplicaDescriptor]:
        if not self._suspect:
            return list(reps)
        now = self.clock()
        sus = self._suspect
        return sorted(reps, key=lambda r: now - sus.get(r.endpoint, -1e18) < self.suspect_s)

    # ================================================================ local buffers
    def _dest(self, size: int) -> _Dest:
        a = self.cache.allocate(size)
        if a is not None:
            return _Dest(a, self.region.region_id, a.offset, size)
        # everything pinned or too big: a buffer of its own, registered for this op; page-aligned like the cache's
        # mmap, so the socket copy into it stays on the fast path (quillcache.alloc.buffers)
        buf = aligned_empty(size)
        reg = self.engine.register_region(buf, writable=True)
        return _Dest(None, reg.region_id, 0, size, buf, reg)

    def _dest_view(self, d: _Dest) -> memoryview:
        return self.cache.writable(d.alloc) if d.alloc is not None else memoryview(d.temp)

    def _drop_temp(self, d: _Dest) -> None:
        if d.temp_region is not None:
            self.engine.unregister_region(d.temp_region)
            d.temp_region = None

    def _release(self, d: _Dest) -> None:
        if d.alloc is not None:
            self.cache.release(d.alloc)
        self._drop_temp(d)

    def _transfer(self, reqs: list) -> tuple[list[tuple[bool, str]], float]:
        """Run requests as ONE batch (a lone request on this thread); ``[(ok, reason)]`` and seconds."""
        from quillcache.transfer import Op, Outcome, TransferError

        t0 = time.perf_counter()
        if len(reqs) == 1:
            r = reqs[0]
            fn = self.engine.read if r.op is Op.READ else self.engine.write
            try:
                fn(r.local_region, r.local_offset_bytes, r.segment, r.remote_region, r.remote_offset_bytes,
                   r.length_bytes, timeout_s=self.timeout_s)
                out = [(True, "")]
            except TransferError as e:
                out = [(False, f"{type(e).__name__}: {e}")]
        else:
            sts = self.engine.transfer_sync(reqs, timeout_s=self.timeout_s)
            out = [(s.outcome is Outcome.COMPLETED, f"{s.outcome.value}: {s.reason}") for s in sts]
        dt = time.perf_counter() - t0
        self._count(transfer_s=dt)
        return out, dt

    # ================================================================ puts
    def put(self, key: str, data, *, replicas: int | None = None) -> PutOutcome:
        """Store ``data`` under ``key`` (module docstring); raises :class:`PutFailedError` (nothing of it is
        readable) or :class:`MasterUnavailableError` (the master did not answer: the put's outcome is unknown,
        e.g. a ``put_end`` that ran but whose answer was lost)."""
        out = self.put_many([(key, data)], replicas=replicas)[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def put_many(self, items: Iterable[tuple[str, object]], *, replicas: int | None = None
                 ) -> list[PutOutcome | PoolError]:
        """Batch put: per item its :class:`PutOutcome` or the :class:`PoolError` a single put would raise."""
        self._check_open()
        r = self.replicas if replicas is None else replicas
        if not isinstance(r, int) or r < 1:
            raise ValueError(f"replicas must be an int >= 1, got {r!r}")
        keys, views, trailers = [], [], []
        for key, data in items:
            keys.append(_check_key(key))
            try:
                mv = memoryview(data)
            except TypeError:
                raise TypeError(f"put({key!r:.80}): data must support the buffer protocol, "
                                f"got {type(data).__name__}") from None
            if not mv.c_contiguous:
                raise ValueError(f"put({key!r:.80}): data must be C-contiguous")
            mv = mv.cast("B") if (mv.ndim != 1 or mv.format != "B") else mv
            views.append(mv)
            trailers.append(encode_trailer(key, mv))
        if not keys:
            return []
        if len(set(keys)) != len(keys):
            raise ValueError("put_many: a key appears twice in one batch")
        # "existing" names a COMPLETE object or a PENDING one, whose writer may be gone (a master crash between its
        # put_start and put_end): such an item is tried again, alone with the others like it, once the rest of the
        # batch is written, until its put_start answers otherwise (that put ended, or was revoked and this one
        # starts its own; other bytes completed meanwhile are refused there) or timeout_s passes (then it fails)
        out = self._put_round(keys, views, trailers, r)
        deadline = time.monotonic() + self.timeout_s
        delay = 0.002
        while True:
            wait = [i for i, o in enumerate(out) if isinstance(o, _InFlight)]
            left = deadline - time.monotonic()
            if not wait or left <= 0:
                break
            time.sleep(min(delay, left))  # a writer still writing ends within its transfer time
            delay = min(0.2, delay * 2)
            try:  # the items written in an earlier round keep their outcomes whatever happens to this one
                self._check_open()
                again = self._put_round([keys[i] for i in wait], [views[i] for i in wait],
                                        [trailers[i] for i in wait], r)
            except PoolError as e:  # the master stopped answering, the store was closed: what a put would raise
                again = [e] * len(wait)
            for i, o in zip(wait, again):
                out[i] = o
        for i, o in enumerate(out):
            if isinstance(o, _InFlight):
                out[i] = PutFailedError(
                    f"put({keys[i]!r:.120}): a put of the same bytes (put {o.put_id}) is in flight and did not end "
                    f"within {self.timeout_s} s; nothing was written (its writer may be gone: the master lets a new "
                    f"put pre-empt it zombie_preempt_s after it started)")
        ok = [o for o in out if isinstance(o, PutOutcome)]
        self._count(puts=len(ok), put_failures=len(out) - len(ok), bytes_written=sum(o.bytes_moved for o in ok))
        return out

    def _put_round(self, keys: list[str], views: list[memoryview], trailers: list[bytes], r: int) -> list:
        """One try of ``put_many``'s items: per item its outcome, its PoolError, or ``_InFlight`` (answered
        ``existing`` with an object that is not complete: nothing was written for it). When it raises, the puts it
        started and did not end or revoke are revoked (best effort)."""
        reqs = [PutRequest(key=k, size_bytes=v.nbytes + TRAILER_BYTES, config=ReplicaConfig(replica_num=r),
                           digest=digest_of(t)) for k, v, t in zip(keys, views, trailers)]
        started = self._batch("batch_put_start", reqs)  # short: nothing written; the master
        # reclaims the puts it started at their zombie deadline (their put ids cannot be matched to keys)
        mine = {i for i, res in enumerate(started) if not isinstance(res, MasterError) and not res.existing}
        closed: set[int] = set()  # of ``mine``: ended or revoked (anything else is revoked if this round raises)
        try:
            return self._write_round(keys, views, trailers, reqs, started, closed)
        except BaseException:
            left = sorted(mine - closed)
            if left:  # not written or not ended: given back now, so a retry is not refused for zombie_preempt_s
                try:
                    self._master(self.master.batch_put_revoke, [keys[i] for i in left],
                                 put_ids=[started[i].put_id for i in left])
                except Exception as e:
                    log.warning("revoking %d put(s) this put_many started failed: %s", len(left), e)
            raise

    def _write_round(self, keys: list[str], views: list[memoryview], trailers: list[bytes], reqs: list[PutRequest],
                     started: list, closed: set[int]) -> list:
        """``_put_round`` after its put_start: write, end (or revoke) the puts started, settle the others;
        ``closed`` gets each started put once it is ended or revoked."""
        from quillcache.transfer import Op, TransferError, TransferRequest

        settled = self._existing_answers(keys, reqs, started)
        out: list = [None] * len(keys)
        dests: dict[int, _Dest] = {}
        treqs: list = []
        owners: list[tuple[int, ReplicaDescriptor]] = []
        failed: dict[int, list[str]] = {}  # item -> why each failed replica failed
        written: dict[int, list[ReplicaDescriptor]] = {}
        try:
            for i, res in enumerate(started):
                k = keys[i]
                if isinstance(res, MasterError):
                    out[i] = PutFailedError(f"put({k!r:.120}): the master refused it: {res!r}")
                    continue
                if res.existing:
                    out[i] = settled[i]
                    continue
                size = views[i].nbytes + TRAILER_BYTES
                d = dests[i] = self._dest(size)
                dv = self._dest_view(d)
                n = views[i].nbytes
                dv[:n] = views[i]
                dv[n:size] = trailers[i]
                written[i] = []
                for rep in res.replicas:
                    try:
                        seg = self._segment(rep)
                    except (TransferError, OSError) as e:
                        self._mark_failed(rep.endpoint)
                        failed.setdefault(i, []).append(f"replica on {rep.node_id} ({rep.endpoint}) unreachable: {e}")
                        continue
                    treqs.append(TransferRequest(Op.WRITE, d.region, d.offset, seg, rep.region_id,
                                                 rep.offset_bytes, size))
                    owners.append((i, rep))
            dt = 0.0
            if treqs:
                results, dt = self._transfer(treqs)
                for (i, rep), (ok, why) in zip(owners, results):
                    if ok:
                        written[i].append(rep)
                    else:
                        self._mark_failed(rep.endpoint)
                        failed.setdefault(i, []).append(f"WRITE to {rep.node_id} ({rep.endpoint}) failed: {why}")
            need = self.min_replicas
            revoke = {i: "; ".join(why) for i, why in failed.items()
                      if need is None or len(written[i]) < need}
            if need is not None:  # a floor also when the master placed fewer than it
                revoke.update({i: f"{len(w)} replica(s) written, fewer than min_replicas={need}"
                               for i, w in written.items() if i not in revoke and len(w) < need})
            ends = [i for i in dests if i not in revoke]
            if revoke:
                idx = sorted(revoke)
                rv = self._batch("batch_put_revoke", [keys[i] for i in idx],
                                 put_ids=[started[i].put_id for i in idx])
                closed.update(idx)
                for i, res in zip(idx, rv):
                    extra = f" (revoke: {res!r})" if isinstance(res, MasterError) else " (revoked)"
                    out[i] = PutFailedError(f"put({keys[i]!r:.120}): {revoke[i]}{extra}")
            if ends:
                end_keys, end_ids = [keys[i] for i in ends], [started[i].put_id for i in ends]
                try:
                    done = self._batch("batch_put_end", end_keys, put_ids=end_ids)
                except PoolError:  # which ended is unknown: revoke all (refused for a complete one: it stays)
                    closed.update(ends)
                    try:
                        self._master(self.master.batch_put_revoke, end_keys, put_ids=end_ids)
                    except Exception as e:
                        log.warning("revoking %d put(s) after a bad put_end reply failed: %s", len(ends), e)
                    raise
                closed.update(ends)
                persist: dict[str, list] = {}
                for i, res in zip(ends, done):
                    reps = written[i]
                    size = views[i].nbytes + TRAILER_BYTES
                    if isinstance(res, MasterError):
                        out[i] = PutFailedError(f"put({keys[i]!r:.120}): put_end refused: {res!r}")
                        continue
                    out[i] = PutOutcome(keys[i], len(reps), False, size * len(reps), dt, tuple(r.node_id for r in reps))
                    if self.persist_on:
                        for rep in reps:
                            ctl = self._segments.get(rep.endpoint, (0, None, None, ()))[1]
                            if ctl:
                                persist.setdefault(ctl, []).append((keys[i], rep.offset_bytes, size, started[i].put_id))
                    d = dests[i]
                    self.cache.drop(keys[i])  # a new object: any cached copy is of an earlier one (removed, re-put)
                    if d.alloc is not None and self.cache.insert(keys[i], d.alloc, views[i].nbytes):
                        dests[i] = None  # now the cache's
                if persist:
                    self._queue_persist(persist)
        finally:
            for d in dests.values():
                if d is not None:
                    self._release(d)
        return out

    def _existing_answers(self, keys: list[str], reqs: list[PutRequest], started: list) -> dict[int, object]:
        """What the items answered ``existing`` by put_start really are: an existing :class:`PutOutcome` when the
        key's object is complete with these bytes, ``_InFlight`` when it is not complete (or was dropped meanwhile:
        the next round tries again), a PutFailedError when other bytes completed under the key meanwhile. One
        ``exists`` call, then, for the keys found complete, put_start once more (no effect on a complete object
        with the same digest; it refuses other bytes), so an object that changed between the two answers is never
        taken for this put's. Nothing is ever written into a put in flight by a second writer: a first writer
        that revokes frees its ranges at once, and a late WRITE would land on whatever was placed there next."""
        ex = [i for i, res in enumerate(started) if not isinstance(res, MasterError) and res.existing]
        if not ex:
            return {}
        out: dict[int, object] = {}
        done = [i for i, ok in zip(ex, self._batch("exists", [keys[i] for i in ex])) if ok is True]
        for i in set(ex) - set(done):
            out[i] = _InFlight(started[i].put_id)
        if not done:
            return out
        again = self._batch("batch_put_start", [reqs[i] for i in done])
        drop, drop_ids = [], []
        for i, res in zip(done, again):
            if isinstance(res, MasterError):
                out[i] = PutFailedError(f"put({keys[i]!r:.120}): the master refused it: {res!r}")
            elif res.existing and res.put_id == started[i].put_id:  # the object first seen, complete now
                out[i] = PutOutcome(keys[i], len(res.replicas), True, 0, 0.0, tuple(r.node_id for r in res.replicas))
            elif res.existing:  # another object than the one first answered (dropped and put again meanwhile)
                out[i] = _InFlight(res.put_id)
            else:  # dropped between the two answers and started anew here: given back, tried again next round
                drop.append(keys[i])
                drop_ids.append(res.put_id)
                out[i] = _InFlight(res.put_id)
        if drop:
            self._batch("batch_put_revoke", drop, put_ids=drop_ids)
        return out

    # ================================================================ gets
    def get(self, key: str) -> memoryview | None:
        """The payload stored under ``key`` (a read-only view), or None when the pool does not hold it
        (or no replica answered with bytes that verify)."""
        _check_key(key)
        self._check_open()
        v = self.cache.lookup(key)
        if v is not None:
            self._count(gets=1, local_hits=1)
            return v
        self._count(gets=1)
        return self._fetch([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[memoryview | None]:
        """``get`` of every key: local hits, then ONE ``get_replicas`` and ONE transfer batch for the rest."""
        self._check_open()
        keys = [_check_key(k) for k in keys]
        out: list = [None] * len(keys)
        remote: list[int] = []
        for i, k in enumerate(keys):
            v = self.cache.lookup(k)
            if v is not None:
                out[i] = v
            else:
                remote.append(i)
        self._count(gets=len(keys), local_hits=len(keys) - len(remote))
        if remote:
            # a key asked twice is fetched once
            uniq = list(dict.fromkeys(keys[i] for i in remote))
            got = dict(zip(uniq, self._fetch(uniq)))
            for i in remote:
                out[i] = got[keys[i]]
        return out

    def _fetch(self, keys: list[str]) -> list[memoryview | None]:
        from quillcache.transfer import Op, TransferError, TransferRequest

        n = len(keys)
        out: list = [None] * n
        t0 = self.clock()
        answers = self._batch("get_replicas", keys)
        reps: list[list[ReplicaDescriptor]] = [[] for _ in range(n)]
        lease_end = [t0 + self.lease_ttl_s] * n
        relookup_left = [1] * n
        for i, a in enumerate(answers):
            if isinstance(a, (ObjectNotFoundError, ObjectNotReadyError)):
                continue
            if isinstance(a, MasterError):
                raise PoolError(f"get({keys[i]!r:.120}): the master refused it: {a!r}")
            reps[i] = self._order(a)
        dests: dict[int, _Dest] = {}
        pos = [0] * n
        hits = fallbacks = corrupt = expired = nbytes = 0
        try:
            while True:
                active = [i for i in range(n) if out[i] is None and pos[i] < len(reps[i])]
                if not active:
                    break
                treqs, owners = [], []
                for i in active:
                    rep = reps[i][pos[i]]
                    d = dests.get(i)
                    if d is not None and d.size != rep.size_bytes:
                        self._release(d)
                        d = None
                    if d is None:
                        d = dests[i] = self._dest(rep.size_bytes)
                    try:
                        seg = self._segment(rep)
                    except (TransferError, OSError):
                        self._mark_failed(rep.endpoint)
                        pos[i] += 1
                        fallbacks += 1
                        continue
                    treqs.append(TransferRequest(Op.READ, d.region, d.offset, seg, rep.region_id, rep.offset_bytes,
                                                 rep.size_bytes))
                    owners.append((i, rep))
                if not treqs:
                    continue
                results, _ = self._transfer(treqs)
                now = self.clock()
                again: list[int] = []
                for (i, rep), (ok, _why) in zip(owners, results):
                    if not ok:
                        self._mark_failed(rep.endpoint)
                        pos[i] += 1
                        fallbacks += 1
                        continue
                    if now > lease_end[i]:  # the object may have been evicted and its range reused mid-read
                        expired += 1
                        if relookup_left[i]:
                            relookup_left[i] = 0
                            again.append(i)
                        else:
                            pos[i] += 1
                        continue
                    d = dests[i]
                    try:
                        payload_view = check(self._dest_view(d)[:rep.size_bytes], keys[i])
                    except CorruptObjectError as e:
                        log.warning("get(%r): replica on %s: %s", keys[i], rep.node_id, e)
                        corrupt += 1
                        fallbacks += 1
                        pos[i] += 1
                        continue
                    m = payload_view.nbytes
                    del payload_view
                    out[i] = self._deliver(keys[i], d, m)
                    dests.pop(i)
                    hits += 1
                    nbytes += rep.size_bytes
                if again:
                    t1 = self.clock()
                    fresh = self._batch("get_replicas", [keys[i] for i in again])
                    for i, a in zip(again, fresh):
                        reps[i] = self._order(a) if not isinstance(a, MasterError) else []
                        pos[i] = 0
                        lease_end[i] = t1 + self.lease_ttl_s
        finally:
            for d in dests.values():
                self._release(d)
        self._count(remote_hits=hits, misses=n - hits, fallbacks=fallbacks, corrupt_discarded=corrupt,
                    lease_expired_discards=expired, bytes_read=nbytes)
        return out

    def _deliver(self, key: str, d: _Dest, payload_bytes: int) -> memoryview:
        if d.alloc is None:  # a temporary buffer: the caller's now
            self._drop_temp(d)
            return memoryview(d.temp)[:payload_bytes].toreadonly()
        return self.cache.insert_and_export(key, d.alloc, payload_bytes)  # pinned before another thread can evict it

    def prefetch(self, keys: Sequence[str]) -> Future:
        """Fetch ``keys`` into the local cache in the background; the future's value is, per key, whether
        the pool had it (a later ``get`` of a found key is a local hit while the cache keeps it)."""
        self._check_open()
        keys = [_check_key(k) for k in keys]
        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pool-prefetch")
        return self._prefetcher.submit(lambda: [v is not None for v in self.get_many(keys)])

    # ================================================================ other calls
    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Per key: is it complete in the pool? (master ``exists``: no lease, no access-time change)."""
        self._check_open()
        keys = [_check_key(k) for k in keys]
        return [a is True for a in self._batch("exists", keys)]

    def remove(self, key: str, *, force: bool = False) -> bool:
        """Remove ``key`` from the pool (and this process's cache); False when the pool did not hold it.
        A live read lease refuses it (``LeaseHeldError`` from the master) unless ``force``."""
        _check_key(key)
        self._check_open()
        self.cache.drop(key)
        try:
            self._master(self.master.remove, key, force=force)
            return True
        except ObjectNotFoundError:
            return False
        finally:  # again: a get of this store between the first drop and the master's remove re-cached it
            self.cache.drop(key)

    def __repr__(self) -> str:
        return (f"PooledStore(master={self.master.address}, replicas={self.replicas}, "
                f"cache {self.cache.cached_bytes}/{self.cache.cache_bytes} bytes)")
