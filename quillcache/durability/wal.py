"""The write-ahead log: opaque records with crc32c, a per-file epoch, group commit and recovery.

One log implementation for every user (the ART index, the SSD tier). All I/O goes through a
:class:`quillcache.durability.fs.FileSystem` (default :class:`~quillcache.durability.fs.RealFs`), so
the crash simulator (:class:`quillcache.durability.crashfs.CrashFs`) sees every write and sync.

File layout (little-endian):

- header, 32 bytes: ``magic "QCWAL\\0\\1\\0"`` | epoch u64 | base_lsn u64 | reserved u32 | crc32c u32
  (the crc covers the 28 bytes before it);
- records: ``payload_len u32 | crc u32 | lsn u64 | durable_lsn u64 | payload``, where
  ``crc = crc32c(epoch u64 || lsn u64 || durable_lsn u64 || payload_len u32 || payload)`` and
  ``durable_lsn`` is the highest LSN already acknowledged (fsynced) when the record was appended.

Invariants and contract (writer, :class:`WalWriter`):
- LSNs are consecutive: the first record of a file has ``base_lsn``, each next one +1. Because the
  epoch (random per file) is inside every record's crc, stale bytes of a recycled or older file
  never validate as records of this one.
- A log file is created atomically: header (and any initial records) written to ``path.tmp``,
  fsynced, renamed to ``path``, directory fsynced; only then does ``create`` return.
- ``append`` only buffers; a record is *acknowledged* (durable) once ``sync()`` returned. The
  buffer is written (not synced) whenever it exceeds ``group_bytes``, so memory stays bounded.
- If ``fsync`` fails the log never trusts the file again: the writer turns failed and refuses
  every later call with :class:`WalFailedError` (REFERENCE §7: never retry an fsync).
- A failed *write* (e.g. ``ENOSPC``) is undone: the file is truncated back to the end of the last
  record written before, so later records never follow garbage, and the records not yet written
  (appended since the last write) are discarded. What happens next is ``on_write_error``:
  ``"fail"`` (default) turns the writer failed, as for a failed fsync (for a caller that already
  applied the discarded records elsewhere); ``"rollback"`` raises :class:`WalWriteError` naming
  the discarded LSNs and continues at the first of them (for a caller that drops what they
  described). Both errors are ``OSError`` subclasses carrying the ``errno`` of the cause.
- ``retract(lsn)`` withdraws the last appended record while it is unacknowledged (a caller that
  logged a batch it then could not apply); a record already written is cut off and the file synced.

Recovery (:func:`scan`) reads records until the first one that is truncated, fails its crc or
breaks the LSN sequence (at LSN L). What happens next is a named mode (:data:`RECOVERY_MODES`):

- ``"point_in_time"`` (default, RocksDB's default too): stop at L and drop the rest — unless a
  valid later record says ``durable_lsn >= L``, which proves an *acknowledged* record is damaged;
  that is refused with :class:`WalCorruptionError`. So unacknowledged bytes garbled by a crash
  (SQLite-style torn, dropped or garbled unsynced writes) are dropped, and acknowledged data is
  never dropped silently when the log itself holds evidence of it;
- ``"strict"``: any valid record after a bad one is refused (only a clean torn tail is dropped);
- ``"truncate"``: always stop at L and drop the rest (best-effort salvage);
- ``"salvage"``: skip the damaged stretch and go on at the next valid record, reporting the
  skipped LSN ranges in :attr:`RecoveryReport.damaged_lsns` (for a cache, where losing what a
  damaged record described is acceptable and every payload it points at carries its own check).

The dropped tail is truncated when the file is reopened for appending (:meth:`WalWriter.reopen`).

Recovery is linear in the file size whatever the damage: the file is copied once per scan, valid
records after a damaged one are searched in one forward pass, and the payload bytes checksummed
for invalid candidate records are capped (:class:`_Search`); a zero-filled stretch costs one
C-level search, not a check per byte. If the cap is reached in a mode that
must know whether an acknowledged record follows, the log is refused rather than guessed about.
LSNs live in [1, 2**64 - 1]: a writer refuses to go past the end with :class:`WalError`, and a
header or record LSN near the end is an ordinary (possibly corrupt) value, never an overflow.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import crc32c as _crc

from quillcache._checks import check_buffer, check_choice, check_int
from quillcache.durability.fs import CREATE_EXCL, READ_WRITE, FileSystem, RealFs

MAGIC = b"QCWAL\x00\x01\x00"
_HEADER = struct.Struct("<8sQQI")  # magic, epoch, base_lsn, reserved; crc u32 follows
HEADER_BYTES = _HEADER.size + 4
_REC = struct.Struct("<IIQQ")  # payload_len, crc, lsn, durable_lsn
RECORD_HEADER_BYTES = _REC.size
MAX_PAYLOAD_BYTES = 256 << 20
_LSN_LOOKAHEAD = 1 << 20
MAX_LSN = (1 << 64) - 1  # LSNs are u64 on disk
SEARCH_BUDGET_FACTOR = 64  # bytes checksummed for invalid candidates per byte of file, at most (+16 MiB)
DEFAULT_GROUP_BYTES = 1 << 20
_ZERO_HIGH = bytes(5)  # the candidate pattern of every LSN below 2**24
_NONZERO = re.compile(rb"[^\x00]")


class WalError(RuntimeError):
    """Base class of WAL errors."""


class WalCorruptionError(WalError):
    """The log holds damaged bytes that are not a torn tail (or its header is damaged)."""


class WalIOError(WalError, OSError):
    """A write or fsync of the log failed; ``errno`` is the cause's."""

    def __init__(self, errno_: int | None, message: str) -> None:
        super().__init__(errno_, message)
        self.errno, self.strerror = errno_, message

    def __str__(self) -> str:
        return self.strerror


class WalFailedError(WalIOError):
    """A previous write or fsync failed; the log refuses further use."""


class WalWriteError(WalIOError):
    """A write failed and was undone (``on_write_error="rollback"``): records ``lost_lsns`` =
    ``(first, last)`` were discarded and the writer goes on at ``first``."""

    def __init__(self, errno_: int | None, message: str, lost_lsns: tuple[int, int]) -> None:
        super().__init__(errno_, message)
        self.lost_lsns = lost_lsns


def _record_crc(epoch: int, lsn: int, durable_lsn: int, payload: bytes | memoryview) -> int:
    c = _crc.crc32c(struct.pack("<QQQI", epoch, lsn, durable_lsn, len(payload)))
    return _crc.crc32c(payload, c)


@dataclass(frozen=True)
class WalHeader:
    epoch: int
    base_lsn: int


@dataclass(frozen=True)
class RecoveryReport:
    """What recovery found: records ``base_lsn .. last_lsn`` were valid (less the ``damaged_lsns``
    ranges a salvage scan skipped) and the last of them ends at ``valid_bytes``."""

    header: WalHeader
    num_records: int
    last_lsn: int  # base_lsn - 1 when the log holds no valid record
    valid_bytes: int
    file_bytes: int
    dropped_reason: str  # "" when the file ended cleanly
    damaged_lsns: tuple[tuple[int, int], ...] = ()  # [first, last] ranges skipped ("salvage" only)

    @property
    def dropped_bytes(self) -> int:
        return self.file_bytes - self.valid_bytes


@dataclass(frozen=True)
class RecoveryMode:
    """What a scan does at a bad record (at LSN L) when a valid record follows further on."""

    name: str
    skip_damage: bool  # go on at the next valid record, reporting the skipped LSNs
    refuse_any_valid_after: bool  # refuse the log
    refuse_acknowledged_after: bool  # refuse if a later record says L was acknowledged


RECOVERY_MODES: dict[str, RecoveryMode] = {
    m.name: m
    for m in (
        RecoveryMode("point_in_time", skip_damage=False, refuse_any_valid_after=False, refuse_acknowledged_after=True),
        RecoveryMode("strict", skip_damage=False, refuse_any_valid_after=True, refuse_acknowledged_after=True),
        RecoveryMode("truncate", skip_damage=False, refuse_any_valid_after=False, refuse_acknowledged_after=False),
        RecoveryMode("salvage", skip_damage=True, refuse_any_valid_after=False, refuse_acknowledged_after=False),
    )
}


def encode_header(epoch: int, base_lsn: int) -> bytes:
    body = _HEADER.pack(MAGIC, epoch, base_lsn, 0)
    return body + struct.pack("<I", _crc.crc32c(body))


def decode_header(buf: bytes | memoryview, where: str) -> WalHeader:
    if len(buf) < HEADER_BYTES:
        raise WalCorruptionError(f"{where}: {len(buf)} bytes is too short for a WAL header ({HEADER_BYTES})")
    body, (crc,) = bytes(buf[: _HEADER.size]), struct.unpack_from("<I", buf, _HEADER.size)
    magic, epoch, base_lsn, _ = _HEADER.unpack(body)
    if magic != MAGIC:
        raise WalCorruptionError(f"{where}: not a QuillCache WAL (magic {magic!r})")
    if _crc.crc32c(body) != crc:
        raise WalCorruptionError(f"{where}: WAL header checksum mismatch")
    return WalHeader(epoch, base_lsn)


def _valid_at(data: memoryview, pos: int, epoch: int, min_lsn: int) -> int:
    """End offset of a valid record at ``pos`` with lsn >= min_lsn, or -1 (:func:`_check_at`)."""
    return _check_at(data, pos, epoch, min_lsn)[0]


def _check_at(data: memoryview, pos: int, epoch: int, min_lsn: int,
              max_lsn: int | None = None) -> tuple[int, int]:
    """``(end offset or -1, payload bytes checksummed)`` for a record at ``pos`` with an lsn in
    [min_lsn, max_lsn] (default: the lookahead window). The header fields are checked (O(1))
    before the payload's checksum is computed."""
    end = len(data)
    if pos + RECORD_HEADER_BYTES > end:
        return -1, 0
    length, crc, lsn, durable = _REC.unpack_from(data, pos)
    if length > MAX_PAYLOAD_BYTES or pos + RECORD_HEADER_BYTES + length > end:
        return -1, 0
    top = min_lsn + _LSN_LOOKAHEAD - 1 if max_lsn is None else max_lsn
    if not min_lsn <= lsn <= top or durable >= lsn:
        return -1, 0
    payload = data[pos + RECORD_HEADER_BYTES : pos + RECORD_HEADER_BYTES + length]
    if _record_crc(epoch, lsn, durable, payload) != crc:
        return -1, length
    return pos + RECORD_HEADER_BYTES + length, length


class _Search:
    """Finds the valid records after a damaged one, in one forward pass over the file.

    A candidate is an offset whose lsn field's upper five bytes match the LSN window being
    searched (``bytes.find`` on one copy of the file, made once per scan); the cursor of each
    pattern only moves forward, because the scan asks for offsets in increasing order, so finding
    candidates costs O(file size) in all. A candidate then passes O(1) header checks before its
    payload is checksummed; the payload bytes checksummed for candidates that turn out invalid
    are capped at ``SEARCH_BUDGET_FACTOR`` times the file size (plus 16 MiB), so crafted record
    headers claiming long payloads cannot make recovery quadratic. Past the cap the search gives
    up (``exhausted``) and the caller decides what that means for its mode.

    In a zero run (a tail extended but never written before a power loss) every byte matches the
    all-zero pattern of LSNs below 2**24, but a candidate whose whole lsn field is zero has lsn 0,
    which no record carries: :meth:`_find` jumps past those to the next non-zero byte in C. Each
    one skipped is refused by ``_check_at`` unchecksummed, so results and budget are unchanged.
    """

    def __init__(self, view: memoryview, epoch: int) -> None:
        self.view = view
        self.raw = bytes(view)
        self.epoch = epoch
        self.budget = SEARCH_BUDGET_FACTOR * len(view) + (16 << 20)
        self.exhausted = False
        self._hits: dict[bytes, int] = {}  # pattern -> last find() result (absolute offset of the pattern)

    def _next_candidate(self, start: int, lsn: int) -> int:
        best = -1
        for high in {lsn >> 24, (lsn + _LSN_LOOKAHEAD) >> 24}:
            if high >= 1 << 40:  # beyond the 64-bit LSN space: no record can carry it
                continue
            pattern = high.to_bytes(5, "little")
            hit = self._hits.get(pattern)
            if hit is None or (0 <= hit < start + 11):
                hit = self._find(pattern, start + 11)  # lsn field at rec + 8, its bytes 3..7 at rec + 11
                self._hits[pattern] = hit
            if hit >= 0 and (best < 0 or hit - 11 < best):
                best = hit - 11
        return best

    def _find(self, pattern: bytes, at: int) -> int:
        """The first occurrence of ``pattern`` at or after ``at`` whose record could carry an lsn
        >= 1: for the all-zero pattern, an occurrence whose lsn field's low three bytes (just
        before it) are zero too is skipped, jumping to the next non-zero byte (class docstring)."""
        raw = self.raw
        hit = raw.find(pattern, at)
        if pattern != _ZERO_HIGH:
            return hit
        while hit >= 0 and not any(raw[hit - 3 : hit]):
            # raw[hit - 3 : nz] is all zero, so every occurrence before nz + 1 has lsn 0 as well
            m = _NONZERO.search(raw, hit)
            if m is None:
                return -1
            hit = raw.find(pattern, m.start() + 1)
        return hit

    def valid_after(self, damaged_at: int, lsn: int) -> Iterator[tuple[int, int, int]]:
        """``(offset, lsn, durable_lsn)`` of every valid record after the damaged record at
        ``damaged_at`` (whose lsn should have been ``lsn``), in offset order; stops early, setting
        ``exhausted``, past the budget. Records are written back to back and each takes at least
        ``RECORD_HEADER_BYTES``, so a record at ``probe`` has an lsn of at most
        ``lsn + (probe - damaged_at) // RECORD_HEADER_BYTES``: candidates above that are skipped unread."""
        pos = damaged_at + 1
        while not self.exhausted:
            probe = self._next_candidate(pos, lsn)
            if probe < 0:
                return
            bound = lsn + (probe - damaged_at) // RECORD_HEADER_BYTES
            end, checked = _check_at(self.view, probe, self.epoch, lsn, bound)
            if end >= 0:
                yield (probe, *_REC.unpack_from(self.view, probe)[2:])
            else:
                self.budget -= checked
                self.exhausted = self.budget < 0
            pos = probe + 1


def scan_bytes(data: bytes | bytearray | memoryview, where: str, *,
               mode: str = "point_in_time") -> tuple[RecoveryReport, list[tuple[int, bytes]]]:
    """Every valid record of a log image: ``(report, [(lsn, payload), ...])`` (module docstring)."""
    policy = RECOVERY_MODES[check_choice("WAL recovery mode", mode, RECOVERY_MODES)]
    view = memoryview(data).cast("B")
    header = decode_header(view[:HEADER_BYTES], where)
    pos = valid_end = HEADER_BYTES
    lsn = header.base_lsn
    records: list[tuple[int, bytes]] = []
    damaged: list[tuple[int, int]] = []
    reason = ""
    search = _Search(view, header.epoch)
    while pos < len(view):
        end = _valid_at(view, pos, header.epoch, lsn)
        if end >= 0 and _REC.unpack_from(view, pos)[2] == lsn:
            records.append((lsn, bytes(view[pos + RECORD_HEADER_BYTES : end])))
            pos, lsn, valid_end = end, lsn + 1, end
            continue
        bad = f"bad or torn record at byte {pos} (expected lsn {lsn})"
        later = search.valid_after(pos, lsn)
        first = next(later, None)
        if first is None and search.exhausted and policy.refuse_acknowledged_after:
            raise WalCorruptionError(
                f"{where}: {bad}, followed by more invalid record headers than recovery checks "
                f"({SEARCH_BUDGET_FACTOR}x the file size in claimed payload bytes), so whether an acknowledged "
                f"record follows cannot be told (mode='truncate' would drop everything from byte {pos})")
        if first is None:
            reason = f"{bad}; {len(view) - pos} bytes dropped" + (
                " (gave up the search for valid records: too many invalid record headers)" if search.exhausted
                else "")
            break
        first_off, first_lsn, _ = first
        if policy.skip_damage:
            damaged.append((lsn, first_lsn - 1))
            pos, lsn = first_off, first_lsn
            continue
        acked = next((r for r in itertools.chain([first], later) if r[2] >= lsn), None)
        if search.exhausted and policy.refuse_acknowledged_after and acked is None:
            raise WalCorruptionError(
                f"{where}: {bad}; too many invalid record headers follow to tell whether an acknowledged "
                f"record does (mode='truncate' would drop everything from byte {pos})")
        if policy.refuse_any_valid_after or (policy.refuse_acknowledged_after and acked is not None):
            off, later_lsn, durable = acked if acked is not None else first
            what = (f"record {later_lsn} says lsn {durable} was acknowledged" if acked is not None
                    else f"a valid record (lsn {later_lsn}) follows")
            raise WalCorruptionError(
                f"{where}: {bad}, but {what} at byte {off}: the log is damaged in the middle, not torn "
                f"(mode='truncate' would drop everything from byte {pos})"
            )
        what = (f"were dropped although lsn {lsn} was acknowledged" if acked is not None
                else "were unacknowledged and dropped")
        reason = f"{bad}; later records (first lsn {first_lsn} at byte {first_off}) {what}"
        break
    report = RecoveryReport(header, len(records), lsn - 1, valid_end, len(view), reason, tuple(damaged))
    return report, records


def scan(path: str | os.PathLike, *, mode: str = "point_in_time",
         fs: FileSystem | None = None) -> tuple[RecoveryReport, list[tuple[int, bytes]]]:
    """Read every valid record of a log file: ``(report, [(lsn, payload), ...])``."""
    check_choice("WAL recovery mode", mode, RECOVERY_MODES)
    where = os.fspath(path)
    return scan_bytes((fs or RealFs()).read_file(where), where, mode=mode)


WRITE_ERROR_POLICIES = ("fail", "rollback")


class WalWriter:
    """Appends records to one log file; see the module docstring for the durability contract.

    Made by :meth:`create` (a new file) or :meth:`reopen` (continue a scanned one).
    """

    def __init__(self, path: str | os.PathLike, *, fs: FileSystem | None = None,
                 group_bytes: int = DEFAULT_GROUP_BYTES, on_write_error: str = "fail") -> None:
        self.path = os.fspath(path)
        self.fs = fs if fs is not None else RealFs()
        self.group_bytes = check_int("group_bytes", group_bytes, 1)
        self.on_write_error = check_choice("on_write_error", on_write_error, WRITE_ERROR_POLICIES)
        self._buf = bytearray()
        self._buf_records = 0
        self._fd = -1
        self._failed: BaseException | None = None
        self._last_start: int | None = None  # file offset of the last appended record (retract)
        self.bytes_written = 0

    # -- creation / reopening ---------------------------------------------------------------
    @classmethod
    def create(cls, path: str | os.PathLike, base_lsn: int, *, records: Iterable[bytes] = (),
               **kw) -> "WalWriter":
        """Atomically create a fresh log with a new epoch holding ``records`` (acknowledged when
        this returns): temp file, fsync, rename, fsync directory. On any error the handle is closed and
        the temp file removed (a directory fsync failure leaves the renamed file, its name not durable)."""
        if isinstance(base_lsn, bool) or not isinstance(base_lsn, int) or not 1 <= base_lsn <= MAX_LSN:
            raise ValueError(f"WAL base_lsn must be an int in [1, 2**64 - 1], got {base_lsn!r}")
        w = cls(path, **kw)
        fs, tmp = w.fs, w.path + ".tmp"
        if fs.exists(tmp):
            fs.unlink(tmp)
        fd = fs.open(tmp, CREATE_EXCL)
        try:
            header = WalHeader(secrets.randbits(64), base_lsn)
            fs.pwrite(fd, encode_header(header.epoch, base_lsn), 0)
            w._open(fd, header, HEADER_BYTES, base_lsn)
            w.bytes_written += HEADER_BYTES
            for payload in records:
                w.append(payload)
            w._write_buffer()
            fs.fsync(fd)
            fs.rename(tmp, w.path)
            fs.fsync_dir(os.path.dirname(w.path) or ".")
        except BaseException:
            w._fd = -1
            try:
                fs.close(fd)
            finally:
                if fs.exists(tmp):
                    fs.unlink(tmp)
            raise
        w.durable_lsn, w.durable_bytes = w.next_lsn - 1, w._size
        return w

    @classmethod
    def reopen(cls, path: str | os.PathLike, report: RecoveryReport, **kw) -> "WalWriter":
        """Continue a recovered log: drop its torn tail and append after its last valid record."""
        w = cls(path, **kw)
        fd = w.fs.open(w.path, READ_WRITE)
        try:
            if report.file_bytes != report.valid_bytes:
                w.fs.truncate(fd, report.valid_bytes)
            w.fs.fsync(fd)  # what recovery replayed is durable before anything builds on it
        except BaseException:
            w.fs.close(fd)
            raise
        w._open(fd, report.header, report.valid_bytes, report.last_lsn + 1)
        return w

    def _open(self, fd: int, header: WalHeader, size: int, next_lsn: int) -> None:
        self.header = header
        self._fd = fd
        self._size = size
        self.next_lsn = next_lsn
        self.durable_lsn = next_lsn - 1
        self.durable_bytes = size

    # -- appending ----------------------------------------------------------------------------
    @property
    def failed(self) -> BaseException | None:
        """The error that turned the log read-only, or None."""
        return self._failed

    def _check(self) -> None:
        if self._failed is not None:
            raise WalFailedError(getattr(self._failed, "errno", None),
                                 f"{self.path}: an earlier write/fsync failed ({self._failed}); log is read-only")
        if self._fd < 0:
            raise WalError(f"{self.path}: log is closed")

    def append(self, payload: bytes | bytearray | memoryview) -> int:
        """Buffer one record; returns its LSN (acknowledged only after ``sync``). Any other
        C-contiguous buffer is logged as its bytes (``nbytes``, whatever its item size); a
        non-contiguous one is refused with TypeError, nothing appended."""
        self._check()
        if type(payload) is not bytes and type(payload) is not bytearray:
            payload = check_buffer("WAL payload", payload)
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise ValueError(f"WAL payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
        lsn, durable = self.next_lsn, self.durable_lsn
        if lsn > MAX_LSN:
            raise WalError(f"{self.path}: the LSN space is exhausted (next lsn {lsn} > 2**64 - 1); "
                           "start a new log with a lower base LSN")
        self._last_start = self._size + len(self._buf)
        self._buf += _REC.pack(len(payload), _record_crc(self.header.epoch, lsn, durable, payload), lsn, durable)
        self._buf += payload
        self._buf_records += 1
        self.next_lsn += 1
        if len(self._buf) >= self.group_bytes:
            self._write_buffer()
        return lsn

    def retract(self, lsn: int) -> None:
        """Withdraw record ``lsn``, the last one appended and unacknowledged: dropped from the buffer,
        or cut off the file and fsynced (so no crash brings it back; the records before it become
        durable). WalError if ``lsn`` is not such a record; a failed truncate or fsync fails the log."""
        self._check()
        start = self._last_start
        if lsn != self.next_lsn - 1 or lsn <= self.durable_lsn or start is None:
            raise WalError(f"{self.path}: cannot retract lsn {lsn}: only the last appended record, while it is "
                           f"unacknowledged, can be (next lsn {self.next_lsn}, durable lsn {self.durable_lsn})")
        if start >= self._size:
            del self._buf[start - self._size :]
            self._buf_records -= 1
        else:  # written by a group write: the buffer is empty and the file ends with this record
            try:
                self.fs.truncate(self._fd, start)
                self.fs.fdatasync(self._fd)
            except OSError as exc:
                self._failed = exc
                raise WalFailedError(exc.errno, f"{self.path}: retracting lsn {lsn} failed ({exc}); the record may "
                                                f"still be in the file; log is read-only") from exc
            self._size = self.durable_bytes = start
            self.durable_lsn = lsn - 1
        self.next_lsn = lsn
        self._last_start = None

    def write(self) -> None:
        """Write the buffered records to the file without syncing (they stay unacknowledged)."""
        self._check()
        self._write_buffer()

    def _write_buffer(self) -> None:
        if not self._buf:
            return
        try:
            self.fs.pwrite(self._fd, self._buf, self._size)
        except OSError as exc:
            self._undo_write(exc)
        self._size += len(self._buf)
        self.bytes_written += len(self._buf)
        self._buf.clear()
        self._buf_records = 0

    def _undo_write(self, exc: OSError) -> None:
        """Truncate back to the last written record, discard the buffer, and raise (module docstring)."""
        first = self.next_lsn - self._buf_records
        lost = (first, self.next_lsn - 1)
        self._buf.clear()
        self._buf_records = 0
        self._last_start = None
        self.next_lsn = first
        try:
            self.fs.truncate(self._fd, self._size)
        except OSError as exc2:
            self._failed = exc2
            raise WalFailedError(exc.errno, f"{self.path}: write failed ({exc}) and could not be undone "
                                            f"({exc2}); log is read-only") from exc
        if self.on_write_error == "fail":
            self._failed = exc
            raise WalFailedError(exc.errno, f"{self.path}: write failed ({exc}); records {lost[0]}..{lost[1]} "
                                            f"were discarded; log is read-only") from exc
        raise WalWriteError(exc.errno, f"{self.path}: write failed ({exc}); records {lost[0]}..{lost[1]} were "
                                       f"discarded and undone", lost) from exc

    def sync(self) -> int:
        """Write and fsync everything appended; returns the durable LSN."""
        self._check()
        if self.durable_lsn == self.next_lsn - 1 and not self._buf:
            return self.durable_lsn
        self._write_buffer()
        try:
            self.fs.fdatasync(self._fd)
        except OSError as exc:
            self._failed = exc
            raise WalFailedError(exc.errno, f"{self.path}: fsync failed ({exc}); not retrying") from exc
        self.durable_lsn = self.next_lsn - 1
        self.durable_bytes = self._size
        return self.durable_lsn

    @property
    def size_bytes(self) -> int:
        return self._size + len(self._buf)

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def __enter__(self) -> "WalWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Sync and close (a failed log is closed without syncing)."""
        if self._fd < 0:
            return
        try:
            if self._failed is None:
                self.sync()
        finally:
            fd, self._fd = self._fd, -1
            self.fs.close(fd)


__all__ = [
    "DEFAULT_GROUP_BYTES",
    "HEADER_BYTES",
    "MAGIC",
    "MAX_LSN",
    "MAX_PAYLOAD_BYTES",
    "RECORD_HEADER_BYTES",
    "RECOVERY_MODES",
    "RecoveryMode",
    "RecoveryReport",
    "WRITE_ERROR_POLICIES",
    "WalCorruptionError",
    "WalError",
    "WalFailedError",
    "WalHeader",
    "WalIOError",
    "WalWriteError",
    "WalWriter",
    "decode_header",
    "encode_header",
    "scan",
    "scan_bytes",
]
