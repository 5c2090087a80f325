"""The master's operation log: msgpack records over the project's WAL, group-committed.

Record format. Every state change is one record, a msgpack array ``[op, epoch, now_s, *fields]``
(:class:`Op` and the field lists below): the epoch of the writer (fencing: ``apply`` refuses a
record of an older epoch than the newest it has seen) and the clock value the operation used, so
replaying a record does exactly what the original call did. The fields carry every decision the
service took (e.g. the replica placement of a ``PUT_START``), never something to decide again.

    MOUNT      node_id, segment_id, capacity_bytes, endpoint, transport, [region_ids], tier
    UNMOUNT    segment_id
    PUT_START  key, size_bytes, alloc_bytes, pin, soft_pin_ttl_s, digest|nil, put_id, [[segment_id, offset], ...]
    PUT_END    key
    PUT_END_MANY [key, ...]: PUT_END of each key in order (what one batch_put_end of several keys writes: one
               record instead of one per key)
    PUT_START_MANY soft_pin_ttl_s, first_put_id, [key, ...], [size_bytes, ...], [alloc_bytes, ...], [pin, ...],
               [digest|nil, ...], [replica_count, ...], [segment_id, offset, segment_id, offset, ...]: PUT_START of
               each key in order, as columns (what one batch_put_start of several new keys writes); put ids are
               consecutive from first_put_id, the replicas of key i are the next replica_count[i] pairs of the flat
               array; a key appears once (a repeat within a batch never starts a second put)
    PUT_REVOKE key
    REMOVE     key
    EVICT      [key, ...]
    EXPIRE     node_id
    RECLAIM    (reclaim every zombie whose deadline is <= now_s, deadlines from the applying master's
               zombie_reclaim_s: the form logs written before RECLAIM_LISTED hold; still read, no longer written)
    RECLAIM_LISTED [key, ...], [[segment_id, offset], ...]: the reclaim the writer decided, named: drop these
               PENDING puts and release these ranges of pre-empted (discarded) puts; replay does exactly this,
               whatever the replaying master's zombie_reclaim_s
    EPOCH      (the writer's epoch starts here)
    BATCH      [record, ...]: the records of one service call, each a whole record as above (not a BATCH),
               applied in order; one WAL record (one LSN) per call, so replay decodes one msgpack document
               per call instead of one per state change, and a call's records are durable all or none

Durability contract (:class:`OpLog`): ``append`` buffers a record and returns its LSN; ``commit``
writes and fsyncs everything appended (one fsync for a whole batch: group commit) — a call of the
service returns (acknowledges) only after its records were committed. A failed write or fsync
turns the log failed for good (the WAL's own rule: never retry an fsync) and the service then
refuses every state change with ``LOG_FAILED``. ``rotate(lsn)`` replaces the log, atomically, by an
empty one whose next LSN is ``lsn + 1`` (used right after a snapshot covering ``lsn`` is durable).

Segments (for snapshots written in the background): ``seal()`` commits the active file
``master.wal``, renames it to ``master.wal.<its first lsn, 20 digits>`` and starts an empty active file
after it; ``drop_through(lsn)`` deletes the sealed segments whose records are all covered by a durable
snapshot. Recovery reads the sealed segments and the active file in LSN order, refuses a gap between
the snapshot and the last record (naming the missing LSNs), deletes segments the snapshot covers, and
starts a missing active file (a crash between the rename and its creation) after the last record.

Dropped tails (:class:`MasterRecoveryReport`). Recovery drops a damaged or torn last stretch of a log file
(the WAL's ``point_in_time`` for the active file, ``strict`` for a sealed one: nothing valid the log proves
acknowledged follows it). A drop is never silent and its bytes are never destroyed: before the active file is
cut back (``WalWriter.reopen``) or a new active file starts after a sealed segment, the dropped bytes are
written, fsynced, to ``<log file name>.dropped-<expected lsn>-<byte offset>`` in the data dir (a further
``-<n>`` when that name exists: a later drop never overwrites an earlier one; the name never matches a sealed
segment's, so nothing treats it as part of the log, and nothing deletes it), a WARNING names the file, the
offset, the byte count and the LSN expected there, and the drop is in :attr:`OpLog.recovery_report`. A refusal
(damage the log proves acknowledged) says what an operator can do: the master offers no recovery mode that
drops records.
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass

import msgpack

from quillcache.durability.fs import CREATE_EXCL, FileSystem
from quillcache.durability.wal import RecoveryReport, WalCorruptionError, WalWriter, scan_bytes
from quillcache.master._kernels import all_of_type

__all__ = ["DroppedTail", "MasterRecoveryReport", "Op", "OpLog", "decode_record", "encode_batch", "encode_record",
           "join_encoded", "log_files", "num_changes", "sealed_segments", "segment_path"]

WAL_NAME = "master.wal"
DROPPED_INFIX = ".dropped-"  # <log file name>.dropped-<expected lsn>-<byte offset>[-<n>]: a dropped tail, kept

log = logging.getLogger(__name__)


class Op(enum.IntEnum):
    MOUNT = 1
    UNMOUNT = 2
    PUT_START = 3
    PUT_END = 4
    PUT_REVOKE = 5
    REMOVE = 6
    EVICT = 7
    EXPIRE = 8
    RECLAIM = 9
    EPOCH = 10
    BATCH = 11
    PUT_END_MANY = 12
    PUT_START_MANY = 13
    RECLAIM_LISTED = 14


_NUM_FIELDS = {Op.MOUNT: 7, Op.UNMOUNT: 1, Op.PUT_START: 8, Op.PUT_END: 1, Op.PUT_REVOKE: 1, Op.REMOVE: 1,
               Op.EVICT: 1, Op.EXPIRE: 1, Op.RECLAIM: 0, Op.EPOCH: 0, Op.BATCH: 1, Op.PUT_END_MANY: 1,
               Op.PUT_START_MANY: 9, Op.RECLAIM_LISTED: 2}

_packb = msgpack.Packer(use_bin_type=True).pack


def encode_record(record: list) -> bytes:
    return _packb(record)


def decode_record(payload: bytes) -> list:
    """A record as a list ``[Op, epoch, now_s, *fields]``; ValueError naming what is malformed."""
    try:
        rec = msgpack.unpackb(payload, raw=False, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"master log record is not msgpack ({exc})") from None
    if not isinstance(rec, list) or len(rec) < 3:
        raise ValueError(f"master log record must be an array [op, epoch, now, ...], got {rec!r:.80}")
    try:
        op = Op(rec[0])
    except ValueError:
        raise ValueError(f"master log record has unknown op {rec[0]!r}") from None
    if len(rec) != 3 + _NUM_FIELDS[op]:
        raise ValueError(f"master log record {op.name} has {len(rec) - 3} fields, expected {_NUM_FIELDS[op]}")
    rec[0] = op
    if op == Op.PUT_END_MANY and not (isinstance(rec[3], list) and rec[3] and all_of_type(rec[3], str)):
        raise ValueError(f"master log record PUT_END_MANY must hold a non-empty array of keys, got {rec[3]!r:.80}")
    if op == Op.PUT_START_MANY:
        _check_put_start_many(rec)
    if op == Op.BATCH:
        subs = rec[3]
        if not isinstance(subs, list) or not subs:
            raise ValueError("master log record BATCH must hold a non-empty array of records")
        nf = _NUM_FIELDS
        for sub in subs:
            n = nf.get(sub[0], -1) if isinstance(sub, list) and sub and type(sub[0]) is int else -1
            if n < 0 or sub[0] == Op.BATCH or len(sub) != 3 + n:
                raise ValueError(f"master log record BATCH holds a malformed record {sub!r:.80}")
            if sub[0] == Op.PUT_START_MANY:
                _check_put_start_many(sub)
    return rec


def _ints(v: object, n: int) -> bool:
    return isinstance(v, list) and len(v) == n and all_of_type(v, int)


def _check_put_start_many(rec: list) -> None:
    """ValueError naming the first malformed field of a PUT_START_MANY record (its columns must agree)."""
    ttl, first, keys, sizes, allocs, pins, digests, counts, flat = rec[3:]
    what = None
    if type(ttl) not in (int, float) or type(first) is not int or first < 1:
        what = f"soft_pin_ttl_s={ttl!r:.20} and first_put_id={first!r:.20} must be a number and an int >= 1"
    elif not (isinstance(keys, list) and keys and all_of_type(keys, str)):
        what = f"keys must be a non-empty array of str, got {keys!r:.80}"
    elif len(set(keys)) != len(keys):
        what = "a key appears twice"
    else:
        n = len(keys)
        for name, col in (("size_bytes", sizes), ("alloc_bytes", allocs), ("pin", pins),
                          ("replica_count", counts)):
            if not _ints(col, n):
                what = f"{name} must be an array of {n} ints, got {col!r:.80}"
                break
        else:
            if not (isinstance(digests, list) and len(digests) == n
                    and all(d is None or type(d) is bytes for d in digests)):
                what = f"digests must be an array of {n} bytes or nil, got {digests!r:.80}"
            elif min(counts) < 1:
                what = "every key needs at least one replica"
            elif not _ints(flat, 2 * sum(counts)):
                what = f"replicas must be a flat array of {2 * sum(counts)} ints (segment_id, offset pairs)"
    if what is not None:
        raise ValueError(f"master log record PUT_START_MANY is malformed: {what}")


def num_changes(record: list) -> int:
    """The state changes a decoded record holds: one per key of a PUT_START_MANY / PUT_END_MANY, the
    sum over a BATCH's records, else one (the snapshot cadence counts these, not WAL records)."""
    op = record[0]
    if op == Op.PUT_START_MANY:
        return len(record[5])
    if op == Op.PUT_END_MANY:
        return len(record[3])
    if op == Op.BATCH:
        return sum(num_changes(r) for r in record[3])
    return 1


def encode_batch(records: list) -> tuple[bytes, int]:
    """One WAL payload for the records of one call (a BATCH record when there are several) and
    the number of state changes it holds."""
    if len(records) == 1:
        return _packb(records[0]), num_changes(records[0])
    last = records[-1]
    return _packb([Op.BATCH, last[1], last[2], records]), sum(num_changes(r) for r in records)


_packer = msgpack.Packer(use_bin_type=True)


def join_encoded(records: list, payloads: list[bytes]) -> tuple[bytes, int]:
    """``encode_batch(records)`` built from ``payloads[i] == encode_record(records[i])`` (each record
    encoded once, when it was made: byte for byte the same payload, tested)."""
    if len(records) == 1:
        return payloads[0], num_changes(records[0])
    last = records[-1]
    head = _packer.pack_array_header(4) + _packb(Op.BATCH) + _packb(last[1]) + _packb(last[2])
    return (head + _packer.pack_array_header(len(payloads)) + b"".join(payloads),
            sum(num_changes(r) for r in records))


@dataclass(frozen=True)
class DroppedTail:
    """The last stretch of a log file that recovery dropped: ``num_bytes`` bytes from byte ``offset`` of
    ``path``, where a record of lsn ``expected_lsn`` should have started (``reason``: the WAL scan's words);
    the bytes are kept in ``kept_as``."""

    path: str
    offset: int
    num_bytes: int
    expected_lsn: int
    reason: str
    kept_as: str

    def as_dict(self) -> dict:
        return {"path": self.path, "offset": self.offset, "num_bytes": self.num_bytes,
                "expected_lsn": self.expected_lsn, "reason": self.reason, "kept_as": self.kept_as}


@dataclass(frozen=True)
class MasterRecoveryReport:
    """What the master's log recovery found past the snapshot: ``records`` replayed, and every tail it
    dropped (module docstring; empty = every log file ended cleanly)."""

    records: int = 0
    dropped: tuple[DroppedTail, ...] = ()

    @property
    def clean(self) -> bool:
        return not self.dropped

    def as_dict(self) -> dict:
        """Plain values (for a status reply over RPC)."""
        return {"clean": self.clean, "records": self.records, "dropped": [d.as_dict() for d in self.dropped]}


class OpLog:
    """The master's log: the active WAL file ``<data_dir>/master.wal`` plus sealed segments
    ``master.wal.<first lsn, 20 digits>`` (see the module docstring)."""

    def __init__(self, data_dir: str, fs: FileSystem) -> None:
        self.data_dir = data_dir
        self.path = os.path.join(data_dir, WAL_NAME)
        self.fs = fs
        self._wal: WalWriter | None = None
        self.records_since_rotate = 0
        self.recovery_report = MasterRecoveryReport()  # what ``recover`` found (module docstring)

    def recover(self, after_lsn: int, *, mode: str = "point_in_time") -> list[tuple[int, bytes]]:
        """Open the log for appending and return its records past ``after_lsn`` (the snapshot's),
        in LSN order, from the sealed segments and the active file. A missing active file starts a
        fresh one after the last record found; segments wholly covered by the snapshot are deleted;
        a gap anywhere between the snapshot and the last record is refused (records would be missing).
        A dropped tail is kept aside, logged and reported (module docstring) before anything is changed."""
        fs = self.fs
        sealed = sealed_segments(self.data_dir, fs)
        covered = _covered(sealed, None, after_lsn)  # (the last sealed segment is read: its end is not known yet)
        sealed = sealed[len(covered):]
        tail: list[tuple[int, bytes]] = []
        behind = False  # the snapshot is newer than everything in the log
        expect = None  # the lsn the next file must start at (after the previous one's last record)
        drops: list[tuple[str, bytes, RecoveryReport]] = []  # (file, its bytes, its report) whose tail was dropped
        active = fs.exists(self.path)
        for i, (base, path) in enumerate(sealed):
            data = fs.read_file(path)
            later = [p for _, p in sealed[i + 1:]] + ([self.path] if active else [])
            report, records = self._scan(data, path, "strict", later)
            if report.header.base_lsn != base:
                raise ValueError(f"{path}: sealed log segment's header says it starts at lsn {report.header.base_lsn}")
            self._check_start(path, base, expect, after_lsn, drops[-1][2] if drops else None)
            if report.dropped_bytes:
                drops.append((path, data, report))
            tail.extend((lsn, p) for lsn, p in records if lsn > after_lsn)
            expect = report.last_lsn + 1
        last = expect - 1 if expect is not None else after_lsn
        if not active:  # a crash between sealing the active file and creating the next one
            self._keep_dropped(drops, after_lsn)
            self._wal = WalWriter.create(self.path, max(last, after_lsn) + 1, fs=fs)
        else:
            data = fs.read_file(self.path)
            report, records = self._scan(data, self.path, mode, [])
            self._check_start(self.path, report.header.base_lsn, expect, after_lsn, drops[-1][2] if drops else None)
            if report.dropped_bytes:
                drops.append((self.path, data, report))
            self._keep_dropped(drops, after_lsn)  # (before reopen cuts the active file back)
            self._wal = WalWriter.reopen(self.path, report, fs=fs)
            behind = report.last_lsn < after_lsn
            tail.extend((lsn, p) for lsn, p in records if lsn > after_lsn)
        for path in covered:  # (before any rotate below: its drop_through deletes what is left, not these again)
            fs.unlink(path)
        if covered:
            fs.fsync_dir(self.data_dir)
        if behind:  # start past the snapshot
            self.rotate(after_lsn)
        self.records_since_rotate = len(tail)
        self.recovery_report = MasterRecoveryReport(len(tail), self.recovery_report.dropped)
        return tail

    def _scan(self, data: bytes, path: str, mode: str, later: list[str]) -> tuple[RecoveryReport, list]:
        """``scan_bytes`` of one log file; a refusal says what an operator can do (``_refusal``)."""
        try:
            return scan_bytes(data, path, mode=mode)
        except WalCorruptionError as exc:
            raise self._refusal(exc, data, path, later) from None

    def _refusal(self, exc: WalCorruptionError, data: bytes, path: str, later: list[str]) -> WalCorruptionError:
        """The WAL's refusal of damage inside ``path`` (whose later log files are ``later``) without its hint at
        a recovery mode the master does not offer, and with what an operator can do instead."""
        try:
            cut, _ = scan_bytes(data, path, mode="truncate")  # where that mode would cut: the first bad record
        except WalCorruptionError:  # (a damaged header: nothing to cut, the message says all)
            return exc
        at, lost = cut.valid_bytes, cut.last_lsn + 1
        msg = str(exc).replace(f" (mode='truncate' would drop everything from byte {at})", "")
        also = f" and move the later log files aside ({', '.join(os.path.basename(p) for p in later)})" if later else ""
        return WalCorruptionError(
            f"{msg}. The master never drops records its log proves acknowledged and has no recovery mode that "
            f"would: restore {self.data_dir} from a backup, or, accepting the loss of every record from lsn {lost} "
            f"on, keep a copy of {path} and cut it at byte {at} (truncate -s {at} {path}){also}, then start again")

    def _keep_dropped(self, drops: list[tuple[str, bytes, RecoveryReport]], after_lsn: int) -> None:
        """Write each dropped tail to a file of its own (fsynced, never over an existing one), log a WARNING
        and add it to ``recovery_report`` (module docstring). Runs before the log files are changed."""
        kept = []
        for path, data, report in drops:
            offset, lsn = report.valid_bytes, report.last_lsn + 1
            name = f"{path}{DROPPED_INFIX}{lsn}-{offset}"
            dest, n = name, 1
            while True:
                try:
                    fd = self.fs.open(dest, CREATE_EXCL)
                    break
                except FileExistsError:
                    dest, n = f"{name}-{n}", n + 1
            try:
                self.fs.pwrite(fd, data[offset:], 0)
                self.fs.fsync(fd)
            finally:
                self.fs.close(fd)
            self.fs.fsync_dir(self.data_dir)
            why = ("a sealed segment was fsynced whole when it was sealed, so this record was durable, and likely "
                   "acknowledged" if path != self.path else
                   "a crash during an unacknowledged write leaves such a tail, so nothing acknowledged is known to be "
                   "lost, but damage to an acknowledged last record looks the same")
            if lsn <= after_lsn:
                why += f" (the snapshot covers up to lsn {after_lsn})"
            log.warning("master log %s: dropped %d bytes at byte %d, where lsn %d was expected (%s); %s; the dropped "
                        "bytes are kept in %s", path, report.dropped_bytes, offset, lsn, report.dropped_reason, why,
                        dest)
            kept.append(DroppedTail(path, offset, report.dropped_bytes, lsn, report.dropped_reason, dest))
        if kept:
            self.recovery_report = MasterRecoveryReport(self.recovery_report.records,
                                                        self.recovery_report.dropped + tuple(kept))

    @staticmethod
    def _check_start(path: str, base: int, expect: int | None, after_lsn: int,
                     prev_drop: RecoveryReport | None = None) -> None:
        if expect is None and base > after_lsn + 1:
            raise ValueError(f"{path}: log starts at lsn {base} but the snapshot covers only up to lsn {after_lsn}: "
                             f"records {after_lsn + 1}..{base - 1} are missing")
        if expect is not None and base != expect and base > after_lsn + 1:
            why = (f" (the previous segment's tail is damaged: {prev_drop.dropped_reason})"
                   if prev_drop is not None and prev_drop.last_lsn + 1 == expect else "")
            raise ValueError(f"{path}: log starts at lsn {base} but the previous segment ends at lsn {expect - 1}: "
                             f"records {expect}..{base - 1} are missing{why}" if base > expect else
                             f"{path}: log starts at lsn {base}, inside the previous segment (ends at {expect - 1})")

    @property
    def next_lsn(self) -> int:
        assert self._wal is not None
        return self._wal.next_lsn

    @property
    def failed(self) -> BaseException | None:
        return None if self._wal is None else self._wal.failed

    def append(self, payload: bytes, changes: int = 1) -> int:
        """Buffer one record holding ``changes`` state changes (a BATCH holds several; the
        snapshot cadence counts state changes, not WAL records); returns its LSN."""
        assert self._wal is not None
        self.records_since_rotate += changes
        return self._wal.append(payload)

    def commit(self) -> int:
        """Write and fsync every record appended; returns the durable LSN."""
        assert self._wal is not None
        return self._wal.sync()

    def write(self) -> None:
        """Write the records appended to the file without fsyncing them (a later ``commit`` does)."""
        assert self._wal is not None
        self._wal.write()

    @property
    def durable_lsn(self) -> int:
        """The last LSN fsynced: what survives a power loss."""
        assert self._wal is not None
        return self._wal.durable_lsn

    def rotate(self, covered_lsn: int) -> None:
        """Replace the log by an empty one continuing at ``covered_lsn + 1`` (atomic rename); the
        sealed segments, all covered, are deleted."""
        assert self._wal is not None
        self._wal.close()
        self._wal = WalWriter.create(self.path, covered_lsn + 1, fs=self.fs)
        self.drop_through(covered_lsn)
        self.records_since_rotate = 0

    def seal(self) -> int:
        """Commit, then close the active file as the sealed segment ``master.wal.<its first lsn>`` and
        start an empty active file after it; returns the last LSN sealed. A snapshot of the state at
        that LSN may then be written while appends go on; :meth:`drop_through` deletes the sealed
        segments once it is durable. Crash-safe at every step: recovery reads the sealed segments
        and the active file in LSN order (a missing active file is started after them)."""
        assert self._wal is not None
        last = self._wal.sync()
        base = self._wal.header.base_lsn
        self._wal.close()
        self.fs.rename(self.path, segment_path(self.data_dir, base))
        self.fs.fsync_dir(self.data_dir)
        self._wal = WalWriter.create(self.path, last + 1, fs=self.fs)
        self.records_since_rotate = 0
        return last

    def drop_through(self, lsn: int) -> int:
        """Delete the sealed segments whose records are all at or before ``lsn`` (a durable snapshot
        covers them); returns how many were deleted."""
        gone = _covered(sealed_segments(self.data_dir, self.fs),
                        self._wal.header.base_lsn if self._wal is not None else None, lsn)
        for p in gone:
            self.fs.unlink(p)
        if gone:
            self.fs.fsync_dir(self.data_dir)
        return len(gone)

    def close(self) -> None:
        if self._wal is not None and not self._wal.closed:
            self._wal.close()


def _covered(sealed: list[tuple[int, str]], active_base: int | None, lsn: int) -> list[str]:
    """The sealed segments (in LSN order) whose records are all at or before ``lsn``: those followed by a
    file starting at or before ``lsn + 1`` (the next sealed segment, or the active file at ``active_base``)."""
    nexts = [b for b, _ in sealed[1:]] + [active_base]
    return [p for (_, p), nxt in zip(sealed, nexts) if nxt is not None and nxt <= lsn + 1]


def segment_path(data_dir: str, first_lsn: int) -> str:
    return os.path.join(data_dir, f"{WAL_NAME}.{first_lsn:020d}")


def sealed_segments(data_dir: str, fs: FileSystem) -> list[tuple[int, str]]:
    """The sealed log segments of ``data_dir`` as ``(first lsn, path)``, in LSN order."""
    out = []
    prefix = WAL_NAME + "."
    for name in fs.listdir(data_dir):
        tail = name[len(prefix):]
        if name.startswith(prefix) and len(tail) == 20 and tail.isdigit():
            out.append((int(tail), os.path.join(data_dir, name)))
    return sorted(out)


def log_files(data_dir: str, fs: FileSystem) -> list[str]:
    """Every file of the master's log in ``data_dir`` (sealed segments, then the active file if any)."""
    active = os.path.join(data_dir, WAL_NAME)
    return [p for _, p in sealed_segments(data_dir, fs)] + ([active] if fs.exists(active) else [])
