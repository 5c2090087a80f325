"""A write-ahead log of opaque records with crc32c, a per-file epoch, group commit and recovery.

File layout (little-endian):

- header, 32 bytes: ``magic "QCWAL\\0\\1\\0"`` | epoch u64 | base_lsn u64 | reserved u32 | crc32c u32
  (the crc covers the 28 bytes before it);
- records: ``payload_len u32 | crc u32 | lsn u64 | durable_lsn u64 | payload``, where
  ``crc = crc32c(epoch u64 || lsn u64 || durable_lsn u64 || payload_len u32 || payload)`` and
  ``durable_lsn`` is the highest LSN already acknowledged (fsynced) when the record was appended.

Invariants and contract:
- LSNs are consecutive: the first record of a file has ``base_lsn``, each next one +1. Because the
  epoch (random per file) is inside every record's crc, stale bytes of a recycled or older file
  never validate as records of this one.
- ``append`` only buffers; a record is *acknowledged* (durable) once ``sync()`` returned. The
  buffer is written (not synced) whenever it exceeds ``group_bytes``, so memory stays bounded.
- If ``fsync`` fails the log never trusts the file again: the writer turns failed and refuses
  every later call (REFERENCE §7: never retry an fsync).
- Recovery reads records until the first one that is truncated, fails its crc or breaks the LSN
  sequence (at LSN L). What happens next is an explicit mode:

  - ``"point_in_time"`` (default, RocksDB's default too): stop at L and drop the rest — unless a
    valid later record says ``durable_lsn >= L``, which proves an *acknowledged* record is damaged;
    that is refused with :class:`WalCorruptionError`. So unacknowledged bytes garbled by a crash
    (SQLite-style torn, dropped or garbled unsynced writes) are dropped, and acknowledged data is
    never dropped silently when the log itself holds evidence of it;
  - ``"strict"``: any valid record after a bad one is refused (only a clean torn tail is dropped);
  - ``"truncate"``: always stop at L and drop the rest (best-effort salvage).

  The dropped tail is truncated when the file is reopened for appending.
"""

from __future__ import annotations

import os
import secrets
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import crc32c as _crc

MAGIC = b"QCWAL\x00\x01\x00"
_HEADER = struct.Struct("<8sQQI")  # magic, epoch, base_lsn, reserved; crc u32 follows
HEADER_BYTES = _HEADER.size + 4
_REC = struct.Struct("<IIQQ")  # payload_len, crc, lsn, durable_lsn
RECORD_HEADER_BYTES = _REC.size
MAX_PAYLOAD_BYTES = 256 << 20
_LSN_LOOKAHEAD = 1 << 20


class WalError(RuntimeError):
    """Base class of WAL errors."""


class WalCorruptionError(WalError):
    """The log holds damaged bytes that are not a torn tail (or its header is damaged)."""


class WalFailedError(WalError):
    """A previous write or fsync failed; the log refuses further use."""


def _record_crc(epoch: int, lsn: int, durable_lsn: int, payload: bytes | memoryview) -> int:
    c = _crc.crc32c(struct.pack("<QQQI", epoch, lsn, durable_lsn, len(payload)))
    return _crc.crc32c(payload, c)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class WalHeader:
    epoch: int
    base_lsn: int


@dataclass(frozen=True)
class RecoveryReport:
    """What recovery found: records ``base_lsn .. last_lsn`` were valid and end at ``valid_bytes``."""

    header: WalHeader
    num_records: int
    last_lsn: int  # base_lsn - 1 when the log holds no valid record
    valid_bytes: int
    file_bytes: int
    dropped_reason: str  # "" when the file ended cleanly

    @property
    def dropped_bytes(self) -> int:
        return self.file_bytes - self.valid_bytes


def encode_header(epoch: int, base_lsn: int) -> bytes:
    body = _HEADER.pack(MAGIC, epoch, base_lsn, 0)
    return body + struct.pack("<I", _crc.crc32c(body))


def decode_header(buf: bytes, where: str) -> WalHeader:
    if len(buf) < HEADER_BYTES:
        raise WalCorruptionError(f"{where}: {len(buf)} bytes is too short for a WAL header ({HEADER_BYTES})")
    body, (crc,) = buf[: _HEADER.size], struct.unpack_from("<I", buf, _HEADER.size)
    magic, epoch, base_lsn, _ = _HEADER.unpack(body)
    if magic != MAGIC:
        raise WalCorruptionError(f"{where}: not a QuillCache WAL (magic {magic!r})")
    if _crc.crc32c(body) != crc:
        raise WalCorruptionError(f"{where}: WAL header checksum mismatch")
    return WalHeader(epoch, base_lsn)


def _valid_at(data: memoryview, pos: int, epoch: int, min_lsn: int) -> int:
    """End offset of a valid record at ``pos`` with lsn >= min_lsn, or -1."""
    end = len(data)
    if pos + RECORD_HEADER_BYTES > end:
        return -1
    length, crc, lsn, durable = _REC.unpack_from(data, pos)
    if length > MAX_PAYLOAD_BYTES or pos + RECORD_HEADER_BYTES + length > end:
        return -1
    if not min_lsn <= lsn < min_lsn + _LSN_LOOKAHEAD or durable >= lsn:
        return -1
    payload = data[pos + RECORD_HEADER_BYTES : pos + RECORD_HEADER_BYTES + length]
    if _record_crc(epoch, lsn, durable, payload) != crc:
        return -1
    return pos + RECORD_HEADER_BYTES + length


def _candidates(data: memoryview, start: int, lsn: int) -> Iterator[int]:
    """Offsets >= start where a record with an lsn in [lsn, lsn + lookahead) could begin: its lsn
    field's upper five bytes must match, which a cheap ``bytes.find`` locates."""
    raw = bytes(data)
    seen: set[int] = set()
    for high in {lsn >> 24, (lsn + _LSN_LOOKAHEAD) >> 24}:
        pattern = high.to_bytes(5, "little")
        i = raw.find(pattern, start + 11)
        while i >= 0:
            rec = i - 11  # lsn field at rec + 8, its bytes 3..7 at rec + 11
            if rec not in seen:
                seen.add(rec)
                yield rec
            i = raw.find(pattern, i + 1)


RECOVERY_MODES = ("point_in_time", "strict", "truncate")


def scan(path: str | os.PathLike, *, mode: str = "point_in_time") -> tuple[RecoveryReport, list[tuple[int, bytes]]]:
    """Read every valid record of a log file: ``(report, [(lsn, payload), ...])``."""
    if mode not in RECOVERY_MODES:
        raise ValueError(f"WAL recovery mode must be one of {RECOVERY_MODES}, got {mode!r}")
    p = Path(path)
    data = memoryview(p.read_bytes())
    header = decode_header(bytes(data[:HEADER_BYTES]), str(p))
    pos, lsn, records = HEADER_BYTES, header.base_lsn, []
    reason = ""
    while pos < len(data):
        end = _valid_at(data, pos, header.epoch, lsn)
        if end < 0 or _REC.unpack_from(data, pos)[2] != lsn:
            reason = f"bad or torn record at byte {pos} (expected lsn {lsn})"
            break
        records.append((lsn, bytes(data[pos + RECORD_HEADER_BYTES : end])))
        pos, lsn = end, lsn + 1
    if reason:
        # Is this a torn tail, or does a valid later record prove mid-log corruption?
        for probe in _candidates(data, pos + 1, lsn):
            if _valid_at(data, probe, header.epoch, lsn) < 0:
                continue
            later_lsn, durable = _REC.unpack_from(data, probe)[2:]
            acked = durable >= lsn
            if mode == "strict" or (mode == "point_in_time" and acked):
                what = (f"record {later_lsn} says lsn {durable} was acknowledged" if acked
                        else f"a valid record (lsn {later_lsn}) follows")
                raise WalCorruptionError(
                    f"{p}: {reason}, but {what} at byte {probe}: the log is damaged in the middle, not torn "
                    f"(mode='truncate' would drop everything from byte {pos})"
                )
            reason += f"; later records (first lsn {later_lsn} at byte {probe}) were unacknowledged and dropped"
            break
    report = RecoveryReport(header, len(records), lsn - 1, pos, len(data), reason)
    return report, records


class WalWriter:
    """Appends records to one log file; see the module docstring for the durability contract."""

    def __init__(self, path: str | os.PathLike, *, group_bytes: int = 1 << 20) -> None:
        self.path = Path(path)
        self.group_bytes = group_bytes
        self._buf = bytearray()
        self._fh = None
        self._failed: BaseException | None = None
        self.bytes_written = 0

    # -- creation / reopening ---------------------------------------------------------------
    @classmethod
    def create(cls, path: str | os.PathLike, base_lsn: int, **kw) -> "WalWriter":
        """Atomically create a fresh log (temp file, fsync, rename, fsync dir) with a new epoch."""
        w = cls(path, **kw)
        epoch = secrets.randbits(64)
        tmp = w.path.with_name(w.path.name + ".tmp")
        with open(tmp, "wb") as fh:
            fh.write(encode_header(epoch, base_lsn))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, w.path)
        _fsync_dir(w.path.parent)
        w._open(WalHeader(epoch, base_lsn), HEADER_BYTES, base_lsn)
        w.bytes_written += HEADER_BYTES
        return w

    @classmethod
    def reopen(cls, path: str | os.PathLike, report: RecoveryReport, **kw) -> "WalWriter":
        """Continue a recovered log: drop its torn tail and append after its last valid record."""
        w = cls(path, **kw)
        w._open(report.header, report.valid_bytes, report.last_lsn + 1)
        if report.file_bytes != report.valid_bytes:
            os.ftruncate(w._fh.fileno(), report.valid_bytes)
        os.fsync(w._fh.fileno())  # what recovery replayed is durable before anything builds on it
        return w

    def _open(self, header: WalHeader, size: int, next_lsn: int) -> None:
        self.header = header
        self._fh = open(self.path, "r+b", buffering=0)
        self._fh.seek(size)
        self._size = size
        self.next_lsn = next_lsn
        self.durable_lsn = next_lsn - 1
        self.durable_bytes = size

    # -- appending ----------------------------------------------------------------------------
    def _check(self) -> None:
        if self._failed is not None:
            raise WalFailedError(f"{self.path}: an earlier write/fsync failed ({self._failed}); log is read-only")
        if self._fh is None:
            raise WalError(f"{self.path}: log is closed")

    def append(self, payload: bytes) -> int:
        """Buffer one record; returns its LSN (acknowledged only after ``sync``)."""
        self._check()
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise ValueError(f"WAL payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
        lsn, durable = self.next_lsn, self.durable_lsn
        self._buf += _REC.pack(len(payload), _record_crc(self.header.epoch, lsn, durable, payload), lsn, durable)
        self._buf += payload
        self.next_lsn += 1
        if len(self._buf) >= self.group_bytes:
            self._write_buffer()
        return lsn

    def _write_buffer(self) -> None:
        if not self._buf:
            return
        try:
            self._fh.write(self._buf)
        except OSError as exc:
            self._failed = exc
            raise WalFailedError(f"{self.path}: write failed ({exc})") from exc
        self._size += len(self._buf)
        self.bytes_written += len(self._buf)
        self._buf.clear()

    def sync(self) -> int:
        """Write and fsync everything appended; returns the durable LSN."""
        self._check()
        if self.durable_lsn == self.next_lsn - 1 and not self._buf:
            return self.durable_lsn
        self._write_buffer()
        try:
            os.fdatasync(self._fh.fileno())
        except OSError as exc:
            self._failed = exc
            raise WalFailedError(f"{self.path}: fsync failed ({exc}); not retrying") from exc
        self.durable_lsn = self.next_lsn - 1
        self.durable_bytes = self._size
        return self.durable_lsn

    @property
    def size_bytes(self) -> int:
        return self._size + len(self._buf)

    def close(self) -> None:
        """Sync and close (a failed log is closed without syncing)."""
        if self._fh is None:
            return
        try:
            if self._failed is None:
                self.sync()
        finally:
            self._fh.close()
            self._fh = None

