"""The SSD tier's log payloads, on top of the public write-ahead log :mod:`quillcache.durability.wal`.

Record format, header, checks, group commit and fsync rules are those of the WAL (crc32c over
epoch, LSN, durable LSN, length and payload; a random per-file epoch in every record, so stale
bytes of an older log generation never validate; all I/O through the tier's FileSystem). This
module only adds what is the tier's:

- the payloads: one log record per group commit, holding fixed 49-byte entries
  ``kind u8 | key 24 B | segment u32 | offset u64 | size u64 | crc u32`` (kind ``P`` put, ``D``
  delete). A log *generation* file starts with a snapshot of the live set (``S`` records) closed
  by one ``E`` record; a file without its ``E`` record is not a valid generation, unless the
  salvage scan reports damage where the ``E`` record was (generations are created complete, so
  then the damage took it; see ``SlabLayout._replay``);
- the policies it opens the WAL with: scans use the WAL's ``"salvage"`` mode (a damaged record
  that valid ones follow is skipped and its LSNs reported, instead of refusing the whole log: the
  tier is a cache, so losing the blocks a damaged record described is acceptable, serving wrong
  bytes is not, and every object carries its own crc32c, checked at recovery and on every read);
  writers use ``on_write_error="rollback"`` (a failed write, e.g. a full disk, is undone and the
  tier drops the blocks of that commit, then keeps going).
"""

from __future__ import annotations

import struct

from quillcache.durability.fs import FileSystem
from quillcache.durability.wal import RecoveryReport, WalWriter, scan

ENTRY = struct.Struct("<c24sIQQI")
ENTRY_BYTES = ENTRY.size  # 49
_RECORD_HEAD = struct.Struct("<cI")  # record kind, number of entries
KIND_BATCH, KIND_SNAPSHOT, KIND_END = b"B", b"S", b"E"
PUT, DEL = b"P", b"D"
SNAPSHOT_ENTRIES_PER_RECORD = 8192
SCAN_MODE = "salvage"
WRITE_ERROR_POLICY = "rollback"


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


def scan_generation(fs: FileSystem, path: str) -> tuple[RecoveryReport, list[tuple[int, bytes]]]:
    """Every valid record of one generation file, damaged stretches skipped and reported.

    Raises :class:`quillcache.durability.wal.WalCorruptionError` if the header itself is damaged.
    """
    return scan(path, mode=SCAN_MODE, fs=fs)


def create_generation(fs: FileSystem, path: str, base_lsn: int, records: list[bytes]) -> WalWriter:
    """A complete new generation file holding ``records``, durable (and its name too) on return."""
    return WalWriter.create(path, base_lsn, records=records, fs=fs, on_write_error=WRITE_ERROR_POLICY)


def reopen_generation(fs: FileSystem, path: str, report: RecoveryReport) -> WalWriter:
    """Continue appending to a scanned generation file."""
    return WalWriter.reopen(path, report, fs=fs, on_write_error=WRITE_ERROR_POLICY)
