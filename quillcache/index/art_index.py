"""Persistent ART backend: two adaptive radix trees, a crc32c write-ahead log and checkpoints.

Longer than 600 lines because opening (lock, checkpoint, log replay), the logged batches, checkpointing and
closing share the index's failure state (a batch refused after it was logged fails the index; a failed log or
a damaged checkpoint still lets it close), which is the module's invariant; the trees, the WAL and the key
layout are modules of their own.

Structure. Primary records (``B`` keys, 16-byte values) live in one :class:`ArtTree`, secondary
records (``N`` keys, no value) in a second one, and the tiny node-name table (``M`` keys) in a
dict. Every ``put``/``remove`` batch is one WAL record (:mod:`quillcache.durability.wal`) and is then applied
to the trees in memory.

Durability contract. Every WAL and checkpoint byte goes through the
:class:`quillcache.durability.fs.FileSystem` passed as ``fs`` (default ``RealFs``), so the whole
contract also runs, and is tested, on the crash simulator ``CrashFs``. A batch is acknowledged
once ``flush()`` returned (the WAL was fsynced). A checkpoint writes both arenas, as they are,
into ``art.ckpt`` (temp file written and fsynced, renamed, directory fsynced) together with the
LSN it covers, then starts a fresh WAL (new epoch, created the same way) at the next LSN. The
checkpoint is durably in place BEFORE the WAL is replaced, so at every instant the pair on disk
(checkpoint at LSN c, WAL holding LSNs ≤ c or continuing at c+1) describes every acknowledged
batch.

Recovery (``open``): read and verify the checkpoint header (crc32c), map the file copy-on-write
(``FileSystem.map_copy``; a file system that cannot map files, like ``CrashFs``, reads it into a
private buffer instead) and attach the trees in O(1) — no rebuild, no walk — then replay the WAL
records past the checkpoint LSN. The checkpoint stores a CRC-32C per chunk
of each arena (16 KiB chunks); with ``verify_checkpoint="lazy"`` (default) the tree verifies a chunk the first
time any operation touches it (RocksDB-style per-block checks), so a damaged chunk raises
:class:`IndexCorruptionError` before any answer is built from it; ``"eager"`` verifies every chunk
at open. A torn WAL tail (a crash during an
unacknowledged append) is dropped. What the log proves damaged is refused with
:class:`IndexCorruptionError` naming the file and offset, and no file is modified: a bad checkpoint
crc, a gap in LSNs, and (in the default ``wal_recovery="point_in_time"``) a bad record followed by a
valid one that says the bad one was acknowledged; valid records after a bad one that do not say so
are an unacknowledged tail and dropped (``"strict"`` refuses any valid record after a bad one;
see :mod:`quillcache.durability.wal`). A dropped tail is never silent: it is in
``recovery_report`` (bytes, reason) and announced with :class:`IndexRecoveryWarning` (a tail cut
by truncation looks like a crash's torn tail, so the log alone cannot prove it held nothing
acknowledged). A log missing next to a checkpoint is refused (it may have held acknowledged
batches past the checkpoint) unless ``on_missing_wal="checkpoint"`` accepts the checkpoint alone.
A checkpoint or log that cannot be read (a directory in its place, a read error) is refused with
:class:`NotAnIndexError` naming the file.

One index per directory. Two writers appending to one log overwrite each other's records, so on the real
file system ``open`` takes the :class:`~quillcache.durability.dirlock.DataDirLock` ``<dir>/art.lock``
before reading anything in the directory, and holds it until ``close()`` (a failed open releases it): a
second opener, in this process or another, is refused with
:class:`~quillcache.durability.dirlock.DataDirInUseError` naming the directory and the holder. A
simulated file system (``CrashFs``) lives in one process's memory and takes no lock.

A refused batch leaves nothing behind. Each batch is checked against the key layout before it
is logged; if applying a logged batch still fails (MemoryError while an arena grows, a corrupt
chunk found on first touch) the trees may hold part of it, so its record is withdrawn from the log
(``WalWriter.retract``: dropped from the buffer, or cut off the file and synced) and the index
turns failed: every later call but ``close()`` raises :class:`IndexFailedError`, ``close()`` syncs
the log without a checkpoint, and reopening recovers exactly the batches accepted before.
Node names enter the name table only once their batch is applied.

WAL payload (:mod:`quillcache.index.art_wal`). A batch is logged as its logical operations: primary
records and node-name entries only, since every secondary (``N``) key is a permutation of a
primary key's fields and is derived again on replay; the encoded batch is compressed with zlib
(level 1: identities, node numbers and values repeat within a batch). The crc32c of the WAL
record covers the compressed bytes, so damage is caught before decompression.

Write cost. Each record is written to the WAL once; checkpoints rewrite the arenas, so they are
taken at ``close()`` and, while running, only when the WAL has grown past
``checkpoint_wal_ratio`` × the arena bytes (and ``checkpoint_min_wal_bytes``): the amortised
checkpoint cost is at most 1/ratio of the WAL bytes. A crash between checkpoints costs replay
time, never data.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path

import crc32c as _crc
import msgpack
import numpy as np

from quillcache.art.tree import ArenaMeta, ArtTree
from quillcache.index import keys as K
from quillcache.index.base import (PRIMARY_KEY_DTYPE, VALUE_DTYPE, IndexBackend, IndexCorruptionError, LocateResult,
                                   NotAnIndexError)
from quillcache._checks import check_choice
from quillcache.durability.dirlock import DataDirLock
from quillcache.durability.fs import CREATE_EXCL, READ, FileSystem, RealFs
from quillcache.durability.wal import RECOVERY_MODES, WalCorruptionError, WalError, WalFailedError, WalWriter, scan
from quillcache.index.art_wal import (  # noqa: F401  (encode_wal_batch, decode_wal_batch: re-exported)
    Batch, decode_wal_batch, encode_wal_batch, encode_wal_columns, split_batch)

CHECKPOINT = "art.ckpt"
WAL = "art.wal"
LOCK = "art.lock"  # the DataDirLock of the directory (real file system only)
_CKPT_MAGIC = b"QCARTCK2"  # 2: arena meta as a packed ArenaMeta record
_OLD_CKPT_MAGICS = {b"QCARTCK1": "format 1 (dict arena meta)"}
_PAGE = 4096
CHUNK_BYTES = 16 << 10
_PRIMARY_BYTE = K.PRIMARY[0]
# replay needs consecutive batches, so the WAL's skipping mode ("salvage") is not offered
WAL_RECOVERY_MODES = tuple(name for name, mode in RECOVERY_MODES.items() if not mode.skip_damage)
ON_MISSING_WAL = ("refuse", "checkpoint")


class IndexRecoveryWarning(UserWarning):
    """Reopening dropped a log tail (see ``recovery_report``): normal after a crash, but said out loud."""


class IndexFailedError(RuntimeError):
    """A batch was refused part-way through being applied (after it was logged): the index refuses
    every call but ``close()``; reopening it recovers the batches accepted before."""


def _corruption_guard(fn):
    """Turn the tree's ``ValueError("corrupt arena ...")`` (a chunk failed its checksum when first
    touched, or a structural check failed) into :class:`IndexCorruptionError` naming the index."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except NotAnIndexError:
            raise  # already named (a guarded method called from another one)
        except ValueError as exc:
            if "corrupt arena" in str(exc):
                raise IndexCorruptionError(f"{self.path}: {exc}") from None
            raise

    return wrapper


def _unreadable(path: str, exc: OSError) -> NotAnIndexError:
    """The typed refusal of a file of the index that cannot be opened or read, naming it once."""
    return NotAnIndexError(f"{path}: cannot read: {exc.strerror or exc}")


def _round_up(n: int, to: int = _PAGE) -> int:
    return (n + to - 1) // to * to


def _make_dirs(fs: FileSystem, path: str) -> None:
    """Create ``path`` and its missing parents, fsyncing the parent of each one created."""
    if fs.is_dir(path):
        return
    parent = os.path.dirname(path.rstrip("/"))
    if parent not in ("", "/", path) and not fs.exists(parent):
        _make_dirs(fs, parent)
    fs.mkdir(path)
    fs.fsync_dir(parent or ".")


class ArtIndex(IndexBackend):
    kind = "art"
    _packed_prefix_arrays = True

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        checkpoint_wal_ratio: float = 4.0,
        checkpoint_min_wal_bytes: int = 64 << 20,
        wal_recovery: str = "point_in_time",
        verify_checkpoint: str = "lazy",
        on_missing_wal: str = "refuse",
        initial_arena_bytes: int = 1 << 20,
        fs: FileSystem | None = None,
    ) -> None:
        super().__init__(path)
        if verify_checkpoint not in ("lazy", "eager"):
            raise ValueError(f"verify_checkpoint must be 'lazy' or 'eager', got {verify_checkpoint!r}")
        check_choice("wal_recovery", wal_recovery, WAL_RECOVERY_MODES)
        check_choice("on_missing_wal", on_missing_wal, ON_MISSING_WAL)
        if fs is not None and not isinstance(fs, FileSystem):
            raise TypeError(f"fs must be a quillcache.durability.fs.FileSystem, got {type(fs).__name__}")
        self.fs = fs if fs is not None else RealFs()
        if not checkpoint_wal_ratio > 0:
            raise ValueError(f"checkpoint_wal_ratio must be > 0, got {checkpoint_wal_ratio}")
        self.checkpoint_wal_ratio = checkpoint_wal_ratio
        self.checkpoint_min_wal_bytes = checkpoint_min_wal_bytes
        self._ckpt_buf: mmap.mmap | bytearray | None = None  # the attached checkpoint image
        self._failed: BaseException | None = None  # why a batch was refused part-way (IndexFailedError)
        self._names: dict[bytes, bytes] = {}
        self._wal: WalWriter | None = None
        self._dir_lock: DataDirLock | None = None  # held from open to close (real file system only)
        self._ckpt_lsn = 0
        self._initial = initial_arena_bytes
        self.checkpoint_bytes_written = 0
        self.replayed_records = 0
        self.recovery_report = None  # the WAL scan's RecoveryReport once a log was replayed
        self._primary = ArtTree(K.VALUE_BYTES, initial_arena_bytes=initial_arena_bytes)
        self._secondary = ArtTree(0, initial_arena_bytes=initial_arena_bytes)
        self._bind_fast_paths()
        try:
            if self.path is not None:
                self._open_dir(wal_recovery, verify_checkpoint, on_missing_wal)
            self._load_node_table()
        except BaseException:
            self._release_failed_open()
            raise

    def _bind_fast_paths(self) -> None:
        # the compiled core's scans, without ArtTree's argument-checking frame: the callers below pass
        # checked types and turn an OverflowError into the validating path
        core = super(ArtTree, self._primary)
        self._scan_block_packed = core.scan_u64_prefix_packed
        self._scan_blocks = core.scan_u64_prefix_batch

    # ---- opening and recovery ----------------------------------------------------------------
    def _file(self, name: str) -> str:
        return os.path.join(str(self.path), name)

    def _new_wal(self, base_lsn: int) -> WalWriter:
        return WalWriter.create(self._file(WAL), base_lsn, fs=self.fs)

    def _release_failed_open(self) -> None:
        """Release what a failed open took (the log, the checkpoint image, the directory lock)."""
        wal, self._wal = self._wal, None
        try:
            if wal is not None and not wal.closed:
                try:
                    wal.close()
                except (WalError, OSError):
                    pass  # the open's own error is the one to report
            self._drop_checkpoint_buffer()
        finally:
            if self._dir_lock is not None:
                self._dir_lock.release()

    def _open_dir(self, wal_recovery: str, verify: str, on_missing_wal: str) -> None:
        assert self.path is not None
        fs, d = self.fs, str(self.path)
        if fs.exists(d) and not fs.is_dir(d):
            raise NotAnIndexError(f"{d} is not a directory")
        _make_dirs(fs, d)
        made_lock = False
        if isinstance(fs, RealFs):  # one index per directory (a simulated file system lives in this process only)
            made_lock = not fs.exists(self._file(LOCK))
            self._dir_lock = DataDirLock(d, lock_name=LOCK, owner="ART index")
        ckpt, wal = self._file(CHECKPOINT), self._file(WAL)
        if not fs.exists(ckpt) and not fs.exists(wal):
            stray = [name for name in fs.listdir(d) if not name.endswith(".tmp") and name != LOCK]
            if stray:
                if made_lock:  # leave a foreign directory as it was found
                    fs.unlink(self._file(LOCK))
                raise NotAnIndexError(f"{d} holds {stray[:3]} but no {CHECKPOINT} or {WAL}: not an ART index")
            self._wal = self._new_wal(1)
            return
        if fs.exists(ckpt):
            self._load_checkpoint(ckpt, verify)
        if not fs.exists(wal):
            # a log always exists once a checkpoint does (it is replaced by rename, never removed):
            # a missing one may have held acknowledged batches past the checkpoint
            if on_missing_wal != "checkpoint":
                raise IndexCorruptionError(
                    f"{wal} is missing next to {ckpt} (which covers up to lsn {self._ckpt_lsn}): batches "
                    f"acknowledged after the checkpoint may be lost; to reopen from the checkpoint alone pass "
                    f"on_missing_wal='checkpoint'")
            self._wal = self._new_wal(self._ckpt_lsn + 1)
            return
        try:
            report, records = scan(wal, mode=wal_recovery, fs=fs)
        except WalCorruptionError as exc:
            raise IndexCorruptionError(str(exc)) from None
        except OSError as exc:  # a directory in its place, a read error
            raise _unreadable(wal, exc) from exc
        if report.header.base_lsn > self._ckpt_lsn + 1:
            raise IndexCorruptionError(
                f"{wal} starts at lsn {report.header.base_lsn} but the checkpoint covers only up to "
                f"{self._ckpt_lsn}: batches are missing"
            )
        for lsn, payload in records:
            if lsn <= self._ckpt_lsn:
                continue
            try:
                batch = split_batch(*decode_wal_batch(payload))
            except (ValueError, IndexError, struct.error, zlib.error, K.IndexKeyError) as exc:
                raise IndexCorruptionError(f"{wal}: record lsn {lsn} passes its crc but does not decode ({exc})") from None
            self._apply(batch)
            self.replayed_records += 1
        self.recovery_report = report
        if report.dropped_bytes:
            warnings.warn(IndexRecoveryWarning(
                f"{wal}: dropped {report.dropped_bytes} bytes after lsn {report.last_lsn} ({report.dropped_reason}); "
                f"a crash during an unacknowledged append leaves such a tail, so nothing acknowledged is known "
                f"to be lost, but a log truncated by other means looks the same"), stacklevel=4)
        if report.last_lsn < self._ckpt_lsn:
            self._wal = self._new_wal(self._ckpt_lsn + 1)
        else:
            self._wal = WalWriter.reopen(wal, report, fs=fs)

    def _load_checkpoint(self, ckpt: str, verify: str) -> None:
        fs = self.fs
        try:
            fd = fs.open(ckpt, READ)
        except OSError as exc:
            raise _unreadable(ckpt, exc) from exc
        try:
            head = fs.pread(fd, 16, 0)
            if head[:8] in _OLD_CKPT_MAGICS:
                raise IndexCorruptionError(f"{ckpt}: checkpoint written in {_OLD_CKPT_MAGICS[head[:8]]}; this version "
                                           "reads format 2 only: rebuild the index (it is derived state)")
            if len(head) < 16 or head[:8] != _CKPT_MAGIC:
                raise IndexCorruptionError(f"{ckpt}: not an ART checkpoint (bad magic)")
            meta_len, meta_crc = struct.unpack_from("<II", head, 8)
            size = fs.fsize(fd)
            if 16 + meta_len > size:
                raise IndexCorruptionError(f"{ckpt}: header claims {meta_len} meta bytes, file has {size}")
            raw = fs.pread(fd, meta_len, 16)
            if _crc.crc32c(raw) != meta_crc:
                raise IndexCorruptionError(f"{ckpt}: checkpoint header checksum mismatch")
            try:
                meta = msgpack.unpackb(raw, raw=False, strict_map_key=False)
                self._ckpt_lsn = int(meta["lsn"])
                trees = [meta["primary"], meta["secondary"]]
                names = {bytes(k): bytes(v) for k, v in meta["names"]}
            except Exception as exc:
                raise IndexCorruptionError(f"{ckpt}: checkpoint header does not decode ({exc})") from None
            for t in trees:
                if t["offset"] % _PAGE or t["offset"] + t["len"] > size:
                    raise IndexCorruptionError(f"{ckpt}: arena [{t['offset']}, +{t['len']}) lies outside the file")
            image = fs.map_copy(fd)  # copy-on-write: O(1), pages read on first touch
            self._ckpt_buf = image if image is not None else bytearray(fs.pread(fd, size, 0))
        except OSError as exc:  # a read error (a directory in its place fails here where open lets it through)
            raise _unreadable(ckpt, exc) from exc
        finally:
            fs.close(fd)
        view = memoryview(self._ckpt_buf)
        built = []
        for name, t in zip(("primary", "secondary"), trees):
            region = view[t["offset"] : t["offset"] + t["len"]]
            try:
                crcs = np.frombuffer(t["chunk_crcs"], dtype="<u4")
                tree = ArtTree.attach(region, t["root"], ArenaMeta.from_bytes(t["meta"]), chunk_crcs=crcs, chunk_bytes=t["chunk_bytes"])
                if verify == "eager":
                    tree.verify_all_chunks()
            except (ValueError, TypeError, KeyError) as exc:
                raise IndexCorruptionError(f"{ckpt}: {name} arena: {exc}") from None
            built.append(tree)
        self._primary, self._secondary = built
        self._bind_fast_paths()
        self._names = names

    # ---- applying batches --------------------------------------------------------------------
    @_corruption_guard
    def _apply(self, batch: Batch) -> None:
        """Apply a checked batch to the trees, then to the node-name table (so a batch that fails
        part-way never leaves a name behind that the base class forgot)."""
        names, prim_k, prim_v, sec_k, deletes = batch
        if prim_k:
            keys = np.frombuffer(b"".join(prim_k), dtype=np.uint8).reshape(len(prim_k), K.KEY_BYTES)
            vals = np.frombuffer(b"".join(prim_v), dtype=np.uint8).reshape(len(prim_v), K.VALUE_BYTES)
            self._primary.insert_batch(keys, vals)
        if sec_k:
            keys = np.frombuffer(b"".join(sec_k), dtype=np.uint8).reshape(len(sec_k), K.KEY_BYTES)
            self._secondary.insert_batch(keys, np.empty((len(sec_k), 0), dtype=np.uint8))
        for k in deletes:
            fam = k[:1]
            if fam == K.PRIMARY:
                self._primary.remove(k)
            elif fam == K.SECONDARY:
                self._secondary.remove(k)
        for k, v in names:
            if v is None:
                self._names.pop(k, None)
            else:
                self._names[k] = v

    @_corruption_guard
    def _apply_columns(self, name_puts: list[tuple[bytes, bytes]], primary: np.ndarray, secondary: np.ndarray,
                       values: np.ndarray) -> None:
        n = len(primary)
        self._primary.insert_batch(primary.view(np.uint8).reshape(n, K.KEY_BYTES),
                                   values.view(np.uint8).reshape(n, K.VALUE_BYTES))
        self._secondary.insert_batch(secondary.view(np.uint8).reshape(n, K.KEY_BYTES),
                                     np.empty((n, 0), dtype=np.uint8))
        for k, v in name_puts:
            self._names[k] = v

    def _logged(self, payload: bytes | None, apply) -> None:
        """Log ``payload`` (None: no log), then ``apply()`` it. Everything that can be checked was
        checked before; if applying still fails (MemoryError while an arena grows, a corrupt chunk
        found) the trees may hold part of the batch, so the record is withdrawn from the log
        (``WalWriter.retract``) and the index turns failed: the error propagates, with a note,
        and every later call but ``close()`` raises :class:`IndexFailedError`."""
        lsn = self._wal.append(payload) if payload is not None and self._wal is not None else None
        try:
            apply()
        except BaseException as exc:
            self._failed = exc
            self._scan_block_packed = self._scan_blocks = self._refuse_failed  # the unchecked read paths
            note = (f"{self.kind} index at {self.path}: this batch was refused part-way; the index is now failed "
                    f"(every call but close() raises IndexFailedError): reopen it to recover the batches "
                    f"accepted before")
            if lsn is not None:
                try:
                    self._wal.retract(lsn)
                except (WalError, OSError) as exc2:
                    note += f"; withdrawing its log record (lsn {lsn}) failed ({exc2}), so a reopen may replay it"
            exc.add_note(note)
            raise

    def _refuse_failed(self, *args) -> None:
        self._check_open()

    def _check_open(self) -> None:
        super()._check_open()
        if self._failed is not None:
            raise IndexFailedError(
                f"{self.kind} index at {self.path} failed: a batch was refused part-way "
                f"({type(self._failed).__name__}: {self._failed}); it refuses every call but close(): reopen it "
                f"to recover the batches accepted before") from self._failed

    def _write_columns(self, name_puts: list[tuple[bytes, bytes]], primary: np.ndarray, secondary: np.ndarray,
                       values: np.ndarray) -> None:
        # put_columns' write without a Python loop per replica: the WAL payload is encode_wal_batch's, built from
        # the packed arrays (encode_wal_columns); the trees take the arrays.
        payload = encode_wal_columns(name_puts, primary, values) if self._wal is not None else None
        self._logged(payload, lambda: self._apply_columns(name_puts, primary, secondary, values))

    def _raw_write(self, puts: Sequence[tuple[bytes, bytes]], deletes: Sequence[bytes]) -> None:
        batch = split_batch(puts, deletes)  # checked before anything is logged
        self._logged(encode_wal_batch(puts, deletes) if self._wal is not None else None, lambda: self._apply(batch))

    # ---- reads -------------------------------------------------------------------------------
    def locate_raw(self, block_hash: int) -> bytes:
        # The point-lookup hot path: one scan of the 9-byte block prefix, built in C. A Python
        # int that overflows u64 and every other type fall through to the validating path.
        if type(block_hash) is int and not self._closed:
            try:
                return self._scan_block_packed(_PRIMARY_BYTE, block_hash)
            except OverflowError:
                pass
            except ValueError as exc:
                if "corrupt arena" in str(exc):
                    raise IndexCorruptionError(f"{self.path}: {exc}") from None
                raise
        return super().locate_raw(block_hash)  # validates and names the value; scans are guarded

    def locate_arrays(self, block_hashes) -> LocateResult:
        # The control plane's hot path: a uint64 array goes straight to one C call that builds
        # the 9-byte prefixes itself; anything else takes the validating generic path.
        if type(block_hashes) is np.ndarray and block_hashes.dtype == np.uint64 and block_hashes.ndim == 1 \
                and not self._closed:
            try:
                keys, values, offsets = self._scan_blocks(
                    _PRIMARY_BYTE, np.ascontiguousarray(block_hashes), K.KEY_BYTES)
            except ValueError as exc:
                if "corrupt arena" in str(exc):
                    raise IndexCorruptionError(f"{self.path}: {exc}") from None
                raise
            return LocateResult(offsets, keys.view(PRIMARY_KEY_DTYPE).reshape(-1), values.view(VALUE_DTYPE).reshape(-1))
        return super().locate_arrays(block_hashes)

    def _tree_for(self, fam: bytes) -> ArtTree | None:
        return self._primary if fam == K.PRIMARY else self._secondary if fam == K.SECONDARY else None

    @_corruption_guard
    def _raw_get(self, key: bytes) -> bytes | None:
        if key[:1] == K.NODE_NAME:
            return self._names.get(key)
        tree = self._tree_for(key[:1])
        return tree.get(key) if tree is not None else None

    def _names_scan(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        return sorted((k, v) for k, v in self._names.items() if k.startswith(prefix))

    @_corruption_guard
    def _raw_scan(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        if not prefix:
            return self._primary.scan_prefix(b"") + self._names_scan(b"") + self._secondary.scan_prefix(b"")
        if prefix[:1] == K.NODE_NAME:
            return self._names_scan(prefix)
        tree = self._tree_for(prefix[:1])
        return tree.scan_prefix(prefix) if tree is not None else []

    def _prefix_matrix(self, prefixes) -> np.ndarray:
        if isinstance(prefixes, np.ndarray):
            return np.ascontiguousarray(prefixes, dtype=np.uint8)
        return np.frombuffer(b"".join(prefixes), dtype=np.uint8).reshape(len(prefixes), K.BLOCK_PREFIX_BYTES)

    @_corruption_guard
    def _raw_scan_many_packed(self, prefixes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        keys, values, offsets = self._primary.scan_prefix_batch(self._prefix_matrix(prefixes), K.KEY_BYTES)
        return keys, values, np.diff(offsets)

    @_corruption_guard
    def _raw_scan_many(self, prefixes: Sequence[bytes]) -> list[list[tuple[bytes, bytes]]]:
        if len(prefixes) < 8 or not all(len(p) == K.BLOCK_PREFIX_BYTES and p[:1] == K.PRIMARY for p in prefixes):
            return [self._raw_scan(p) for p in prefixes]  # a few scans: the single-scan path is cheaper
        keys, values, offsets = self._primary.scan_prefix_batch(self._prefix_matrix(prefixes), K.KEY_BYTES)
        kb, vb = keys.tobytes(), values.tobytes()
        kl, vl = K.KEY_BYTES, K.VALUE_BYTES
        return [
            [(kb[r * kl : (r + 1) * kl], vb[r * vl : (r + 1) * vl]) for r in range(offsets[j], offsets[j + 1])]
            for j in range(len(prefixes))
        ]

    # ---- durability --------------------------------------------------------------------------
    @property
    def arena_bytes(self) -> int:
        return self._primary.arena_used_bytes + self._secondary.arena_used_bytes

    def _raw_flush(self) -> None:
        if self._wal is None:
            return
        self._wal.sync()
        threshold = max(self.checkpoint_min_wal_bytes, self.checkpoint_wal_ratio * self.arena_bytes)
        if self._wal.size_bytes >= threshold:
            self.checkpoint()

    def checkpoint(self) -> None:
        """Write both arenas and the LSN they cover, then start a fresh WAL (see module docstring)."""
        self._check_open()
        if self._wal is None:
            return
        lsn = self._wal.sync()
        for tree in (self._primary, self._secondary):
            # never bless unverified bytes: every chunk passes its old checksum before new ones are taken
            try:
                tree.verify_all_chunks()
            except ValueError as exc:
                raise IndexCorruptionError(f"{self.path}: refusing to checkpoint: {exc}") from None
        assert self.path is not None
        fs = self.fs
        trees = []
        for tree in (self._primary, self._secondary):
            crcs = tree.chunk_crcs(CHUNK_BYTES)
            trees.append({"offset": 0, "len": tree.arena_used_bytes, "chunk_bytes": CHUNK_BYTES,
                          "chunk_crcs": crcs.astype("<u4").tobytes(), "root": tree.root_offset,
                          "meta": tree.export_meta().to_bytes()})
        meta_probe = {"lsn": lsn, "primary": trees[0], "secondary": trees[1], "names": sorted(self._names.items())}
        head_len = 16 + len(msgpack.packb(meta_probe, use_bin_type=True)) + 64
        offset = _round_up(head_len)
        for t in trees:
            t["offset"] = offset
            offset = _round_up(offset + t["len"])
        raw = msgpack.packb(meta_probe, use_bin_type=True)
        tmp = self._file(CHECKPOINT + ".tmp")
        if fs.exists(tmp):
            fs.unlink(tmp)  # left by a crash during an earlier checkpoint
        fd = fs.open(tmp, CREATE_EXCL)
        try:
            fs.pwrite(fd, _CKPT_MAGIC + struct.pack("<II", len(raw), _crc.crc32c(raw)) + raw, 0)
            for tree, t in zip((self._primary, self._secondary), trees):
                with tree.arena_view() as v:
                    fs.pwrite(fd, v, t["offset"])
            fs.truncate(fd, offset)
            fs.fsync(fd)
        finally:
            fs.close(fd)
        fs.rename(tmp, self._file(CHECKPOINT))
        fs.fsync_dir(str(self.path))  # the checkpoint is durably in place before the WAL is replaced
        self.checkpoint_bytes_written += offset
        self._ckpt_lsn = lsn
        self._wal.close()
        self._wal = self._new_wal(lsn + 1)

    def _drop_checkpoint_buffer(self) -> None:
        """Close the checkpoint's mapping, unless a tree or a caller still holds a view of it (then the mapping
        is released with that view)."""
        if isinstance(self._ckpt_buf, mmap.mmap):
            try:
                self._ckpt_buf.close()
            except BufferError:
                pass
        self._ckpt_buf = None

    def _raw_close(self) -> None:
        """Checkpoint (only while the log and the trees are sound), close the log (syncing a sound
        one), release the trees, the checkpoint image and the directory lock, and mark the index
        closed. A checkpoint that fails without failing the log (a damaged chunk,
        :class:`IndexCorruptionError`, which a retry would meet again; a full disk) is skipped: the
        log is synced and closed, everything is released (the directory lock too, so this process
        can reopen the index), and that error is raised once; the log still holds every accepted
        batch, so a reopen replays them. A failed log (an earlier write or fsync
        error, or one during this close) is closed without a checkpoint, everything is released, and
        :class:`WalFailedError` is raised once: the batches after its durable LSN were not made
        durable."""
        wal = self._wal
        skipped: BaseException | None = None  # the checkpoint's error, raised once everything is released
        if wal is not None and wal.failed is None and not wal.closed and self._failed is None \
                and wal.next_lsn - 1 > self._ckpt_lsn:
            try:
                self.checkpoint()
            except BaseException as exc:
                if self._wal is None or self._wal.failed is None:  # (a failed log: WalFailedError below)
                    skipped = exc
        wal, self._wal = self._wal, None
        try:
            if wal is not None:
                wal.close()  # a failed log is closed without syncing
        finally:
            self._primary = self._secondary = None  # type: ignore[assignment]
            self._scan_block_packed = self._scan_blocks = None  # type: ignore[assignment]
            self._drop_checkpoint_buffer()
            self._closed = True
            if self._dir_lock is not None:
                self._dir_lock.release()  # last: nothing of this index writes to the directory any more
        if wal is not None and wal.failed is not None:
            raise WalFailedError(getattr(wal.failed, "errno", None),
                                 f"{self.path}: closed without a checkpoint because the log failed earlier "
                                 f"({wal.failed}); batches after lsn {wal.durable_lsn} were not made durable")
        if skipped is not None:
            skipped.add_note(f"{self.kind} index at {self.path} was closed without a checkpoint; its log holds "
                             f"every accepted batch and a reopen replays them")
            raise skipped

    def __len__(self) -> int:
        """The number of replicas (primary records), as every backend counts (O(1))."""
        self._check_open()
        return len(self._primary)
