"""The crash-consistent SSD tier: immutable blocks on a local file system, crc32c-verified.

Longer than 600 lines because this docstring states the durability contract every method keeps, and the
write, group-commit, read and recovery paths share one lock and one pending set whose agreement with the log
is that contract; the layouts (``ssd_slab``, ``ssd_files``), the on-disk format, the recovery report and the
errors are modules of their own.

Durability contract (what "acknowledged" means):

- ``put(key, data)``: durable when it returns. The block's bytes are written and fdatasynced
  *before* the record that names them (object first), and that record is synced before ``put``
  returns. After a crash at any instant the block is either fully present and bit-exact, or (if
  ``put`` had not returned) absent. A put also makes every earlier pending ``put_async`` and
  ``delete`` durable (group commit).
- ``put_many(items)``: one group commit for the whole batch; durable when it returns. It is
  all-or-nothing for errors the tier detects before writing (bad input, duplicate or existing
  keys, no room): then nothing of the batch is stored.
- ``put_async(key, data, callback)``: the block is written and visible at once but durable only
  once ``callback(key, None)`` fired: at the next ``flush()``/``put``/``put_many``/``close()``, or
  at an automatic group commit once ``group_commit_blocks`` blocks or ``group_commit_bytes``
  bytes are pending. A failed commit, an I/O error that turns the tier unhealthy while the block is
  pending, or a failed crc32c check of the pending block on read calls ``callback(key, error)`` and
  removes the block (its space is freed); each callback fires exactly once.
- ``delete(key)``: takes effect at once (``get``, ``in``, ``keys`` stop seeing the block) and is
  durable at the next group commit (as above). A crash before that may bring the block back, with
  its own verified bytes, never with other bytes: the block's space is reused only after its
  delete is durable. Callers that keep an index remove the index entry first, then the block;
  :func:`quillcache.store.reconcile.reconcile_index` re-adds what a crash brought back.

Failures: an fsync error is never retried and never trusted: the blocks of the failed commit are
dropped and the tier turns unhealthy (``TierUnhealthyError`` on every later write; reads of what
was acknowledged keep working; pending ``put_async`` blocks are dropped, their callbacks get the
error; deletes not yet durable stay undone, so ``flush()`` raises ``TierUnhealthyError`` and a restart
brings those blocks back). A full disk (ENOSPC/EDQUOT) raises ``DiskFullError`` (a ``StoreFullError`` that
evicting blocks does not cure) and damages nothing already stored; a full tier raises ``StoreFullError``
(the tier itself never evicts). A log rotation (after a durable commit) that fails on a full disk is retried
at a later commit, unless it left a newer log generation it could not durably remove (the next open would
pick it): that, and any other rotation error, turns the tier unhealthy. A block that fails its crc32c on
read, or reads short, raises ``CorruptBlockError`` and is dropped (files layout: its object file is moved to
``quarantine/``, never deleted; slab layout: its space is reused once its delete is durable, as at recovery);
wrong bytes are never returned. A read that fails with an ``OSError`` (EMFILE, ENFILE, ENOMEM, EIO, ...) proves
nothing about the stored bytes: it raises ``StoreError`` and the block is kept (a files-layout object file that
is missing is the exception: the block is gone and dropped).

Recovery (= opening): replay the log (slab layout) or list the objects (files layout), check every block's
crc32c (``verify_on_open``), drop torn, corrupt or unreferenced data, sweep temp files, and report foreign
files (never deleted). The tier reopens whatever damage its files took: every block whose own bytes verify is
served, every other one is named in ``recovery.dropped``, damaged files are moved to
``<directory>/quarantine/`` (never deleted). The one exception is a slab layout whose log is missing or
unusable while slabs exist: slabs hold no keys, so the blocks cannot be recovered and the open is refused
(``SsdLogMissingError``) unless ``on_missing_log="empty"`` forces an empty start (the old files go to
quarantine, the report is not clean). Every error of opening is a ``StoreError`` (``SsdRecoveryError`` wraps
I/O errors), except ``DataDirInUseError`` below. A non-empty directory that holds no tier metadata file is refused
with ``ForeignFileError``. See ``SsdTier.recovery``.

One tier per directory: on the real file system a tier takes
:class:`~quillcache.durability.dirlock.DataDirLock` (``<directory>/quillcache-ssd.lock``) before reading anything
in its directory and holds it until ``close`` (a failed open releases it); a second tier on the same directory,
in this process or another, is refused with ``DataDirInUseError`` naming the directory and the holder's pid, and
nothing in the directory is touched (two tiers would overwrite each other's slabs and log records). A simulated
file system (``CrashFs``) lives in one process's memory and takes no lock.

Accounting mode (``account_only=True``; the trace harness at million-block scale): no directory,
no files, no fsync, no crc32c; offsets, footprints, capacity and the largest block come from
:class:`quillcache.store.ssd_account.AccountLayout` (whose virtual slabs are not ``slab_bytes``
large: placement differs) through the same staging/commit/delete code
path. ``get`` then returns a read-only view of zero bytes (a memoryview, not ``bytes``), nothing
is durable and there is no recovery. The normal mode is untouched by this option.

Layouts (``layout=`` tuning; a directory keeps the layout it was created with):

- ``"slab"`` (default): blocks in preallocated slab files managed by ``OffsetAllocator``, a log
  record per group commit. A commit costs two fdatasyncs (the slabs touched, then the log)
  whatever the number of blocks, and no directory operation.
- ``"files"``: one self-describing object file per block (atomic publish: temp, fdatasync,
  rename, one directory fsync per group commit). A commit costs one fdatasync per block plus a
  directory fsync, like the raw batched-fsync baseline.

Why slab is the default: with equal durability a slab commit costs two fdatasyncs per batch, a
files commit one per block plus a directory fsync. ``experiments/store_bench_ssd.py`` measures both
layouts against the raw batched-fsync baseline in the same run (``results/store_ssd/summary.csv``,
reported in ``paper/report.md``); the default follows that measurement, not this docstring.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence

from quillcache._checks import check_int
from quillcache.store.errors import (
    BlockExistsError,
    BlockNotFoundError,
    BlockTooLargeError,
    CorruptBlockError,
    DiskFullError,
    ForeignFileError,
    StoreClosedError,
    StoreError,
    StoreFullError,
    SsdRecoveryError,
    TierUnhealthyError,
)
from quillcache.alloc import AllocatorError
from quillcache.durability.dirlock import DataDirLock
from quillcache.durability.fs import FileSystem, RealFs
from quillcache.store.keys import StoreKey
from quillcache.store.ssd_account import AccountLayout
from quillcache.store.ssd_files import FilesLayout
from quillcache.store.ssd_format import (
    DEFAULT_LAYOUT,
    LOCK,
    META,
    PAGE_BYTES,
    QUARANTINE,
    BlockRecord,
    SsdRecoveryReport,
    SsdTuning,
    block_crc,
    decode_meta,
    owned_kind,
    write_meta,
)
from quillcache.store.ssd_slab import SlabLayout

_LAYOUTS = {"slab": SlabLayout, "files": FilesLayout}
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)
Callback = Callable[[StoreKey, "BaseException | None"], None]

__all__ = ["SsdRecoveryReport", "SsdTier", "SsdTuning"]


def _check_key(key: object) -> StoreKey:
    if not isinstance(key, StoreKey):
        raise TypeError(f"SSD tier keys are StoreKey objects, got {type(key).__name__} {key!r:.80}")
    return key


def _as_view(data: object, key: StoreKey) -> memoryview:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"block {key.hex()}: data must be bytes, bytearray or memoryview, got {type(data).__name__}")
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError(f"block {key.hex()}: data must be a C-contiguous buffer")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if len(view) == 0:
        raise ValueError(f"block {key.hex()}: empty blocks are not stored")
    return view


class SsdTier:
    """Immutable blocks on local SSD; see the module docstring for the durability contract."""

    def __init__(self, directory: str | os.PathLike | None, *, capacity_bytes: int, fs: FileSystem | None = None,
                 account_only: bool = False, **tuning) -> None:
        capacity_bytes = check_int("capacity_bytes", capacity_bytes, PAGE_BYTES)
        if fs is not None and not isinstance(fs, FileSystem):
            raise TypeError(f"fs must be a quillcache.durability.fs.FileSystem, got {type(fs).__name__}")
        try:
            self.tuning = SsdTuning(**tuning)
        except TypeError as exc:
            raise TypeError(f"unknown SsdTier tuning argument(s) {sorted(tuning)}: {exc}") from None
        if not isinstance(account_only, bool):
            raise TypeError(f"account_only must be bool, got {account_only!r}")
        self.account_only = account_only
        if account_only:
            if fs is not None:
                raise ValueError("an account_only SSD tier has no files: pass fs=None")
            directory = "(account-only)" if directory is None else directory
        elif directory is None:
            raise TypeError("directory is required (None only with account_only=True)")
        self._fs = fs if fs is not None else RealFs()
        if account_only:
            self._dir = os.fspath(directory)
        else:
            self._dir = (os.path.abspath(os.fspath(directory)) if fs is None or isinstance(fs, RealFs)
                         else os.fspath(directory))
        self._capacity = capacity_bytes
        self._lock = threading.RLock()
        self._live: dict[StoreKey, BlockRecord] = {}
        self._pending_puts: list[tuple[StoreKey, BlockRecord, Callback | None]] = []
        self._pending_bytes = 0
        self._pending_deletes: list[tuple[StoreKey, BlockRecord]] = []
        self._used = 0
        self._unhealthy: BaseException | None = None
        self._closed = False
        self._dir_lock: DataDirLock | None = None
        if account_only:
            self._layout = AccountLayout(capacity_bytes, self.tuning)
            self.recovery = SsdRecoveryReport(directory=self._dir, layout=AccountLayout.name, created=True,
                                              blocks_kept=0, bytes_kept=0)
        else:
            try:
                self.recovery = self._open()
            except BaseException as exc:
                layout = getattr(self, "_layout", None)
                try:
                    if layout is not None:  # release every handle the failed open took
                        try:
                            layout.close()
                        except OSError:
                            pass
                finally:
                    if self._dir_lock is not None:
                        self._dir_lock.release()
                if isinstance(exc, (OSError, OverflowError, struct.error, AllocatorError)):
                    raise SsdRecoveryError(f"SSD tier {self._dir} could not be opened: "
                                           f"{type(exc).__name__}: {exc}") from exc
                raise

    # ---------------------------------------------------------------- opening = recovery
    def _open(self) -> SsdRecoveryReport:
        fs, d = self._fs, self._dir
        created = False
        if not fs.exists(d):
            fs.mkdir(d)
            fs.fsync_dir(os.path.dirname(d.rstrip("/")) or ".")
        elif not fs.is_dir(d):
            raise ForeignFileError(f"SSD tier path {d} exists and is not a directory")
        made_lock = False
        if isinstance(fs, RealFs):  # one tier per directory (a simulated file system lives in this process only)
            made_lock = not fs.exists(f"{d}/{LOCK}")
            self._dir_lock = DataDirLock(d, lock_name=LOCK, owner="SSD tier")
        names = fs.listdir(d)
        files: dict[str, list[tuple[int, str]]] = {}
        foreign: list[str] = []
        for name in names:
            if name == QUARANTINE and fs.is_dir(f"{d}/{name}"):
                continue  # damaged files moved aside by an earlier recovery (kept as evidence)
            kind = owned_kind(name)
            if kind is None or not fs.stat(f"{d}/{name}").is_file:
                foreign.append(name)
            else:
                files.setdefault(kind[0], []).append((kind[1], name))
        if META not in names:
            ours = [n for n in names if n not in (META + ".tmp", LOCK)]
            if ours:
                if made_lock:  # leave a foreign directory as it was found
                    fs.unlink(f"{d}/{LOCK}")
                shown = ", ".join(ours[:5]) + (", ..." if len(ours) > 5 else "")
                raise ForeignFileError(
                    f"{d} is not a QuillCache SSD tier: it holds {len(ours)} file(s) ({shown}) and no {META}; "
                    f"refusing to open it (use an empty or new directory)")
            if META + ".tmp" in names:
                fs.unlink(f"{d}/{META}.tmp")
            layout = self.tuning.layout or DEFAULT_LAYOUT
            write_meta(fs, d, layout, self.tuning.slab_bytes)
            meta = {"layout": layout, "slab_bytes": self.tuning.slab_bytes}
            created = True
            files = {}
        else:
            meta = decode_meta(fs.read_file(f"{d}/{META}"), f"{d}/{META}")
            if self.tuning.layout is not None and self.tuning.layout != meta["layout"]:
                raise ValueError(f"{d} holds a {meta['layout']!r} SSD tier; layout={self.tuning.layout!r} was asked")
        rep: dict = {"dropped": [], "swept": [], "log_records": 0, "log_damaged": (), "log_tail": "",
                     "log_rotated": False, "quarantined": []}
        files.pop("lock", None)  # the DataDirLock's file (taken above)
        for _, name in files.pop("meta", []):
            if name != META:
                fs.unlink(f"{d}/{name}")
                rep["swept"].append(name)
        wrong = [n for k in (("log", "log_tmp", "slab", "slab_tmp") if meta["layout"] == "files" else ("object", "object_tmp"))
                 for _, n in files.pop(k, [])]
        foreign += wrong  # files of the other layout: not ours in this directory, never touched
        self._layout = _LAYOUTS[meta["layout"]](fs, d, self._capacity, self.tuning, int(meta["slab_bytes"]))
        self._live = self._layout.recover(files, rep)
        self._used = sum(self._layout.footprint_bytes(r.size_bytes) for r in self._live.values())
        return SsdRecoveryReport(
            directory=d, layout=meta["layout"], created=created, blocks_kept=len(self._live),
            bytes_kept=sum(r.size_bytes for r in self._live.values()), dropped=tuple(rep["dropped"]),
            swept_temp_files=tuple(rep["swept"]), foreign_files=tuple(sorted(foreign)),
            log_records=rep["log_records"], log_damaged_lsns=tuple(rep["log_damaged"]),
            log_tail=rep["log_tail"], log_rotated=rep["log_rotated"], quarantined=tuple(rep["quarantined"]))

    # ---------------------------------------------------------------- state checks
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"SSD tier {self._dir} is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self._unhealthy is not None:
            raise TierUnhealthyError(
                f"SSD tier {self._dir} is unhealthy after an I/O error it cannot trust ({self._unhealthy}); "
                f"writes are refused, reads of stored blocks still work")

    def _mark_unhealthy(self, exc: BaseException) -> None:
        if self._unhealthy is None:
            self._unhealthy = exc

    # ---------------------------------------------------------------- writes
    def _validate(self, key: object, data: object) -> tuple[StoreKey, memoryview]:
        key = _check_key(key)
        view = _as_view(data, key)
        if len(view) > self._layout.max_block_bytes:
            raise BlockTooLargeError(
                f"block {key.hex()} of {len(view)} B exceeds the SSD tier's largest block "
                f"({self._layout.max_block_bytes} B)")
        if key in self._live:
            raise BlockExistsError(f"block {key.hex()} is already stored in SSD tier {self._dir}")
        return key, view

    def _stage(self, key: StoreKey, view: memoryview, callback: Callback | None, *, may_commit: bool) -> None:
        need = self._layout.footprint_bytes(len(view))
        if need > self._capacity - self._used and may_commit and self._pending_deletes:
            self._commit_pending()  # makes pending deletes durable, so their space can be reused
        if need > self._capacity - self._used:
            raise StoreFullError(f"SSD tier {self._dir}: no room for block {key.hex()} of {len(view)} B "
                                 f"(capacity {self._capacity} B, {self._capacity - self._used} B free)")
        crc = 0 if self.account_only else block_crc(key.to_bytes(), view)
        try:
            rec = self._layout_stage(key, view, crc, may_commit=may_commit)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(f"SSD tier {self._dir}: disk full writing block {key.hex()} "
                                    f"of {len(view)} B ({exc})") from exc
            if exc.errno in _OUT_OF_FDS:  # nothing was opened or written: a refusal, not an error about the data
                raise StoreError(f"SSD tier {self._dir}: out of file descriptors staging block {key.hex()} "
                                 f"({exc}); it was not stored (the files layout holds one per pending block: "
                                 f"lower group_commit_blocks or raise the process's fd limit)") from exc
            self._mark_unhealthy(exc)
            err = TierUnhealthyError(f"SSD tier {self._dir}: I/O error writing block {key.hex()} ({exc}); the "
                                     f"tier is unhealthy and its {len(self._pending_puts)} pending put(s) were dropped")
            self._fail_pending(err)
            raise err from exc
        self._live[key] = rec
        self._used += need
        self._pending_puts.append((key, rec, callback))
        self._pending_bytes += len(view)

    def _layout_stage(self, key: StoreKey, view: memoryview, crc: int, *, may_commit: bool) -> BlockRecord:
        """The layout's ``stage``; when ``may_commit``, one group commit and one retry if the layout is full
        while deletes are pending (their room is reused only once durable) or the process is out of file
        descriptors while puts are pending (the files layout holds one per pending block until the commit)."""
        try:
            return self._layout.stage(key, view, crc)
        except StoreFullError:
            if not (may_commit and self._pending_deletes):
                raise
        except OSError as exc:
            if not (may_commit and self._pending_puts and exc.errno in _OUT_OF_FDS):
                raise
        self._commit_pending()
        return self._layout.stage(key, view, crc)

    def _commit_pending(self) -> None:
        """One group commit of every pending put and delete (see the module docstring)."""
        if not self._pending_puts and not self._pending_deletes:
            return
        puts, dels = self._pending_puts, self._pending_deletes
        self._pending_puts, self._pending_deletes, self._pending_bytes = [], [], 0
        try:
            self._layout.commit([(k, r) for k, r, _ in puts], dels)
        except OSError as exc:
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT) and getattr(self._layout, "log", None) is not None \
                and self._layout.log.failed is None
            self._drop_staged(puts)
            # the deletes stay pending, not durable: a retry after a full disk; on an unhealthy tier, flush()
            # keeps refusing (a restart brings those blocks back, as after a crash)
            self._pending_deletes = dels + self._pending_deletes
            if full:
                err: StoreError = DiskFullError(f"SSD tier {self._dir}: disk full during a group commit of "
                                                f"{len(puts)} block(s) ({exc}); they were not stored")
            else:
                self._mark_unhealthy(exc)
                err = TierUnhealthyError(f"SSD tier {self._dir}: group commit of {len(puts)} block(s) failed "
                                         f"({exc}); they were dropped, the tier is unhealthy (no fsync retry)")
            self._fire(puts, err)
            raise err from exc
        for _, r, _ in puts:
            r.durable = True
        self._layout.release(r for _, r in dels)
        self._fire(puts, None)
        try:
            self._layout.after_commit(self._live)
        except OSError as exc:  # the commit itself is durable; a rotation that failed on a full disk
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):  # left no newer generation: retried later
                self._mark_unhealthy(exc)  # else (ssd_slab.StaleGenerationError included): no more writes

    def _fail_pending(self, err: BaseException) -> None:
        """The pending puts can never become durable (the tier turned unhealthy): drop them and fire
        each callback once with ``err``. Pending deletes stay undone on disk (a restart may bring
        those blocks back, as after a crash)."""
        puts, self._pending_puts, self._pending_bytes = self._pending_puts, [], 0
        self._drop_staged(puts)
        self._fire(puts, err)

    def _drop_staged(self, puts) -> None:
        for key, rec, _ in puts:
            if self._live.get(key) is rec:
                del self._live[key]
                self._used -= self._layout.footprint_bytes(rec.size_bytes)
        self._layout.abort([r for _, r, _ in puts])

    @staticmethod
    def _fire(puts, err: BaseException | None) -> None:
        for key, _, cb in puts:
            if cb is not None:
                try:
                    cb(key, err)
                except Exception as exc:  # noqa: BLE001 - a caller's callback must not break the tier
                    warnings.warn(f"put_async callback for {key.hex()} raised {exc!r}", RuntimeWarning, stacklevel=3)

    def put(self, key: StoreKey, data: bytes | bytearray | memoryview) -> None:
        """Store one block; durable when this returns."""
        with self._lock:
            self._check_writable()
            key, view = self._validate(key, data)
            self._stage(key, view, None, may_commit=True)
            self._commit_pending()

    def put_many(self, items: Sequence[tuple[StoreKey, bytes | bytearray | memoryview]]) -> None:
        """Store a batch in one group commit; durable when this returns (all or nothing on refusal)."""
        with self._lock:
            self._check_writable()
            checked: list[tuple[StoreKey, memoryview]] = []
            seen: set[StoreKey] = set()
            for item in items:
                if not isinstance(item, tuple) or len(item) != 2:
                    raise TypeError(f"put_many takes (StoreKey, data) pairs, got {item!r:.80}")
                key, view = self._validate(*item)
                if key in seen:
                    raise BlockExistsError(f"block {key.hex()} appears twice in one put_many batch")
                seen.add(key)
                checked.append((key, view))
            need = sum(self._layout.footprint_bytes(len(v)) for _, v in checked)
            if need > self._capacity - self._used and self._pending_deletes:
                self._commit_pending()
            if need > self._capacity - self._used:
                raise StoreFullError(f"SSD tier {self._dir}: no room for a batch of {len(checked)} block(s), "
                                     f"{need} B (capacity {self._capacity} B, {self._capacity - self._used} B free)")
            for attempt in range(2):
                mark = len(self._pending_puts)
                try:
                    for key, view in checked:
                        self._stage(key, view, None, may_commit=False)
                    break
                except BaseException as exc:
                    mine, self._pending_puts = self._pending_puts[mark:], self._pending_puts[:mark]
                    self._drop_staged(mine)
                    # the layout keeps a deleted block's space until its delete is durable: commit, retry once
                    if attempt or not isinstance(exc, StoreFullError) or not self._pending_deletes:
                        raise
                self._commit_pending()
            self._commit_pending()

    def put_async(self, key: StoreKey, data: bytes | bytearray | memoryview, callback: Callback | None = None) -> None:
        """Write a block now, make it durable at the next group commit; ``callback`` fires once then."""
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable or None, got {type(callback).__name__}")
        with self._lock:
            self._check_writable()
            key, view = self._validate(key, data)
            self._stage(key, view, callback, may_commit=True)
            t = self.tuning
            if len(self._pending_puts) >= t.group_commit_blocks or self._pending_bytes >= t.group_commit_bytes:
                self._commit_pending()

    def flush(self) -> None:
        """Make every pending put_async and delete durable (one group commit)."""
        with self._lock:
            self._check_open()
            if self._pending_puts or self._pending_deletes:
                self._check_writable()
                self._commit_pending()

    def delete(self, key: StoreKey) -> None:
        """Remove a block now; durable at the next group commit (module docstring)."""
        with self._lock:
            self._check_writable()
            key = _check_key(key)
            rec = self._live.get(key)
            if rec is None:
                raise BlockNotFoundError(f"block {key.hex()} is not in SSD tier {self._dir}")
            if not rec.durable:
                self._commit_pending()  # its put becomes durable (callback fires), then it is deleted
            del self._live[key]
            self._used -= self._layout.footprint_bytes(rec.size_bytes)
            self._pending_deletes.append((key, rec))

    # ---------------------------------------------------------------- reads
    def _record(self, key: object) -> tuple[StoreKey, BlockRecord]:
        key = _check_key(key)
        rec = self._live.get(key)
        if rec is None:
            raise BlockNotFoundError(f"block {key.hex()} is not in SSD tier {self._dir}")
        return key, rec

    def _corrupt(self, key: StoreKey, rec: BlockRecord, why: str) -> CorruptBlockError:
        """Drop a block that failed its check; its delete is logged at the next group commit (the files
        layout moves its object file to quarantine/ then, never deletes it)."""
        kept = (f"; its object file is moved to {self._dir}/{QUARANTINE}/, not deleted"
                if self._layout.name == FilesLayout.name else "")
        err = CorruptBlockError(f"block {key.hex()} in SSD tier {self._dir} (segment {rec.segment_id}, offset "
                                f"{rec.offset_bytes}, {rec.size_bytes} B) {why}; it was dropped{kept}")
        rec.damaged = True
        if self._live.get(key) is rec:
            del self._live[key]
            self._used -= self._layout.footprint_bytes(rec.size_bytes)
            if self._unhealthy is None and rec.durable:
                self._pending_deletes.append((key, rec))
            elif not rec.durable:  # a staged put: never logged, so it leaves the batch and its space is freed now
                mine = [p for p in self._pending_puts if p[1] is rec]
                self._pending_puts = [p for p in self._pending_puts if p[1] is not rec]
                self._pending_bytes -= rec.size_bytes
                self._layout.abort([rec])
                self._fire(mine, err)
        return err

    def get(self, key: StoreKey) -> bytes:
        """The block's bytes, crc32c-verified (account_only: a read-only view of zero bytes)."""
        with self._lock:
            self._check_open()
            key, rec = self._record(key)
            if self.account_only:
                return self._layout.zero_view(rec.size_bytes)  # type: ignore[return-value] (documented)
            buf = bytearray(rec.size_bytes)
            self._read_checked(key, rec, memoryview(buf))
            return bytes(buf)

    def get_into(self, key: StoreKey, out: memoryview) -> int:
        """Read the block into ``out`` (writable, at least ``size_of(key)`` bytes); returns its size."""
        with self._lock:
            self._check_open()
            key, rec = self._record(key)
            try:
                view = memoryview(out)
            except TypeError:
                raise TypeError(f"out must be a writable buffer, got {type(out).__name__}") from None
            if view.readonly or not view.c_contiguous:
                raise ValueError("out must be a writable, C-contiguous buffer")
            view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
            if len(view) < rec.size_bytes:
                raise ValueError(f"out has {len(view)} B, block {key.hex()} needs {rec.size_bytes} B")
            self._read_checked(key, rec, view[: rec.size_bytes])
            return rec.size_bytes

    def _read_checked(self, key: StoreKey, rec: BlockRecord, view: memoryview) -> None:
        """Only a short read or a crc32c mismatch proves damage (the block is dropped). A read that fails
        (out of fds or memory, EIO, ...) says nothing about the stored bytes: the block is kept and the
        read refused with ``StoreError``. EIO included: it may be transient, and a kept block is never
        served unverified, so keeping it costs only another refused read; dropping it could lose it for good.
        A files-layout object that no longer exists is gone: the block is dropped."""
        try:
            n = self._layout.read_into(rec, view)
        except FileNotFoundError as exc:  # (files layout: the object is gone, nothing is left to keep)
            raise self._corrupt(key, rec, f"could not be read: its file is missing ({exc})") from exc
        except OSError as exc:
            raise StoreError(f"SSD tier {self._dir}: reading block {key.hex()} (segment {rec.segment_id}, offset "
                             f"{rec.offset_bytes}, {rec.size_bytes} B) failed ({exc}); the block is kept: the "
                             f"error says nothing about its bytes, retry later") from exc
        if self.account_only:
            return
        if n != rec.size_bytes or block_crc(key.to_bytes(), view) != rec.crc:
            view[:] = bytes(len(view))  # never leave wrong bytes in the caller's buffer
            raise self._corrupt(key, rec, "failed its crc32c check" if n == rec.size_bytes else f"is truncated ({n} B)")

    # ---------------------------------------------------------------- queries
    def __contains__(self, key: object) -> bool:
        return key in self._live

    def __len__(self) -> int:
        return len(self._live)

    def keys(self) -> Iterator[StoreKey]:
        with self._lock:
            return iter(list(self._live))

    def size_of(self, key: StoreKey) -> int:
        with self._lock:
            return self._record(key)[1].size_bytes

    def location_of(self, key: StoreKey) -> tuple[int, int, int]:
        """``(segment_id, offset_bytes, size_bytes)`` for the residency index."""
        with self._lock:
            r = self._record(key)[1]
            return r.segment_id, r.offset_bytes, r.size_bytes

    def locations(self) -> dict[StoreKey, tuple[int, int, int]]:
        """Every block's location (what :func:`reconcile_index` takes as ``live``)."""
        with self._lock:
            return {k: (r.segment_id, r.offset_bytes, r.size_bytes) for k, r in self._live.items()}

    def footprint_bytes(self, size_bytes: int) -> int:
        """Capacity one block of ``size_bytes`` takes in this tier (what ``used_bytes`` counts)."""
        return self._layout.footprint_bytes(size_bytes)

    @property
    def used_bytes(self) -> int:
        """Capacity taken by stored blocks (sizes rounded up to 4 KiB pages; files add a header)."""
        return self._used

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def free_bytes(self) -> int:
        return max(0, self._capacity - self._used)

    @property
    def healthy(self) -> bool:
        return self._unhealthy is None

    @property
    def directory(self) -> str:
        return self._dir

    @property
    def layout(self) -> str:
        return self._layout.name

    def close(self) -> None:
        """Commit what is pending (if healthy) and release the files; idempotent."""
        with self._lock:
            if self._closed:
                return
            try:
                if self._unhealthy is None:
                    self._commit_pending()
                elif self._pending_puts:
                    self._fail_pending(TierUnhealthyError(
                        f"SSD tier {self._dir} closed while unhealthy ({self._unhealthy}); pending put(s) dropped"))
            finally:
                self._closed = True
                try:
                    self._layout.close()
                finally:
                    if self._dir_lock is not None:
                        self._dir_lock.release()

    def __enter__(self) -> "SsdTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"SsdTier({self._dir!r}, layout={self._layout.name!r}, blocks={len(self._live)}, "
                f"used={self._used}/{self._capacity} B, healthy={self.healthy})")
