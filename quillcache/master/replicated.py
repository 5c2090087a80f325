"""Replicated mode of :class:`~quillcache.master.MasterService` (HA; used by :mod:`quillcache.master.ha`).

Contract:
- ``MasterService(..., replicate=fn)`` starts as a *follower*: every state change is refused with
  NOT_LEADER, and ``follow(records)`` applies the leader's committed records ``[(lsn, payload), ...]`` in
  LSN order, appending each to the local log too (one fsync per call; snapshots on the usual cadence), so
  the data dir stays a copy that restarts on its own.
- ``promote(epoch)`` makes it the writer of ``epoch`` (not older than any record applied): soft state as
  after a restart (complete objects leased for one lease TTL, clients counted seen now), allocators rebuilt,
  an EPOCH record committed. From then on each commit hands that call's records to ``fn(records)`` BEFORE
  the local log gets them: ``fn`` returns once they are durable in the replicated log, or raises (e.g.
  STALE_EPOCH when fenced). The local log therefore never holds a record the replicated log lacks. A
  raising ``fn`` turns the service failed: its memory holds records nobody committed, and its owner
  reopens it from the data dir. ``demote()`` returns a healthy leader to following.
- ``snapshot_bytes()`` is the state as a snapshot document (``master.snap``'s format and LSN), for a
  follower too far behind the replicated log; ``snapshot()`` is allowed in every mode (it changes no state).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from quillcache.durability import wal as _wal
from quillcache.durability.wal import WalError, WalIOError
from quillcache.master.errors import (InvalidParamsError, LogFailedError, MasterError, NotLeaderError,
                                     RecordEncodeError, StaleEpochError)
from quillcache.master.oplog import Op, decode_record, encode_record, join_encoded, num_changes
from quillcache.master.snapshot import encode_state
from quillcache.master.types import ObjectStatus

__all__ = ["ReplicatedMode"]

_COMPLETE = int(ObjectStatus.COMPLETE)
_PUT_START_OPS = frozenset((int(Op.PUT_START), int(Op.PUT_START_MANY)))  # written, fsynced by the next call
_BATCH_HEADROOM = 64  # bytes a BATCH record adds to its records' payloads (join_encoded: about 30)


class ReplicatedMode:
    """Mixed into ``MasterService``: uses its tables, log and projection (module docstring); also the
    log plumbing of every mode (``_record``, ``_commit``)."""

    def _init_replicated(self, replicate: Callable[[list[tuple[int, bytes]]], None] | None) -> None:
        self._replicate = replicate
        self._unreplicated: list[tuple[int, bytes]] = []  # this call's records, not yet replicated
        self._unreplicated_changes = 0  # state changes in them beyond one per record (BATCH records)
        self._following = replicate is not None
        self.last_snapshot_lsn = 0  # the LSN the last local snapshot covers

    @property
    def failed(self) -> BaseException | None:
        """Why the service turned read-only (a log or replication failure), or None."""
        return self._failed

    @property
    def log_epoch(self) -> int:
        """The newest epoch among the records applied (a follower's view of the leader's epoch)."""
        return self._state.epoch

    @property
    def following(self) -> bool:
        """True while this master follows another's log (replicated mode, not promoted)."""
        return self._following

    def _check_open(self) -> None:
        if self._closed:
            raise LogFailedError("the master service is closed")
        if self._failed is not None:
            raise LogFailedError(f"the operation log failed earlier ({self._failed}); the master is read-only")

    def _check_readable(self) -> None:
        """Reads (get_replicas in every form, exists, object_info) after a log or replication failure
        are LOG_FAILED too: the failed call's changes are applied in memory but were never
        acknowledged (and may be lost), so nothing is answered from that memory; the owner reopens
        the service from its data dir (HA does; a single master is restarted)."""
        if self._failed is not None:
            raise LogFailedError(f"the operation log failed earlier ({self._failed}); the master answers no "
                                 f"read from a state holding an unacknowledged change until it is reopened")

    def _check_leading(self) -> None:
        self._check_open()
        if self._following:
            raise NotLeaderError("this master is a standby following the leader's log: it changes no state "
                                 "until it is promoted")

    def _record(self, rec: list) -> None:
        """Encode one record, then apply it and keep it for this call's WAL record (written by
        ``_commit``: one record, one LSN, per call; a BATCH when the call made several state changes).
        A record that cannot be encoded, or that would make the call's WAL record larger than the WAL
        takes (``wal.MAX_PAYLOAD_BYTES``), is refused (RecordEncodeError) BEFORE it is applied: memory
        and log never hold a change the other lacks (the call's earlier records, applied, are logged)."""
        try:
            payload = encode_record(rec)
        except Exception as exc:  # msgpack raises several types (UnicodeEncodeError, OverflowError, TypeError)
            raise RecordEncodeError(f"{Op(rec[0]).name} record cannot be written to the operation log "
                                    f"({type(exc).__name__}: {exc}); nothing was changed") from None
        recs = self._call_recs
        total = len(payload) + (self._call_bytes if recs else 0)
        limit = _wal.MAX_PAYLOAD_BYTES - _BATCH_HEADROOM
        if total > limit:
            raise RecordEncodeError(f"{Op(rec[0]).name} record of {len(payload)} bytes would make this call's "
                                    f"operation-log record {total} bytes, over the limit of {limit}; nothing "
                                    f"was changed by it (split the batch)")
        if not recs and self._projection.pending():  # rows a previous call deferred go first (and are
            self._projection.publish()                # never discarded with this call's, should it fail)
        lsn = self._state.lsn + 1 if not recs else self._call_lsn
        self._state.apply(rec, lsn)
        if not recs:
            self._call_lsn = lsn
        recs.append(rec)
        self._call_payloads.append(payload)
        self._call_bytes = total

    def _commit(self, *, appended: bool = False) -> None:
        """Log this call's records and commit the log (one fsync) if the call changed anything;
        ``appended``: records were appended to the local log directly (``follow``), commit them too."""
        recs = self._call_recs
        written_only = (bool(recs) and not self.config.sync_put_start and self._replicate is None
                        and all(r[0] in _PUT_START_OPS for r in recs))  # MasterConfig.sync_put_start
        changed = bool(recs) or bool(self._unreplicated) or appended
        if recs:
            self._log_call()
        if self._unreplicated:
            self._replicate_pending()
        if self._log is not None and changed:  # a call that changed nothing does not fsync earlier put starts
            try:
                if written_only:
                    self._log.write()
                else:
                    self._log.commit()
            except (WalIOError, OSError, WalError) as exc:
                self._failed = exc
                self._projection.discard()
                raise LogFailedError(f"syncing the operation log failed ({exc}); nothing since the last "
                                     f"acknowledged call is durable and the master is read-only") from exc
        if not self.config.defer_index_publish:
            self._projection.publish()

    def _log_call(self) -> None:
        recs, self._call_recs = self._call_recs, []
        payloads, self._call_payloads = self._call_payloads, []
        self._call_bytes = 0
        payload, changes = join_encoded(recs, payloads)
        lsn = self._call_lsn
        if self._replicate is not None:  # the local log gets it once the replicated log has it (_commit)
            self._unreplicated.append((lsn, payload))
            self._unreplicated_changes += changes - 1
        elif self._log is not None:
            try:
                if self._log.next_lsn != lsn:  # checked before the append: a wrong record is never written
                    raise WalError(f"operation log is at lsn {self._log.next_lsn}, expected {lsn}")
                self._log.append(payload, changes)
            except (OSError, WalError, ValueError) as exc:  # (ValueError: over the WAL's payload limit)
                self._failed = exc
                self._projection.discard()
                raise LogFailedError(f"appending to the operation log failed ({exc}); the master is read-only") from exc

    def _replicate_pending(self) -> None:
        batch, self._unreplicated = self._unreplicated, []
        extra, self._unreplicated_changes = self._unreplicated_changes, 0
        try:
            self._replicate(batch)  # type: ignore[misc]
        except Exception as exc:
            self._failed = exc
            self._projection.discard()
            if isinstance(exc, MasterError):
                raise
            raise LogFailedError(f"replicating {len(batch)} record(s) failed ({type(exc).__name__}: {exc}); "
                                 f"the master is read-only") from exc
        if self._log is not None:
            try:
                for lsn, payload in batch:
                    if self._log.next_lsn != lsn:  # (checked first: a wrong record is never written)
                        raise WalError(f"local log is at lsn {self._log.next_lsn - 1}, expected {lsn}")
                    self._log.append(payload)
                self._log.records_since_rotate += extra
            except (OSError, WalError, ValueError) as exc:  # (ValueError: over the WAL's payload limit)
                self._failed = exc
                self._projection.discard()
                raise LogFailedError(f"appending to the operation log failed ({exc}); the master is "
                                     f"read-only") from exc

    def follow(self, records: Sequence[tuple[int, bytes]]) -> int:
        """(Follower) apply ``[(lsn, payload), ...]`` that the leader committed, in LSN order: records
        at or below this master's LSN are skipped, a gap is InvalidParamsError; each record is also
        appended to the local log (one fsync per call). Returns the last applied LSN. A record that
        does not apply turns the service failed (the owner reopens it from its data dir)."""
        self._check_open()
        if not self._following:
            raise InvalidParamsError("follow() is for a follower; this master writes its own log")
        st = self._state
        if st.space_attached:
            st.detach_space()
        appended = False
        try:
            for lsn, payload in records:
                if lsn <= st.lsn:
                    continue
                if lsn != st.lsn + 1:
                    raise InvalidParamsError(f"follow: record {lsn} leaves a gap after lsn {st.lsn}")
                try:
                    rec = decode_record(payload)
                    st.apply(rec, lsn)
                    changes = num_changes(rec)
                    if self._log is not None:
                        if self._log.next_lsn != lsn:  # (checked first: a wrong record is never written)
                            raise WalError(f"local log is at lsn {self._log.next_lsn - 1}, expected {lsn}")
                        self._log.append(payload, changes)
                        appended = True
                except Exception as exc:
                    self._failed = exc
                    raise
        finally:
            if self._failed is None:
                self._commit(appended=appended)  # the records applied are fsynced in the local log
        if self._failed is None:
            self._maybe_snapshot()
        return st.lsn

    def promote(self, epoch: int) -> None:
        """(Follower → leader) write from now on with ``epoch`` (not older than any record seen): soft
        state as after a restart (every complete object leased for one lease TTL, every client seen
        now), the allocators rebuilt, and an EPOCH record committed (through ``replicate``: a fenced
        epoch fails here)."""
        self._check_open()
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < max(1, self._state.epoch):
            raise StaleEpochError(f"promote({epoch!r}): epoch {self._state.epoch} was already seen")
        now = self._now()
        st = self._state
        lease_end = now + self.config.lease_ttl_s
        st.objects.lease_floor_s = max(st.objects.lease_floor_s, lease_end)
        for obj in st.objects.materialized():
            if obj.status == _COMPLETE:
                obj.lease_end_s = max(obj.lease_end_s, lease_end)
        for node in st.clients:
            st.last_seen[node] = now
        self._following = False
        self._epoch = epoch
        self._check_writable()  # attaches the allocators
        self._record([Op.EPOCH, epoch, now])
        self._commit()

    def demote(self) -> None:
        """(Leader → follower) stop writing; the state holds only committed records."""
        if self._replicate is None:
            raise InvalidParamsError("demote() needs replicated mode (MasterService(replicate=...))")
        self._following = True

    def snapshot_bytes(self) -> bytes:
        """The current state as a snapshot document (``master.snap``'s format; its ``lsn`` is this
        master's), for a follower too far behind the replicated log to follow it."""
        self._check_open()
        return encode_state(self._state)
