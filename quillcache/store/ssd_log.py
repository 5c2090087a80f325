"""The SSD tier's write-ahead log: ``quillcache.durability.wal`` records, written and scanned through a FileSystem.

Record format, header and checks are exactly those of :mod:`quillcache.durability.wal` (crc32c over epoch,
LSN, durable LSN, length and payload; a random per-file epoch in every record, so stale bytes of an
older log generation never validate). This module only adds what the tier needs on top:

- I/O through :class:`quillcache.durability.fs.FileSystem` (so the crash simulator sees every write);
- *salvage* scanning: a record that fails its check while valid records follow is skipped (the
  damaged LSNs are reported), instead of refusing the whole log. The SSD tier is a cache: losing
  the blocks a damaged record described is acceptable, serving wrong bytes is not (every object
  carries its own crc32c, checked at recovery and on every read);
- the tier's payloads: one log record per group commit, holding fixed 49-byte entries
  ``kind u8 | key 24 B | segment u32 | offset u64 | size u64 | crc u32`` (kind ``P`` put, ``D``
  delete). A log *generation* file starts with a snapshot of the live set (``S`` records) closed
  by one ``E`` record; a file without its ``E`` record is not a valid generation.
"""

from __future__ import annotations

import secrets
import struct
from dataclasses import dataclass, field

from quillcache.durability import wal as _wal
from quillcache.durability.fs import FileSystem

ENTRY = struct.Struct("<c24sIQQI")
ENTRY_BYTES = ENTRY.size  # 49
_RECORD_HEAD = struct.Struct("<cI")  # record kind, number of entries
KIND_BATCH, KIND_SNAPSHOT, KIND_END = b"B", b"S", b"E"
PUT, DEL = b"P", b"D"
SNAPSHOT_ENTRIES_PER_RECORD = 8192


def encode_record(kind: bytes, entries: list[bytes]) -> bytes:
    return _RECORD_HEAD.pack(kind, len(entries)) + b"".join(entries)


def decode_record(payload: bytes) -> tuple[bytes, list[tuple]]:
    """``(kind, [entry tuples])``; ValueError if the payload is not one of ours."""
    if len(payload) < _RECORD_HEAD.size:
        raise ValueError(f"log record of {len(payload)} bytes is too short")
    kind, n = _RECORD_HEAD.unpack_from(payload, 0)
    if kind not in (KIND_BATCH, KIND_SNAPSHOT, KIND_END) or len(payload) != _RECORD_HEAD.size + n * ENTRY_BYTES:
        raise ValueError(f"log record kind {kind!r} with {n} entries has {len(payload)} bytes")
    return kind, [ENTRY.unpack_from(payload, _RECORD_HEAD.size + i * ENTRY_BYTES) for i in range(n)]


@dataclass(frozen=True)
class LogScan:
    """What one log file held: its valid records in LSN order, and what was skipped and why."""

    epoch: int
    base_lsn: int
    records: list[tuple[int, bytes]]
    valid_bytes: int  # end of the last valid record
    file_bytes: int
    damaged_lsns: tuple[tuple[int, int], ...] = field(default=())  # [first, last] ranges skipped
    tail_reason: str = ""  # why the scan stopped before the end of the file ("" = clean end)


def scan_bytes(data: bytes, where: str) -> LogScan:
    """Every valid record of a log image, skipping damaged records that valid ones follow.

    Raises :class:`quillcache.durability.wal.WalCorruptionError` if the header itself is damaged.
    """
    header = _wal.decode_header(data[: _wal.HEADER_BYTES], where)
    view = memoryview(data)
    pos, lsn = _wal.HEADER_BYTES, header.base_lsn
    records: list[tuple[int, bytes]] = []
    damaged: list[tuple[int, int]] = []
    reason = ""
    valid_end = pos
    while pos < len(data):
        end = _wal._valid_at(view, pos, header.epoch, lsn)
        if end >= 0 and _wal._REC.unpack_from(view, pos)[2] == lsn:
            records.append((lsn, bytes(view[pos + _wal.RECORD_HEADER_BYTES : end])))
            pos, lsn, valid_end = end, lsn + 1, end
            continue
        # Not a valid record here: is a valid later record further on (damage), or is this the tail?
        nxt = None
        for probe in _wal._candidates(view, pos + 1, lsn):
            if _wal._valid_at(view, probe, header.epoch, lsn) >= 0:
                if nxt is None or probe < nxt:
                    nxt = probe
        if nxt is None:
            reason = f"{where}: bad or torn record at byte {pos} (expected lsn {lsn}); {len(data) - pos} bytes dropped"
            break
        later = _wal._REC.unpack_from(view, nxt)[2]
        damaged.append((lsn, later - 1))
        pos, lsn = nxt, later
    return LogScan(header.epoch, header.base_lsn, records, valid_end, len(data), tuple(damaged), reason)


class LogWriter:
    """Appends records to one log generation file through a FileSystem.

    ``append`` buffers; ``commit`` writes and fdatasyncs (the group commit) and returns the durable
    LSN. A failed write is undone by truncating back to the last durable size (so later records
    never follow garbage); a failed fsync is never retried: the writer refuses every later call.
    """

    def __init__(self, fs: FileSystem, path: str, fd: int, epoch: int, size_bytes: int, next_lsn: int) -> None:
        self.fs, self.path, self.fd, self.epoch = fs, path, fd, epoch
        self.size_bytes = size_bytes
        self.next_lsn = next_lsn
        self.durable_lsn = next_lsn - 1
        self._buf = bytearray()
        self.failed: BaseException | None = None

    @classmethod
    def create(cls, fs: FileSystem, path: str, base_lsn: int, records: list[bytes]) -> "LogWriter":
        """Write a complete new generation (header, ``records``) to ``path.tmp``, fdatasync it and
        rename it to ``path`` (the caller fsyncs the directory). The tmp file is removed on error."""
        tmp = path + ".tmp"
        if fs.exists(tmp):
            fs.unlink(tmp)
        fd = fs.open(tmp, "x")
        try:
            epoch = secrets.randbits(64)
            w = cls(fs, path, fd, epoch, _wal.HEADER_BYTES, base_lsn)
            fs.pwrite(fd, _wal.encode_header(epoch, base_lsn), 0)
            for rec in records:
                w.append(rec)
            w.commit()
            fs.rename(tmp, path)
        except BaseException:
            try:
                fs.close(fd)
            finally:
                if fs.exists(tmp):
                    fs.unlink(tmp)
            raise
        return w

    def append(self, payload: bytes) -> int:
        lsn, durable = self.next_lsn, self.durable_lsn
        crc = _wal._record_crc(self.epoch, lsn, durable, payload)
        self._buf += _wal._REC.pack(len(payload), crc, lsn, durable)
        self._buf += payload
        self.next_lsn += 1
        return lsn

    def discard(self) -> None:
        """Forget buffered (unwritten) records."""
        self.next_lsn = self.durable_lsn + 1
        self._buf.clear()

    def commit(self) -> int:
        if self.failed is not None:
            raise OSError(f"{self.path}: an earlier log write/fsync failed ({self.failed})")
        if not self._buf:
            return self.durable_lsn
        try:
            self.fs.pwrite(self.fd, self._buf, self.size_bytes)
        except OSError:
            # undo the partial write so that later records never follow garbage
            self._buf.clear()
            self.next_lsn = self.durable_lsn + 1
            try:
                self.fs.truncate(self.fd, self.size_bytes)
            except OSError as exc2:
                self.failed = exc2
            raise
        new_size = self.size_bytes + len(self._buf)
        try:
            self.fs.fdatasync(self.fd)
        except OSError as exc:
            self.failed = exc
            raise
        self._buf.clear()
        self.size_bytes = new_size
        self.durable_lsn = self.next_lsn - 1
        return self.durable_lsn

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            self.fs.close(fd)
