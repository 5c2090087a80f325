"""``MasterService``: Mooncake's master semantics over a logged, deterministic state machine.

Longer than 600 lines because every Mooncake operation has its single-key, batch and compact (wire) form
here, each a thin wrapper over one shared core, so that the three can never disagree (tested).

Semantics (REFERENCE §4/§9, issue 14 item 1):
- ``mount_segment`` registers the segment's node as a client (and re-registers an expired one);
  ``unmount_segment`` drops the replicas on the segment; an object left with none is removed.
- ``put_start(key, size, config)`` places up to ``replica_num`` replicas on DISTINCT nodes, best
  effort: the preferred segment first, then segments by most free bytes (ties by segment id); fewer
  replicas rather than failure; only when none fits does it evict (below) and try once more, then
  NO_SPACE (a put larger than every segment is NO_SPACE at once: no eviction could make room). ``put_end`` makes the object readable and immutable; ``put_revoke`` cancels it.
- Same key again: a COMPLETE object, or a PENDING one younger than ``zombie_preempt_s``, with the
  same content digest is returned (``existing=True``); otherwise OBJECT_ALREADY_EXISTS. A PENDING
  put older than ``zombie_preempt_s`` is a zombie: a new put_start pre-empts it (its ranges stay
  allocated until ``started + zombie_reclaim_s``, since its writer may still be writing); a pending
  put never finished is reclaimed at ``started + zombie_reclaim_s``.
- ``get_replicas(keys)`` grants read leases ``lease_end = max(old, now + lease_ttl_s)`` and
  refreshes the last access; ``exists(keys)`` touches nothing (probes must not block eviction).
- ``remove`` is refused while the object is PENDING (OBJECT_NOT_READY) or leased (LEASE_HELD,
  unless ``force``); pins do not block an explicit remove.
- Eviction (``tick`` above ``high_watermark`` of capacity, or a ``put_start`` that found no space)
  frees at least ``evict_fraction`` of capacity: COMPLETE objects whose lease is over and that are
  not hard-pinned, in order of (last access, key) — exact LRU — taking soft-pinned objects (pin
  still within its TTL) only in a second pass.
- Clients heartbeat; ``tick`` expires a client unseen for more than ``client_ttl_s``: its
  segments are unmounted (as above) and its later calls answer NEED_REMOUNT until it mounts again.
- Time comes only from the injected ``clock``; timers run in ``tick()``.

Durability (``data_dir``): every state change is an operation-log record (:mod:`.oplog`) applied
by :class:`~.state.MasterState`; a call returns only after its records are fsynced (one fsync per
call: group commit for batches), except a call that only starts puts: its record is written and
fsynced by the next call that changes anything else (``MasterConfig.sync_put_start``; so a power
loss can forget a put never ended, never a COMPLETE object). Snapshots (:mod:`.snapshot`) once the log holds
``config.snapshot_due_changes(objects)`` state changes (as rarely as the restart budget allows, see
:class:`~.types.MasterConfig`), or every ``snapshot_every_s`` seconds, and at ``close``. By default a forked child writes them while the service goes on
(:mod:`.snapshot_writer`: the log is sealed at the snapshot's LSN, appends continue in a new segment,
the sealed segments are deleted once the snapshot is published; the service waits for the child once
``snapshot_inflight_records`` more changes were logged, which bounds the tail a restart replays);
``snapshot()`` and ``close`` write one inline and restart the log after it.
``MasterService(data_dir=D)`` = load the snapshot, replay the log tail, rebuild the allocators; a damaged or
torn last record that recovery dropped is kept aside in D, logged as a WARNING and listed in
``recovery_report`` (:class:`~.oplog.MasterRecoveryReport`; over RPC in ``master_status()["recovery"]``).
One master per data dir: before it reads anything in D the service takes D's exclusive lock
(:class:`~quillcache.durability.dirlock.DataDirLock`, ``D/master.lock``) and holds it until ``close``
(or its process ends), so a second master on D, in any process, is refused with
:class:`~quillcache.durability.dirlock.DataDirInUseError` naming D and the holder's pid, and nothing in D is touched; a refused or failed start releases it
(and closes the log and the index it opened: no file stays open).
``dir_lock=`` hands the service a lock its caller holds (and keeps: ``close`` leaves it held), so a
caller that reopens the service on D (HA: :mod:`.ha`) keeps D locked in between. A simulated file
system (``fs=``) is not locked.

Residency: the state machine writes every COMPLETE object's replicas into the residency index
(:mod:`.residency`) after the records are committed, so the planner sees what ``get_replicas``
answers. Default index: ``config.index_kind`` (ART) in memory, rebuilt from the snapshot and the
log at restart (they are the source of truth); ``config.index_on_disk`` keeps it under ``D/index``
with its own log, checkpointed with every snapshot of the master.

Batch forms return per-key results (the value or the :class:`MasterError`); single-key forms raise.
A log that fails to write or sync turns the service failed: every state change AND every read
(``get_replicas`` in each form, ``exists``, ``object_info``) answers LOG_FAILED, since memory then holds
the failed call's change that nobody acknowledged; reopening from the data dir ends it.

Replicated mode (HA): ``MasterService(..., replicate=fn)``, see :mod:`quillcache.master.replicated`.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from quillcache.alloc import OutOfSpaceError
from quillcache.durability.fs import FileSystem, RealFs
from quillcache.durability.wal import WalError
from quillcache.index import IndexBackend, open_index
from quillcache.master._kernels import (READ_BAD_KEY, READ_NOT_FOUND, all_new, check_new_puts, end_prefix,
                                       place_most_free, read_columns)
from quillcache.master.columns import PutColumns, ReplicaColumns, columns_from_rows
from quillcache.durability.dirlock import DataDirLock
from quillcache.master.errors import (
    InvalidParamsError, LeaseHeldError, LogFailedError, MasterError, NeedRemountError, NoSpaceError,
    ObjectExistsError, ObjectNotFoundError, ObjectNotReadyError, RecordEncodeError, SegmentExistsError,
    SegmentNotFoundError, StaleEpochError, StaleObjectError,
)
from quillcache.master.oplog import MasterRecoveryReport, Op, OpLog, decode_record
from quillcache.master.replicated import ReplicatedMode
from quillcache.master.placement import BatchPlacer
from quillcache.master.residency import IndexProjection
from quillcache.master.snapshot import recover, write_snapshot
from quillcache.master.snapshot_writer import SnapshotOutcome, make_writer
from quillcache.master.state import MasterState, SegmentRecord, pause_gc as _pause_gc
from quillcache.master.table import ObjectRecord
from quillcache.master.eviction import choose_victims
from quillcache.master.types import (
    MAX_KEY_CHARS, MasterConfig, MasterStats, ObjectInfo, ObjectStatus, PinKind, PutRequest, PutStartResult, ReplicaConfig,
    ReplicaDescriptor, SegmentDescriptor, TickReport, new_put_start_result, new_replica_descriptor,
)
from quillcache.master.validate import (check_config, check_key, check_put, check_put_fields, check_put_row,
                                        check_segment, key_error)

__all__ = ["MasterService"]


class _PutRun:
    """The new puts of a batch not yet recorded, as the columns of a PUT_START_MANY record."""

    __slots__ = ("first_put_id", "keys", "sizes", "allocs", "pins", "digests", "counts", "flat")

    def __init__(self, first_put_id: int) -> None:
        self.first_put_id = first_put_id
        self.keys: list[str] = []
        self.sizes: list[int] = []
        self.allocs: list[int] = []
        self.pins: list[int] = []
        self.digests: list[bytes | None] = []
        self.counts: list[int] = []
        self.flat: list[int] = []  # segment_id, offset, ... of every replica, in order

    def add_many(self, key: str, size: int, alloc: int, pin: int, digest: bytes | None,
                 reps: list[tuple[int, int]]) -> None:
        self.keys.append(key)
        self.sizes.append(size)
        self.allocs.append(alloc)
        self.pins.append(pin)
        self.digests.append(digest)
        self.counts.append(len(reps))
        for s, off in reps:
            self.flat.append(s)
            self.flat.append(off)

log = logging.getLogger(__name__)

_PENDING = int(ObjectStatus.PENDING)
_COMPLETE = int(ObjectStatus.COMPLETE)
_PIN_VALUES = frozenset(int(p) for p in PinKind)


class MasterService(ReplicatedMode):
    """The master (module docstring). Not thread-safe: callers serialise calls (the RPC layer does)."""

    fast_paths = True  # the compiled batch paths (_kernels); False runs their plain-Python references

    def __init__(self, config: MasterConfig | None = None, *, clock: Callable[[], float] = time.monotonic,
                 index: IndexBackend | None = None, data_dir: str | os.PathLike | None = None,
                 fs: FileSystem | None = None,
                 replicate: Callable[[list[tuple[int, bytes]]], None] | None = None,
                 dir_lock: DataDirLock | None = None) -> None:
        self.config = config = config if config is not None else MasterConfig()
        check_config(config)
        if not callable(clock):
            raise TypeError(f"clock must be callable, got {type(clock).__name__}")
        self._clock = clock
        self._fs = fs if fs is not None else RealFs()
        self.data_dir = os.fspath(data_dir) if data_dir is not None else None
        self._dir_lock: DataDirLock | None = None
        self._owns_dir_lock = False
        if self.data_dir is not None:
            if not self._fs.is_dir(self.data_dir):
                self._fs.mkdir(self.data_dir)
            if isinstance(self._fs, RealFs):  # (a simulated file system lives in this process only)
                if dir_lock is None:
                    self._dir_lock, self._owns_dir_lock = DataDirLock(self.data_dir), True
                elif dir_lock.covers(self.data_dir):
                    self._dir_lock = dir_lock
                else:
                    raise ValueError(f"dir_lock {dir_lock!r} is not a held lock of data dir {self.data_dir}")
        try:
            self._init_state(config, index, replicate)
        except BaseException:
            try:  # a failed start leaves no file open: the log and the index it opened are closed
                if getattr(self, "_log", None) is not None:
                    self._log.close()
                if getattr(self, "_owns_index", False) and getattr(self, "index", None) is not None:
                    self.index.close()
            finally:
                if self._owns_dir_lock:
                    self._dir_lock.release()
            raise

    def _init_state(self, config: MasterConfig, index: IndexBackend | None,
              replicate: Callable[[list[tuple[int, bytes]]], None] | None) -> None:
        """(``__init__``, the data dir locked) the index, the state, and the restart from the data dir."""
        self._owns_index = index is None
        if index is None:
            path = os.path.join(self.data_dir, "index") if self.data_dir is not None and config.index_on_disk else None
            opts = {"fs": self._fs} if config.index_kind == "art" and path is not None else {}
            index = open_index(config.index_kind, path, **opts)
        self.index = index
        self._projection = IndexProjection(index)
        self._state = MasterState(alignment=config.alignment_bytes, max_allocs=config.max_allocs_per_segment,
                                  index=self._projection, lease_ttl_s=config.lease_ttl_s)
        self._state._reclaim_s = float(config.zombie_reclaim_s)
        self._state.max_forgotten = config.max_forgotten_keys
        self._soft_ttl = float(config.soft_pin_ttl_s)
        self._log: OpLog | None = None
        self._call_recs: list[list] = []  # this call's records, applied, not yet in the log (_commit)
        self._call_payloads: list[bytes] = []  # each one's encoding (made before it was applied: _record)
        self._call_bytes = 0  # their total size (_record refuses a call past the WAL's record limit)
        self._call_lsn = 0
        self._failed: BaseException | None = None
        self._closed = False
        self._init_replicated(replicate)
        self._snap_writer = make_writer(config.snapshot_writer, self._fs)
        self._snap_inline_next = False
        self._sealed_changes = 0
        self.snapshots_taken = 0
        self.last_snapshot_outcome: SnapshotOutcome | None = None
        self.recovery_s = 0.0
        self.recovered_records = 0
        self.recovery_report: MasterRecoveryReport | None = None  # what restarting from the data dir found
        if self.data_dir is not None:
            self._recover()
        else:
            self._epoch = config.epoch or 1  # seen (state.epoch) with this master's first record
        self._last_snapshot_s = self._now()

    # ================================================================ recovery / snapshots
    def _recover(self) -> None:
        t0 = time.perf_counter()
        gc_was_enabled = gc.isenabled()
        gc.disable()  # recovery allocates many long-lived objects: no collection passes over them
        try:
            self._recover_state()
        finally:
            if gc_was_enabled:
                gc.enable()
        self.recovery_s = time.perf_counter() - t0

    def _recover_state(self) -> None:
        st = self._state
        now = self._now()
        self._log, self.recovered_records = recover(st, self._projection, self._fs, self.data_dir, now=now,
                                                    lease_ttl_s=self.config.lease_ttl_s)
        self.recovery_report = self._log.recovery_report
        want = self.config.epoch
        if want is not None and want < st.epoch:
            raise StaleEpochError(f"configured epoch {want} is older than epoch {st.epoch} found in "
                                  f"{self.data_dir}: a newer master has written this log")
        self._epoch = max(want or 1, st.epoch, 1)
        self.last_snapshot_lsn = st.lsn - self.recovered_records
        if self._epoch > st.epoch and not self._following:
            self._record([Op.EPOCH, self._epoch, now])
            self._commit()

    def snapshot(self) -> int:
        """Publish a snapshot now, written by the caller (after any snapshot in flight ends), and
        restart the log after it; returns the snapshot's bytes."""
        self._check_open()
        if self._log is None:
            raise InvalidParamsError("snapshot() needs a data_dir (this master keeps no log)")
        self._finish_background(wait=True)
        self._commit()
        try:
            self._prepare_index_for_snapshot()
            n = write_snapshot(self._fs, self.data_dir, self._state)
            self._log.rotate(self._state.lsn)
        except (OSError, WalError) as exc:
            self._failed = exc
            raise LogFailedError(f"snapshot of {self.data_dir} failed ({exc}); the master is read-only") from exc
        self._last_snapshot_s = self._now()
        self.last_snapshot_lsn = self._state.lsn
        self.snapshots_taken += 1
        return n

    def _prepare_index_for_snapshot(self) -> None:
        self._projection.flush()  # the index holds everything the snapshot covers
        if self._owns_index and self.config.index_on_disk and hasattr(self.index, "checkpoint"):
            self.index.checkpoint()  # its own log then holds no more than this master's log tail

    def _maybe_snapshot(self) -> None:
        oplog = self._log
        if oplog is None:
            return
        if self._snap_writer.busy:
            self._finish_background(wait=oplog.records_since_rotate >= self.config.snapshot_inflight_records)
            if self._snap_writer.busy:
                return
        if oplog.records_since_rotate == 0:
            return
        cfg = self.config
        if (oplog.records_since_rotate >= cfg.snapshot_due_changes(len(self._state.objects))
                or self._now() - self._last_snapshot_s >= cfg.snapshot_every_s):
            if self._snap_writer.background and not self._snap_inline_next:
                self._start_background()
            else:
                self._snap_inline_next = False
                self.snapshot()

    def _start_background(self) -> None:
        """Seal the log at the state's LSN and hand the snapshot to the writer (snapshot_writer's
        protocol); the sealed segments are deleted when it is published (``_finish_background``)."""
        self._commit()
        try:
            self._prepare_index_for_snapshot()
            self._sealed_changes = self._log.records_since_rotate
            self._log.seal()
        except (OSError, WalError) as exc:
            self._failed = exc
            raise LogFailedError(f"snapshot of {self.data_dir} failed ({exc}); the master is read-only") from exc
        try:
            self._snap_writer.start(self._fs, self.data_dir, self._state)
        except OSError as exc:  # e.g. fork refused for memory: the log holds everything; write the next one inline
            log.warning("master snapshot at lsn %d could not start in the background (%s); the next snapshot is "
                        "written inline", self._state.lsn, exc)
            self._log.records_since_rotate += self._sealed_changes
            self._snap_inline_next = True

    def _finish_background(self, *, wait: bool) -> None:
        """Take the outcome of the snapshot in flight (if it is known, or waiting for it): published →
        delete the sealed segments it covers; failed → nothing is lost (the log holds it all) and the
        next snapshot is taken inline, where a failure turns the master read-only."""
        writer = self._snap_writer
        if not writer.busy:
            return
        out = writer.wait() if wait else writer.poll()
        if out is None:
            return
        self.last_snapshot_outcome = out
        if not out.ok:
            log.warning("master snapshot at lsn %d in the background failed (%s); the log keeps every record, "
                        "the next snapshot is written inline", out.lsn, out.error)
            self._log.records_since_rotate += self._sealed_changes
            self._snap_inline_next = True
            return
        try:
            self._log.drop_through(out.lsn)
        except OSError as exc:  # not fatal: recovery deletes covered segments too
            log.warning("master snapshot at lsn %d: deleting the log segments it covers failed (%s)", out.lsn, exc)
        self._last_snapshot_s = self._now()
        self.last_snapshot_lsn = out.lsn
        self.snapshots_taken += 1

    @property
    def snapshot_in_flight(self) -> bool:
        """A snapshot is being written in the background and its outcome has not been taken yet."""
        return self._snap_writer.busy

    def wait_snapshot(self) -> SnapshotOutcome | None:
        """Wait for the snapshot in flight (if any) and take its outcome (``last_snapshot_outcome``)."""
        self._check_open()
        if self._log is not None and self._snap_writer.busy:
            self._finish_background(wait=True)
            return self.last_snapshot_outcome
        return None

    def close(self) -> None:
        """Commit, wait for a snapshot in flight, snapshot (if anything was logged since the last
        one), close the log and the index."""
        if self._closed:
            return
        try:
            if self._log is not None:
                self._finish_background(wait=True)
            if self._log is not None and self._failed is None and self._log.records_since_rotate:
                self.snapshot()
        finally:
            self._closed = True
            try:
                if self._log is not None:
                    try:
                        self._log.close()
                    except (OSError, WalError):
                        pass
                if self._owns_index:
                    self.index.close()
            finally:
                if self._owns_dir_lock:
                    self._dir_lock.release()  # another master may open the data dir from here on

    def __enter__(self) -> "MasterService":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _now(self) -> float:
        return float(self._clock())

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def lsn(self) -> int:
        return self._state.lsn

    @property
    def durable_lsn(self) -> int:
        """The last LSN fsynced (survives a power loss); ``lsn`` without a log. Below ``lsn`` only while the
        newest calls only started puts (``MasterConfig.sync_put_start``)."""
        return self._state.lsn if self._log is None else min(self._log.durable_lsn, self._state.lsn)

    def _check_writable(self) -> None:
        self._check_leading()
        if not self._state.space_attached:
            self._state.attach_space()
        if self._state.epoch > self._epoch:
            raise StaleEpochError(f"this master writes epoch {self._epoch} but epoch {self._state.epoch} was seen: "
                                  f"it has been deposed and may not change state")

    def _finish(self) -> None:
        self._commit()
        self._maybe_snapshot()

    def apply_record(self, payload: bytes, lsn: int | None = None) -> None:
        """Apply a record written by another master (a standby following the leader's log). The
        allocators are detached while following (records carry the placements) and rebuilt from
        the tables at this master's first own write."""
        if self._state.space_attached:
            self._state.detach_space()
        self._state.apply(decode_record(payload), lsn if lsn is not None else self._state.lsn + 1)
        self._projection.publish()

    def observe_epoch(self, epoch: int) -> None:
        """A newer epoch exists (e.g. told by the election): from now on this master may not write."""
        self._state.epoch = max(self._state.epoch, int(epoch))

    def _check_client(self, client_id: str | None) -> None:
        if client_id is not None and client_id not in self._state.clients:
            raise NeedRemountError(f"client {client_id!r} is not registered (expired or never mounted): "
                                   f"mount its segments again")

    def _descriptors(self, obj: ObjectRecord) -> tuple[ReplicaDescriptor, ...]:
        segs = self._state.segments
        out = []
        for s, off in obj.replicas:
            d = segs[s].desc
            out.append(ReplicaDescriptor(d.node_id, s, d.endpoint, d.transport, d.region_ids[0] if d.region_ids else 0,
                                         off, obj.size_bytes))
        return tuple(out)

    # ================================================================ segments and clients
    def mount_segment(self, segment: SegmentDescriptor) -> None:
        """Add a segment (and register its node as a live client)."""
        self._check_writable()
        d = segment
        tier = check_segment(d, self.config.alignment_bytes)
        if d.segment_id in self._state.segments:
            raise SegmentExistsError(f"segment {d.segment_id} is already mounted "
                                     f"(by {self._state.segments[d.segment_id].desc.node_id!r})")
        self._record([Op.MOUNT, self._epoch, self._now(), d.node_id, d.segment_id, d.capacity_bytes, d.endpoint,
                      d.transport, list(d.region_ids), tier])
        self._finish()

    def unmount_segment(self, segment_id: int, *, client_id: str | None = None) -> None:
        """Remove a segment: its replicas are dropped; objects left without a replica are removed."""
        self._check_writable()
        self._check_client(client_id)
        seg = self._state.segments.get(segment_id) if isinstance(segment_id, int) else None
        if seg is None:
            raise SegmentNotFoundError(f"segment {segment_id!r} is not mounted")
        if client_id is not None and seg.desc.node_id != client_id:
            raise InvalidParamsError(f"segment {segment_id} belongs to {seg.desc.node_id!r}, not to {client_id!r}")
        self._record([Op.UNMOUNT, self._epoch, self._now(), segment_id])
        self._finish()

    def heartbeat(self, client_id: str) -> None:
        """A client's ping; NEED_REMOUNT if it is unknown or was expired (it must mount again)."""
        if client_id not in self._state.clients:
            raise NeedRemountError(f"client {client_id!r} is not registered (expired or never mounted): "
                                   f"mount its segments again")
        self._state.last_seen[client_id] = self._now()

    # ================================================================ puts
    def put_start(self, key: str, size_bytes: int, config: ReplicaConfig | None = None, *,
                  pin: PinKind = PinKind.NONE, digest: bytes | None = None,
                  client_id: str | None = None) -> PutStartResult:
        """Allocate replicas for a new object (module docstring); raises a :class:`MasterError`."""
        out = self.batch_put_start([PutRequest(key=key, size_bytes=size_bytes, config=config or ReplicaConfig(),
                                               pin=pin, digest=digest)], client_id=client_id)[0]
        if isinstance(out, MasterError):
            raise out
        return out

    def batch_put_start(self, requests: Sequence[PutRequest], *,
                        client_id: str | None = None) -> list[PutStartResult | MasterError]:
        """Per request: its :class:`PutStartResult` or MasterError (``batch_put_start_compact``'s core)."""
        max_bytes = self.config.max_object_bytes

        def fields(req: PutRequest) -> tuple:
            if type(req) is PutRequest and type(req.config) is ReplicaConfig:
                cfg = req.config
                return check_put_fields(req.key, req.size_bytes, cfg.replica_num, cfg.preferred_segment, req.pin,
                                        req.digest, max_bytes)
            if not isinstance(req, PutRequest):
                raise InvalidParamsError(f"batch_put_start takes PutRequest items, got {type(req).__name__}")
            return check_put(req, max_bytes)

        rows, used = self._put_rows(requests, client_id, fields)
        segs = self._state.segments
        where = {}
        for s in used:
            d = segs[s].desc
            where[s] = (d.node_id, d.endpoint, d.transport, d.region_ids[0] if d.region_ids else 0)
        out: list = []
        add = out.append
        rd, psr = new_replica_descriptor, new_put_start_result
        for row in rows:
            if type(row) is not list:
                add(row)
                continue
            if len(row) == 5:
                pid, existing, size, s, off = row
                node, endpoint, transport, region = where[s]
                add(psr((rd(node, s, endpoint, transport, region, off, size),), pid, existing))
                continue
            size = row[2]
            descs = []
            for i in range(3, len(row), 2):
                s = row[i]
                node, endpoint, transport, region = where[s]
                descs.append(rd(node, s, endpoint, transport, region, row[i + 1], size))
            add(psr(tuple(descs), row[0], row[1]))
        return out

    def batch_put_start_compact(self, rows: Sequence[Sequence], *,
                                client_id: str | None = None) -> tuple[list[list], list[list | MasterError]]:
        """``batch_put_start`` in the compact form of the RPC's hot path (no per-object boundary
        objects): each request is a row ``[key, size_bytes, replica_num, preferred_segment, pin,
        digest]``; returns ``(segments, results)``, ``results[i]`` = ``[put_id, existing, size_bytes,
        segment_id, offset_bytes, ...]`` (one pair per replica) or the request's MasterError, and
        ``segments`` = ``[segment_id, node_id, endpoint, transport, region_id]`` of every segment the
        results name. Same checks, placement, records and errors as ``batch_put_start``
        (:func:`quillcache.master.wire.expand_put_results` rebuilds its results exactly)."""
        max_bytes = self.config.max_object_bytes

        def fields(row: Sequence) -> tuple:
            if type(row) is list and len(row) == 6:
                return check_put_fields(*row, max_bytes)
            return check_put_row(row, max_bytes)

        results, used = self._put_rows(rows, client_id, fields)
        return self._segment_rows(used), results

    def batch_put_start_columns(self, keys: Sequence[str], sizes: Sequence[int], *, replica_num: int = 1,
                                preferred_segment: int | None = None, pin: PinKind | int = PinKind.NONE,
                                digests: Sequence[bytes | None] | None = None,
                                client_id: str | None = None) -> PutColumns:
        """``batch_put_start`` of ``PutRequest(keys[i], sizes[i], ReplicaConfig(replica_num,
        preferred_segment), pin, digests[i])`` for every i, answered as :class:`PutColumns` (one array
        per field; ``to_list()`` equals ``batch_put_start``'s value). Same checks, placement, records
        and errors (tested); a length mismatch is INVALID_PARAMS for the whole call."""
        keys, sizes, digests = self._columns_args(keys, sizes, digests)
        if self.fast_paths and replica_num == 1 and type(replica_num) is int and preferred_segment is None \
                and len(keys) > 1 and digests.count(None) == len(keys) and type(pin) in (int, PinKind) \
                and pin in _PIN_VALUES:
            out = self._put_columns_fast(keys, sizes, int(pin), client_id)
            if out is not None:
                return out
        rows = [[k, s, replica_num, preferred_segment, pin, d] for k, s, d in zip(keys, sizes, digests)]
        segments, results = self.batch_put_start_compact(rows, client_id=client_id)
        return columns_from_rows(segments, results, put=True)

    def _put_columns_fast(self, keys: list, sizes: list, pin: int, client_id: str | None) -> PutColumns | None:
        """``batch_put_start_columns`` of new, distinct, valid keys with one replica each and no
        preferred segment or digest, when every put fits on the segment the placement rule picks:
        checks (``check_new_puts``), placement (``place_most_free``) and allocation
        (``OffsetAllocator.allocate_batch`` per segment, all-or-nothing) over whole arrays, then the
        same PUT_START_MANY record the reference writes. None, with nothing changed, when any of
        that does not hold: the caller then runs the reference, which decides key by key."""
        self._check_writable()
        self._check_client(client_id)
        st = self._state
        cfg = self.config
        allocs = check_new_puts(keys, sizes, MAX_KEY_CHARS, cfg.max_object_bytes, cfg.alignment_bytes)
        table = st.objects
        if allocs is None or not (all_new(keys, table._objs) if not table._rows else
                                  len(set(keys)) == len(keys) and not table.present_among(keys)):
            return None
        segs = st.segments
        if not segs or any(seg.alloc is None for seg in segs.values()):
            return None
        sids = np.fromiter(segs.keys(), dtype=np.int64, count=len(segs))
        frees = np.fromiter((seg.free_bytes for seg in segs.values()), dtype=np.int64, count=len(segs))
        choice, _ = place_most_free(allocs, sids, frees)
        if choice is None:
            return None
        n = len(keys)
        offsets = np.empty(n, dtype=np.int64)
        done: list[tuple] = []  # (segment, handles) allocated so far
        order = np.argsort(choice, kind="stable")
        bounds = np.flatnonzero(np.diff(choice[order])) + 1
        for part in np.split(order, bounds):
            seg = segs[int(sids[choice[part[0]]])]
            try:
                offs, handles = seg.alloc.allocate_batch(allocs[part])
            except OutOfSpaceError:
                for seg_done, hs in reversed(done):
                    seg_done.alloc.free_batch(hs[::-1])
                return None
            done.append((seg, handles))
            offsets[part] = offs
            seg.handles.fresh.put_batch(offs, handles)
        seg_col = sids[choice]
        now = self._now()
        first = st.next_put_id
        flat = np.empty(2 * n, dtype=np.int64)
        flat[0::2] = seg_col
        flat[1::2] = offsets
        gc_on = _pause_gc(n)
        try:
            st.checked_new_keys = keys  # checked above (all_new): the state need not look them up again
            try:
                self._record([Op.PUT_START_MANY, self._epoch, now, self._soft_ttl, first, keys, sizes,
                              allocs.tolist(), [pin] * n, [None] * n, [1] * n, flat.tolist()])
            except RecordEncodeError:  # a key the kernel let through (not valid UTF-8): nothing was applied;
                self._undo_unapplied(keys[0], first, flat.tolist())  # the reference refuses it key by key
                return None
            except BaseException:
                self._undo_unapplied(keys[0], first, flat.tolist())
                raise
            finally:
                st.checked_new_keys = None
        finally:
            if gc_on:
                gc.enable()
            if self._failed is None:
                self._finish()
        used = sids[np.flatnonzero(np.bincount(choice))].tolist()
        return PutColumns(np.ones(n, dtype=np.uint8), seg_col.astype(np.uint32), offsets,
                          np.asarray(sizes, dtype=np.int64), {},
                          {row[0]: (row[1], row[2], row[3], row[4]) for row in self._segment_rows(set(used))},
                          np.arange(first, first + n, dtype=np.int64), np.zeros(n, dtype=bool))

    @staticmethod
    def _columns_args(keys, sizes, digests) -> tuple[list, list, Sequence]:
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise InvalidParamsError(f"keys must be a sequence of str, got {type(keys).__name__}")
        if isinstance(sizes, np.ndarray):
            if sizes.dtype.kind not in "iu" or sizes.ndim != 1:
                raise InvalidParamsError(f"sizes must be a 1-d integer array, got {sizes.dtype} with shape {sizes.shape}")
            sizes = sizes.tolist()
        elif isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
            raise InvalidParamsError(f"sizes must be a sequence of int, got {type(sizes).__name__}")
        if len(sizes) != len(keys):
            raise InvalidParamsError(f"{len(keys)} keys but {len(sizes)} sizes")
        if digests is None:
            digests = [None] * len(keys)
        elif isinstance(digests, (str, bytes)) or not isinstance(digests, Sequence) or len(digests) != len(keys):
            raise InvalidParamsError(f"digests must be None or a sequence of one digest (or None) per key "
                                     f"({len(keys)} keys)")
        return list(keys), list(sizes), digests

    def batch_put_start_returning(self, requests: Sequence[PutRequest], *,
                                  client_id: str | None = None) -> list[PutStartResult | MasterError]:
        """``batch_put_start`` of copies coming back from outside the pool (a node's SSD tier re-announcing its
        records): per request, ``StaleObjectError`` when the pool no longer holds the key and its last word on it
        says this copy is older (removed since, or its last object had other bytes: ``MasterState.returning_refusal``),
        else what ``batch_put_start`` answers (a key the pool holds is decided there: existing with the same digest,
        OBJECT_ALREADY_EXISTS otherwise). Checked and started in one call, under the same lock as every other call,
        so no remove or put can fall between the check and the start."""
        self._check_writable()
        st = self._state
        refused: dict[int, MasterError] = {}
        for i, req in enumerate(requests):
            key = getattr(req, "key", None)
            if isinstance(req, PutRequest) and isinstance(key, str) and key not in st.objects:
                why = st.returning_refusal(key, req.digest)
                if why is not None:
                    refused[i] = StaleObjectError(f"put of {key!r} from outside the pool refused: {why}")
        if not refused:
            return self.batch_put_start(requests, client_id=client_id)
        rest = [r for i, r in enumerate(requests) if i not in refused]
        started = iter(self.batch_put_start(rest, client_id=client_id) if rest else ())
        return [refused[i] if i in refused else next(started) for i in range(len(requests))]

    def _put_rows(self, items: Sequence, client_id: str | None, fields: Callable) -> tuple[list, set[int]]:
        """The core of every put_start form: per item (``fields(item)`` = its checked
        ``(key, size, replica_num, preferred, pin, digest)``) the compact result row ``[put_id,
        existing, size_bytes, segment_id, offset_bytes, ...]`` or its MasterError, in order, each item
        decided as if the ones before it were done; and the segment ids the rows name.

        Same key again (in the table, or earlier in this batch): a COMPLETE object, or a PENDING one
        younger than ``zombie_preempt_s``, with the same digest is returned (existing); otherwise
        OBJECT_ALREADY_EXISTS; an older PENDING one is pre-empted. A new put is placed by one
        :class:`BatchPlacer` for the whole batch; when nothing fits, the puts so far are recorded,
        eviction runs and the put is placed once more (else NO_SPACE); a put larger than every
        segment's capacity evicts nothing (NO_SPACE at once). The new puts go into ONE
        record (PUT_START_MANY; PUT_START for one), or one per run between evictions."""
        self._check_writable()
        self._check_client(client_id)
        now = self._now()
        st = self._state
        cfg = self.config
        unit = cfg.alignment_bytes
        preempt_s = cfg.zombie_preempt_s
        objects_get = st.objects.getter()
        placer = BatchPlacer(st.segments)
        place_one, place = placer.place_one, placer.place
        run = _PutRun(st.next_put_id)
        run_keys = run.keys
        new: dict[str, tuple[list, bytes | None]] = {}  # key -> (row, digest) of this batch's new puts
        used: set[int] = set()
        out: list = []
        add = out.append
        gc_on = _pause_gc(len(items))
        try:
            for item in items:
                try:
                    key, size, n, preferred, pin, digest = fields(item)
                    seen = new.get(key)
                    if seen is not None:  # started earlier in this batch: PENDING, 0 s old
                        if digest is not None and seen[1] == digest:
                            row = seen[0][:]
                            row[1] = True
                            add(row)
                            continue
                        raise ObjectExistsError(f"object {key!r} is being written (put {seen[0][0]} started "
                                                f"{0.0:.3f} s ago; pre-emptible after {preempt_s} s)")
                    obj = objects_get(key)
                    if obj is not None:
                        row = self._existing(obj, key, digest, now)
                        if row is not None:
                            used.update(row[3::2])
                            add(row)
                            continue
                    alloc = -(-size // unit) * unit
                    placed = place_one(alloc) if n == 1 and preferred is None else None
                    if placed is not None:
                        s, off = placed
                        row = [run.first_put_id + len(run_keys), False, size, s, off]
                        used.add(s)
                        run_keys.append(key)
                        run.sizes.append(size)
                        run.allocs.append(alloc)
                        run.pins.append(pin)
                        run.digests.append(digest)
                        run.counts.append(1)
                        run.flat += (s, off)
                    else:
                        reps = place(alloc, n, preferred)
                        if not reps and st.segments and alloc <= max(g.capacity_bytes for g in st.segments.values()):
                            self._record_run(run, now)  # (eviction runs only when it could make room for it)
                            run = _PutRun(st.next_put_id)
                            run_keys = run.keys
                            self._evict(now, self._evict_target())
                            placer.reset()
                            reps = place(alloc, n, preferred)
                        if not reps:
                            raise self._no_space(key, size, alloc)
                        row = [run.first_put_id + len(run_keys), False, size]
                        for s, off in reps:
                            row.append(s)
                            row.append(off)
                            used.add(s)
                        run.add_many(key, size, alloc, pin, digest, reps)
                    new[key] = (row, digest)
                    add(row)
                except (LogFailedError, StaleEpochError, RecordEncodeError):  # (the latter: the run's puts so far
                    raise                                                    # were not recorded: the call fails)
                except MasterError as exc:
                    add(exc)
        finally:
            try:
                self._record_run(run, now)
            finally:
                if gc_on:
                    gc.enable()
                if self._failed is None:
                    self._finish()
        return out, used

    def _segment_rows(self, seg_ids: set[int]) -> list[list]:
        segs = self._state.segments
        rows = []
        for s in sorted(seg_ids):
            d = segs[s].desc
            rows.append([s, d.node_id, d.endpoint, d.transport, d.region_ids[0] if d.region_ids else 0])
        return rows

    def _existing(self, obj: ObjectRecord, key: str, digest: bytes | None, now: float) -> list | None:
        """A put_start of a key the table holds: the existing object's row (same digest), None when
        the old put is a zombie to pre-empt, or ObjectExistsError."""
        same = digest is not None and obj.digest == digest
        if obj.status == _COMPLETE:
            if not same:
                raise ObjectExistsError(f"object {key!r} already exists (complete; "
                                        f"{'no digest given' if digest is None else 'a different digest'})")
        elif now - obj.started_s < self.config.zombie_preempt_s:
            if not same:
                raise ObjectExistsError(f"object {key!r} is being written (put {obj.put_id} started "
                                        f"{now - obj.started_s:.3f} s ago; pre-emptible after "
                                        f"{self.config.zombie_preempt_s} s)")
        else:
            return None
        row = [obj.put_id, True, obj.size_bytes]
        for s, off in obj.replicas:
            row.append(s)
            row.append(off)
        return row

    def _no_space(self, key: str, size: int, alloc: int) -> NoSpaceError:
        st = self._state
        if not st.segments:
            return NoSpaceError(f"put_start({key!r}, {size} bytes): no segment is mounted")
        biggest = max(s.capacity_bytes for s in st.segments.values())
        why = (f"larger than every segment (largest {biggest} bytes)" if alloc > biggest
               else f"no segment has {alloc} free bytes after eviction "
                    f"(used {st.used_bytes} of {st.capacity_bytes} bytes)")
        return NoSpaceError(f"put_start({key!r}, {size} bytes): {why}")

    def _record_run(self, run: "_PutRun", now: float) -> None:
        """Record (and so apply) the puts placed so far: PUT_START for one, PUT_START_MANY for several.
        If that fails before the record was applied, their ranges go back to the allocators."""
        if not run.keys:
            return
        try:
            if len(run.keys) == 1:
                self._record([Op.PUT_START, self._epoch, now, run.keys[0], run.sizes[0], run.allocs[0], run.pins[0],
                              self._soft_ttl, run.digests[0], run.first_put_id,
                              [[run.flat[i], run.flat[i + 1]] for i in range(0, len(run.flat), 2)]])
            else:
                self._record([Op.PUT_START_MANY, self._epoch, now, self._soft_ttl, run.first_put_id, run.keys,
                              run.sizes, run.allocs, run.pins, run.digests, run.counts, run.flat])
        except BaseException:
            self._undo_unapplied(run.keys[0], run.first_put_id, run.flat)
            raise
        finally:
            run.keys = []

    def _undo_unapplied(self, first_key: str, first_put_id: int, flat: list[int]) -> None:
        """A PUT_START(_MANY) record failed: if it was not applied (its first key is not that put),
        give its ranges (``flat`` = segment, offset, ...) back to the allocators."""
        st = self._state
        obj = st.objects.get(first_key)
        if obj is not None and obj.put_id == first_put_id:
            return
        for i in range(0, len(flat), 2):
            s, o = flat[i], flat[i + 1]
            if s in st.segments and o in st.segments[s].handles:
                st.undo_allocate(s, o)

    def _pending(self, key: object, put_id: int | None, what: str) -> ObjectRecord:
        key = check_key(key)
        obj = self._state.objects.get(key)
        if obj is None:
            raise ObjectNotFoundError(f"{what}({key!r}): no such object")
        if put_id is not None and obj.put_id != put_id:
            raise ObjectNotFoundError(f"{what}({key!r}): put {put_id} is not the key's current put "
                                      f"({obj.put_id}); it was pre-empted or reclaimed")
        return obj

    def put_end(self, key: str, *, put_id: int | None = None) -> None:
        """Mark the object COMPLETE (readable, immutable)."""
        out = self.batch_put_end([key], put_ids=None if put_id is None else [put_id])[0]
        if isinstance(out, MasterError):
            raise out

    def batch_put_end(self, keys: Sequence[str], *, put_ids: Sequence[int | None] | None = None) -> list[None | MasterError]:
        """Per key: None (now COMPLETE) or its MasterError. Every key is checked in order as if the ones
        before it were already ended; the ended keys go into ONE record (PUT_END_MANY, or PUT_END for one)."""
        self._check_writable()
        if put_ids is not None and len(put_ids) != len(keys):
            raise InvalidParamsError(f"{len(keys)} keys but {len(put_ids)} put_ids")
        now = self._now()
        out: list = []
        ended: list[str] = []
        done: set[str] = set()
        pending = self._pending
        get = self._state.objects.getter()
        gc_on = _pause_gc(len(keys))
        start = 0
        if put_ids is None and self.fast_paths and type(keys) is list:
            table = self._state.objects
            start = end_prefix(keys, table._objs, table.get if table._rows else None, _PENDING, done, ended, out)
        try:
            for i in range(start, len(keys)):
                key = keys[i]
                if put_ids is None and type(key) is str and key not in done:  # the common case, checked at once
                    obj = get(key)
                    if obj is not None and obj.status == _PENDING:
                        done.add(key)
                        ended.append(key)
                        out.append(None)
                        continue
                try:
                    obj = pending(key, None if put_ids is None else put_ids[i], "put_end")
                    if obj.status == _COMPLETE or key in done:
                        raise ObjectExistsError(f"put_end({key!r}): the object is already complete")
                except MasterError as exc:
                    out.append(exc)
                    continue
                done.add(key)
                ended.append(key)
                out.append(None)
            if len(ended) == 1:
                self._record([Op.PUT_END, self._epoch, now, ended[0]])
            elif ended:
                self._record([Op.PUT_END_MANY, self._epoch, now, ended])
        finally:
            if gc_on:
                gc.enable()
            if self._failed is None:
                self._finish()
        return out

    def put_revoke(self, key: str, *, put_id: int | None = None) -> None:
        """Cancel an in-flight put (its space is freed at once)."""
        out = self.batch_put_revoke([key], put_ids=None if put_id is None else [put_id])[0]
        if isinstance(out, MasterError):
            raise out

    def batch_put_revoke(self, keys: Sequence[str], *,
                         put_ids: Sequence[int | None] | None = None) -> list[None | MasterError]:
        return self._batch(keys, put_ids, self._put_revoke_one)

    def _put_revoke_one(self, key: str, put_id: int | None, now: float) -> None:
        obj = self._pending(key, put_id, "put_revoke")
        if obj.status == _COMPLETE:
            raise InvalidParamsError(f"put_revoke({key!r}): the object is complete; revoke cancels only an "
                                     f"in-flight put (use remove)")
        self._record([Op.PUT_REVOKE, self._epoch, now, key])

    def _batch(self, keys: Sequence, extra: Sequence | None, one: Callable) -> list:
        self._check_writable()
        if extra is not None and len(extra) != len(keys):
            raise InvalidParamsError(f"{len(keys)} keys but {len(extra)} put_ids")
        now = self._now()
        out: list = []
        gc_on = _pause_gc(len(keys))
        try:
            for i, key in enumerate(keys):
                try:
                    out.append(one(key, None if extra is None else extra[i], now))
                except (LogFailedError, StaleEpochError):
                    raise
                except MasterError as exc:
                    out.append(exc)
        finally:
            if gc_on:
                gc.enable()
            if self._failed is None:
                self._finish()
        return out

    # ================================================================ reads
    def get_replicas(self, keys: Sequence[str]) -> list[tuple[ReplicaDescriptor, ...] | MasterError]:
        """Per key: its replicas (granting a read lease) or OBJECT_NOT_FOUND / OBJECT_NOT_READY."""
        descriptors = self._descriptors
        return [obj if isinstance(obj, MasterError) else descriptors(obj) for obj in self._read(keys)]

    def get_replica_list(self, key: str) -> tuple[ReplicaDescriptor, ...]:
        out = self.get_replicas([key])[0]
        if isinstance(out, MasterError):
            raise out
        return out

    def get_replicas_compact(self, keys: Sequence[str]) -> tuple[list[list], list[list | MasterError]]:
        """``get_replicas`` in the compact form of the RPC's hot path: ``(segments, rows)``, ``rows[i]``
        = ``[size_bytes, segment_id, offset_bytes, ...]`` (one pair per replica) or the key's
        MasterError, ``segments`` = ``[segment_id, node_id, endpoint, transport, region_id]`` of every
        segment the rows name. Same leases and errors as ``get_replicas``
        (:func:`quillcache.master.wire.expand_replicas` rebuilds its descriptors exactly)."""
        rows: list = []
        segs: set[int] = set()
        for obj in self._read(keys):
            if isinstance(obj, MasterError):
                rows.append(obj)
                continue
            row = [obj.size_bytes]
            for s, off in obj.replicas:
                row.append(s)
                row.append(off)
                segs.add(s)
            rows.append(row)
        return self._segment_rows(segs), rows

    def get_replicas_columns(self, keys: Sequence[str]) -> ReplicaColumns:
        """``get_replicas(keys)`` answered as :class:`ReplicaColumns` (``to_list()`` equals its value);
        same leases and errors."""
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise InvalidParamsError(f"keys must be a sequence of str, got {type(keys).__name__}")
        self._check_readable()
        if not self.fast_paths:
            segments, rows = self.get_replicas_compact(keys)
            return columns_from_rows(segments, rows, put=False)
        now = self._now()
        table = self._state.objects
        counts, seg_ids, offsets, sizes, failures, used = read_columns(
            keys, table._objs, table.get if table._rows else None, now, now + self.config.lease_ttl_s, _COMPLETE)
        errors: dict[int, MasterError] = {}
        for i, kind, put_id in failures:
            key = keys[i]
            errors[i] = (key_error(key) if kind == READ_BAD_KEY else
                         ObjectNotFoundError(f"get_replicas({key!r}): no such object") if kind == READ_NOT_FOUND else
                         ObjectNotReadyError(f"get_replicas({key!r}): put {put_id} has not ended"))
        where = {row[0]: (row[1], row[2], row[3], row[4]) for row in self._segment_rows(used)}
        return ReplicaColumns(counts, seg_ids, offsets, sizes, errors, where)

    def get_replica_list_compact(self, key: str) -> tuple[list[list], list]:
        """``get_replica_list`` in the compact form: ``(segments, row)`` (see ``get_replicas_compact``)."""
        segs, rows = self.get_replicas_compact([key])
        if isinstance(rows[0], MasterError):
            raise rows[0]
        return segs, rows[0]

    def _read(self, keys: Sequence[str]) -> list[ObjectRecord | MasterError]:
        """The COMPLETE objects of ``keys`` (each leased and accessed now) or each key's error."""
        self._check_readable()
        now = self._now()
        lease_end = now + self.config.lease_ttl_s
        objects = self._state.objects
        out: list = []
        for key in keys:
            obj = objects.get(key) if isinstance(key, str) else None
            if obj is None:
                out.append(ObjectNotFoundError(f"get_replicas({key!r}): no such object") if isinstance(key, str)
                           else key_error(key))
            elif obj.status != _COMPLETE:
                out.append(ObjectNotReadyError(f"get_replicas({key!r}): put {obj.put_id} has not ended"))
            else:
                if lease_end > obj.lease_end_s:
                    obj.lease_end_s = lease_end
                obj.last_access_s = now
                out.append(obj)
        return out

    def exists(self, keys: Sequence[str]) -> list[bool | MasterError]:
        """Per key: is it COMPLETE? Touches no lease and no access time."""
        self._check_readable()
        objects = self._state.objects
        out: list = []
        for key in keys:
            if not isinstance(key, str):
                out.append(key_error(key))
                continue
            obj = objects.get(key)
            out.append(obj is not None and obj.status == _COMPLETE)
        return out

    def exist_key(self, key: str) -> bool:
        out = self.exists([key])[0]
        if isinstance(out, MasterError):
            raise out
        return out

    # ================================================================ remove / evict
    def remove(self, key: str, *, force: bool = False) -> None:
        out = self.batch_remove([key], force=force)[0]
        if isinstance(out, MasterError):
            raise out

    def batch_remove(self, keys: Sequence[str], *, force: bool = False) -> list[None | MasterError]:
        return self._batch(keys, None, lambda k, _, now: self._remove_one(k, force, now))

    def _remove_one(self, key: str, force: bool, now: float) -> None:
        key = check_key(key)
        obj = self._state.objects.get(key)
        if obj is None:
            raise ObjectNotFoundError(f"remove({key!r}): no such object")
        if obj.status != _COMPLETE:
            raise ObjectNotReadyError(f"remove({key!r}): put {obj.put_id} is in flight (revoke it instead)")
        if not force and now < obj.lease_end_s:
            raise LeaseHeldError(f"remove({key!r}): a read lease is held until t={obj.lease_end_s:.3f} "
                                 f"(now {now:.3f}); pass force=True to remove anyway")
        self._record([Op.REMOVE, self._epoch, now, key])

    def _evict_target(self) -> int:
        return math.ceil(self.config.evict_fraction * self._state.capacity_bytes)

    def _evict(self, now: float, target_bytes: int) -> list[str]:
        chosen = choose_victims(self._state.objects.values(), now, target_bytes)
        if chosen:
            self._record([Op.EVICT, self._epoch, now, chosen])
        return chosen

    def evict(self, target_bytes: int | None = None) -> list[str]:
        """Run eviction now (default target: ``evict_fraction`` of capacity); returns the evicted keys."""
        self._check_writable()
        now = self._now()
        try:
            return self._evict(now, self._evict_target() if target_bytes is None else int(target_bytes))
        finally:
            if self._failed is None:
                self._finish()

    # ================================================================ timers
    def tick(self) -> TickReport:
        """Run the timers: client expiry, zombie reclaim, watermark eviction (in that order)."""
        self._check_writable()
        now = self._now()
        st, cfg = self._state, self.config
        expired = sorted(c for c in st.clients if now - st.last_seen.get(c, now) > cfg.client_ttl_s)
        reclaimed: list[str] = []
        reclaimed_bytes = 0
        evicted: list[str] = []
        try:
            for node in expired:
                self._record([Op.EXPIRE, self._epoch, now, node])
            due = [d for d in st.discarded if d[0] <= now]
            stale = [o for o in (st.objects[k] for k in sorted(st.pending))
                     if o.started_s + cfg.zombie_reclaim_s <= now]
            if due or stale:
                reclaimed = sorted(o.key for o in stale)
                reclaimed_bytes = sum(d[3] for d in due) + sum(o.alloc_bytes * len(o.replicas) for o in stale)
                self._record([Op.RECLAIM_LISTED, self._epoch, now, reclaimed, [[d[1], d[2]] for d in due]])
            if st.capacity_bytes and st.used_bytes > cfg.high_watermark * st.capacity_bytes:
                evicted = self._evict(now, self._evict_target())
        finally:
            if self._failed is None:
                self._finish()
        return TickReport(tuple(expired), tuple(reclaimed), reclaimed_bytes, tuple(evicted))

    # ================================================================ introspection
    def object_info(self, key: str) -> ObjectInfo:
        self._check_readable()
        key = check_key(key)
        obj = self._state.objects.get(key)
        if obj is None:
            raise ObjectNotFoundError(f"object_info({key!r}): no such object")
        return ObjectInfo(obj.key, obj.size_bytes, ObjectStatus(obj.status), self._descriptors(obj), obj.put_id,
                          obj.lease_end_s, obj.last_access_s, PinKind(obj.pin), obj.soft_pin_end_s, obj.digest)

    def keys(self) -> list[str]:
        return list(self._state.objects)

    def segments(self) -> list[SegmentDescriptor]:
        return [s.desc for s in self._state.segments.values()]

    def segment_usage(self, segment_id: int) -> tuple[int, int]:
        """``(used_bytes, capacity_bytes)`` of a mounted segment."""
        seg: SegmentRecord | None = self._state.segments.get(segment_id)
        if seg is None:
            raise SegmentNotFoundError(f"segment {segment_id!r} is not mounted")
        return seg.used_bytes, seg.capacity_bytes

    def clients(self) -> list[str]:
        return sorted(self._state.clients)

    def stats(self) -> MasterStats:
        st = self._state
        pending = len(st.pending)
        return MasterStats(len(st.objects), pending, len(st.segments), len(st.clients), st.capacity_bytes,
                           st.used_bytes, st.lsn, self._epoch)

    def publish_index(self) -> None:
        """Write the residency rows that ``MasterConfig.defer_index_publish`` left queued into the index
        (nothing when none are)."""
        if self._projection.pending() and not self._closed:
            self._projection.publish()

    def check_invariants(self) -> None:
        self._state.check_invariants()  # tests
