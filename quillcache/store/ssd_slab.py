"""The SSD tier's slab layout: blocks packed into preallocated slab files, a write-ahead log of
where they are.

Files: ``slab-NNNNN.qcs`` (created at their full size with fallocate, fsynced, renamed into
place, directory fsynced — so a slab's size and existence are durable before any block uses it)
and ``log-GGGGGGGG.qcl`` (the current log generation, :mod:`quillcache.store.ssd_log`).

Space: one :class:`quillcache.alloc.OffsetAllocator` per slab, 4 KiB aligned. The allocator's
range is the slab plus a *fence*: a permanent allocation of about 1/8 of the slab just past its
end. The fence is what lets recovery rebuild the allocator exactly: allocating the live blocks
and the gaps between them in address order from an empty allocator places each one at the start
of the single free region (the allocator never places a block elsewhere), and the fence's slack
guarantees that region is always large enough for the allocator's rounded-up bin search.

Group commit (object first): ``pwrite`` the blocks into their slabs; ``fdatasync`` every slab
touched; append ONE log record (all puts and deletes of the batch); ``fdatasync`` the log. A put
is acknowledged only after that. A deleted block's space goes back to the allocator only once the
log record of its delete is durable, so a crash never finds a logged block overwritten by a newer
one it does not know about. Recovery still guards against it: overlapping live records (possible
only after log damage) keep the one with the higher LSN, and every block's crc32c is checked.

Damage (issue 11): a slab file whose size is not whole pages is used up to its last whole page (at
most ``slab_bytes``), blocks past it are dropped by key; one without a whole page is quarantined. A
log generation that cannot be replayed is quarantined, never deleted; so is one replayed with damage
(skipped records or a dropped tail), once the rotation that recovery then makes has replaced it, and an older
generation that a rotation superseded is checked before it is removed (quarantined if damaged: a crash may have
come before its move). The keys of the put entries of damaged records are read from their bytes as far as
those parse and named in ``recovery.dropped`` (and the dropped tail's message), unless the block is served:
unverified, the damage may be in a key. Slabs hold no keys or checksums, so with no usable log next to slab
files the open is refused (``SsdLogMissingError``) unless ``on_missing_log="empty"``; with no slab file an
unusable log is quarantined and the tier starts empty (no block can have been lost); never reported as a
clean empty recovery. An ``E`` record lost in damage the salvage scan skipped does not make a generation
unusable (``_replay``).
New log generations and slabs skip names a foreign file or directory holds.

Rotation (a new generation: a snapshot of the durable live set, made complete and durable before the
old one is removed): recovery picks the newest generation, so a rotation that fails never leaves a
newer generation behind while commits go on to the old one. If it failed after the rename (the
directory fsync), the new file is removed durably, else ``StaleGenerationError`` turns the tier
unhealthy. A new slab that failed after its rename is removed too (it holds no block yet).
"""

from __future__ import annotations

import bisect
import errno
import struct
from collections.abc import Iterable

from quillcache import alloc as _alloc
from quillcache.durability.fs import FileSystem
from quillcache.durability.wal import HEADER_BYTES as WAL_HEADER_BYTES
from quillcache.durability.wal import RECORD_HEADER_BYTES, RecoveryReport, WalWriter
from quillcache.store import ssd_log as L
from quillcache.store.errors import DiskFullError, SsdLogMissingError, StoreFullError
from quillcache.store.keys import StoreKey
from quillcache.store.ssd_format import PAGE_BYTES, BlockRecord, SsdTuning, block_crc, quarantine, quarantine_tail



def _slab_name(no: int) -> str:
    return f"slab-{no:05d}.qcs"


def _log_name(gen: int) -> str:
    return f"log-{gen:08d}.qcl"


_RECORD_HEAD_BYTES = len(L.encode_record(L.KIND_END, []))  # kind and entry count of a log payload
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


def _unverified_puts(raw: bytes, pos: int, stop: int) -> list[StoreKey]:
    """The keys of the put entries of the log records that lie from byte ``pos`` to ``stop`` of a log file and
    failed their checks, read as far as their bytes parse (a cut-off record: its whole entries). Unverified."""
    keys: list[StoreKey] = []
    while pos + RECORD_HEADER_BYTES + _RECORD_HEAD_BYTES <= stop:
        end = pos + RECORD_HEADER_BYTES + _U32.unpack_from(raw, pos)[0]
        body = raw[pos + RECORD_HEADER_BYTES : min(end, stop)]
        if len(body) < _RECORD_HEAD_BYTES:
            break
        kind, n = body[:1], _U32.unpack_from(body, 1)[0]
        if kind not in (L.KIND_BATCH, L.KIND_SNAPSHOT):
            break
        whole = min(n, (len(body) - _RECORD_HEAD_BYTES) // L.ENTRY_BYTES)
        for i in range(whole):
            op, kb, *_ = L.ENTRY.unpack_from(body, _RECORD_HEAD_BYTES + i * L.ENTRY_BYTES)
            if op == L.PUT:
                keys.append(StoreKey.from_bytes(kb))
        if end > stop or len(body) != _RECORD_HEAD_BYTES + n * L.ENTRY_BYTES:
            break
        pos = end
    return keys


def _damaged_puts(raw: bytes, report: RecoveryReport, records: list[tuple[int, bytes]]) -> list[StoreKey]:
    """Keys the damaged stretches of a scanned log file name in put entries (``_unverified_puts``): each
    stretch the salvage scan skipped (from the end of the record before it to the record after it) and the
    dropped tail."""
    keys: list[StoreKey] = []
    pos, expect = WAL_HEADER_BYTES, report.header.base_lsn
    for lsn, payload in records:
        if lsn != expect:  # a skipped stretch starts at pos; find where record lsn is
            at = raw.find(_U64.pack(lsn), pos + 8)
            while at >= 0 and not (_U32.unpack_from(raw, at - 8)[0] == len(payload)
                                   and raw[at + 16 : at + 16 + len(payload)] == payload):
                at = raw.find(_U64.pack(lsn), at + 1)
            if at < 0:  # (cannot happen: the scan found it) no position to read the stretch up to
                break
            keys += _unverified_puts(raw, pos, at - 8)
            pos = at - 8
        pos, expect = pos + RECORD_HEADER_BYTES + len(payload), lsn + 1
    if report.dropped_reason:
        keys += _unverified_puts(raw, report.valid_bytes, len(raw))
    return keys


class StaleGenerationError(OSError):
    """A failed log rotation left a newer log generation the next open may pick (``_undo_generation``):
    commits to the current generation could be lost, so the tier turns unhealthy (errno EIO)."""


class _Slab:
    """One slab file and its allocator (see the module docstring for the fence)."""

    def __init__(self, no: int, fd: int, size_bytes: int, placed: list[tuple[int, int]]) -> None:
        self.no, self.fd, self.size_bytes = no, fd, size_bytes
        units = size_bytes // PAGE_BYTES
        slack = _alloc.float_to_uint(_alloc.uint_to_float_round_up(units // 8 + 2))
        # one-page blocks in every page need 2*units+1 nodes (live ranges and the free gaps between them): a pool
        # sized from the slab (32 B of DRAM per node) so no slab reports full while pages are free
        max_allocs = max(min(2 * units + 8, _alloc.MAX_NODES), 2 * len(placed) + 8)
        self.alloc = _alloc.OffsetAllocator((units + slack) * PAGE_BYTES, max_allocs, alignment=PAGE_BYTES)
        self.handles = self._rebuild(sorted(placed), slack)

    def _rebuild(self, placed: list[tuple[int, int]], slack_units: int) -> list[int]:
        """Allocate ``placed`` [(offset, size)] at exactly their offsets; returns their handles."""
        a, fillers, handles, cursor = self.alloc, [], [], 0

        def take(size: int, expect: int) -> int:
            x = a.allocate(size)
            if x.offset != expect:  # pragma: no cover - the allocator's contract says it cannot happen
                raise AssertionError(f"slab {self.no}: allocator placed {size} B at {x.offset}, expected {expect}")
            return x.handle

        for off, size in placed:
            if off > cursor:
                fillers.append(take(off - cursor, cursor))
            handles.append(take(size, off))
            cursor = off + _round_up(size)
        if cursor < self.size_bytes:
            fillers.append(take(self.size_bytes - cursor, cursor))
        take(slack_units * PAGE_BYTES, self.size_bytes)  # the fence, never freed
        for h in fillers:
            a.free(h)
        return handles


def _round_up(n: int) -> int:
    return -(-n // PAGE_BYTES) * PAGE_BYTES


class SlabLayout:
    """Slab files + log. Called by SsdTier with its lock held; raises OSError / StoreFullError."""

    name = "slab"

    def __init__(self, fs: FileSystem, directory: str, capacity_bytes: int, tuning: SsdTuning, slab_bytes: int) -> None:
        self.fs, self.dir, self.capacity_bytes, self.tuning = fs, directory, capacity_bytes, tuning
        self.slab_bytes = slab_bytes
        self.slabs: dict[int, _Slab] = {}
        self.log: WalWriter | None = None
        self.gen = 0
        self._snapshot_bytes = 0
        self.max_block_bytes = min(tuning.max_block_bytes or slab_bytes, slab_bytes, capacity_bytes)

    def _p(self, name: str) -> str:
        return f"{self.dir}/{name}"

    # ---------------------------------------------------------------- recovery
    def recover(self, files: dict[str, list[tuple[int, str]]], rep: dict) -> dict[StoreKey, BlockRecord]:
        fs = self.fs
        for kind in ("slab_tmp", "log_tmp"):
            for _, name in files.get(kind, []):
                fs.unlink(self._p(name))
                rep["swept"].append(name)
        # pick the newest complete log generation
        state: dict[StoreKey, tuple[int, int, int, int, int]] = {}
        chosen = None
        unusable: list[tuple[str, str]] = []
        notes: list[str] = []
        for gen, name in sorted(files.get("log", []), reverse=True):
            try:
                scanned = L.scan_generation(fs, self._p(name))
                notes = []
                state = self._replay(scanned[1], scanned[0], notes)
            except Exception as exc:  # noqa: BLE001 - any damage makes this generation unusable
                unusable.append((name, f"log generation unusable: {type(exc).__name__}: {exc}"))
                continue
            chosen = (gen, name, scanned)
            break
        if chosen is None:
            self._no_usable_log(files, unusable, rep)
            files = {k: v for k, v in files.items() if k not in ("slab", "log")}
        rep["dropped"] += unusable
        if chosen is not None:
            rep["dropped"] += [(chosen[1], why) for why in notes]
        for gen, name in files.get("log", []):
            if gen == chosen[0]:
                continue
            if any(name == n for n, _ in unusable) or self._damaged_generation(name):
                quarantine(fs, self.dir, name, rep)  # damaged: evidence, never deleted
            else:
                fs.unlink(self._p(name))  # an older generation a completed rotation superseded
                rep["swept"].append(name)
        # open the slabs; a slab whose size is not whole pages is used up to its last whole page
        for no, name in sorted(files.get("slab", [])):
            fd = fs.open(self._p(name), "rw")
            raw = fs.fsize(fd)
            usable = min(raw // PAGE_BYTES * PAGE_BYTES, self.slab_bytes, _alloc.MAX_UNITS * PAGE_BYTES // 2)
            if usable < PAGE_BYTES:  # not a slab the tier made (it would have at least one page)
                fs.close(fd)
                quarantine(fs, self.dir, name, rep)
                rep["dropped"].append((name, f"slab file of {raw} B holds no whole page; quarantined"))
                continue
            if usable != raw:
                rep["dropped"].append((name, f"slab file is {raw} B, not whole pages of at most {self.slab_bytes} B; "
                                             f"its first {usable} B are used"))
            self.slabs[no] = (fd, usable)  # type: ignore[assignment]
        if rep.get("quarantined"):
            fs.fsync_dir(self.dir)
        live = self._resolve(state, rep)
        placed: dict[int, list[tuple[int, int]]] = {no: [] for no in self.slabs}
        order: dict[int, list[StoreKey]] = {no: [] for no in self.slabs}
        for key, rec in sorted(live.items(), key=lambda kv: (kv[1].segment_id, kv[1].offset_bytes)):
            placed[rec.segment_id].append((rec.offset_bytes, rec.size_bytes))
            order[rec.segment_id].append(key)
        for no, (fd, size) in list(self.slabs.items()):  # type: ignore[misc]
            slab = _Slab(no, fd, size, placed[no])
            self.slabs[no] = slab
            for key, h in zip(order[no], slab.handles):
                live[key].handle = h
        gen, name, (report, records) = chosen if chosen is not None else (-1, "", (None, []))
        log_damaged = report is not None and bool(report.damaged_lsns or report.dropped_reason)
        if report is not None:
            rep["log_records"] = len(records)
            rep["log_damaged"] = report.damaged_lsns
            rep["log_tail"] = f"{self._p(name)}: {report.dropped_reason}" if report.dropped_reason else ""
            if log_damaged:
                self._name_lost_keys(name, report, records, live, rep)
            self.gen = gen
            next_lsn = report.last_lsn + 1
            needs_rotate = bool(rep["dropped"] or report.damaged_lsns or report.dropped_reason
                                or report.valid_bytes > self.tuning.log_rotate_bytes)
            if not needs_rotate:
                self.log = L.reopen_generation(fs, self._p(name), report)
                self._snapshot_bytes = len(live) * L.ENTRY_BYTES
                return live
            if report.dropped_reason and not report.damaged_lsns:  # a dropped tail only: keep just those bytes
                quarantine_tail(fs, self.dir, name, report.valid_bytes, rep)
            self._rotate(live, next_lsn, quarantine_rep=rep if report.damaged_lsns else None)
        else:
            self.gen = max((g for g, _ in files.get("log", [])), default=-1)
            self._rotate(live, 1)
        rep["log_rotated"] = True
        return live

    def _no_usable_log(self, files: dict, unusable: list[tuple[str, str]], rep: dict) -> None:
        """No log generation could be replayed. With no slab file nothing is left to recover (the
        first log is written before any slab, and blocks live only in slabs): start empty, saying so
        (not clean), after moving any unusable log to quarantine.
        Otherwise the blocks cannot be recovered (slabs hold no keys): refuse, or with
        ``on_missing_log="empty"`` move every log and slab file to quarantine and start empty with
        the reason in the report."""
        slabs, logs = files.get("slab", []), files.get("log", [])
        if not slabs and not logs:  # never reported clean: the files may also have been deleted
            rep["log_tail"] = "no log file and no slab file: started empty"
            return
        if not slabs:  # no block was ever written (slabs come before blocks): nothing to lose
            for _, name in logs:
                quarantine(self.fs, self.dir, name, rep)
            self.fs.fsync_dir(self.dir)
            rep["log_tail"] = "no usable log and no slab file: the log(s) were quarantined, started empty"
            return
        what = (f"log file(s) {', '.join(f'{n} ({why})' for n, why in unusable)}" if unusable
                else "no log file")
        if self.tuning.on_missing_log != "empty":
            raise SsdLogMissingError(
                f"SSD tier {self.dir}: {what} next to {len(slabs)} slab file(s): the blocks cannot be recovered "
                f"without a log (slabs hold no keys); the log and slab files were left as they are. "
                f"To start empty (the old files are moved to {self.dir}/quarantine/), "
                f"open with SsdTier(..., on_missing_log=\"empty\")")
        for _, name in logs + slabs:
            quarantine(self.fs, self.dir, name, rep)
        self.fs.fsync_dir(self.dir)
        rep["log_tail"] = f"{what}: started empty (on_missing_log='empty'); every block of {len(slabs)} slab(s) lost"

    def _replay(self, records: list[tuple[int, bytes]], report: RecoveryReport,
                notes: list[str]) -> dict[StoreKey, tuple[int, int, int, int, int]]:
        """The live set a generation describes. A generation file is created complete (its ``E``
        record included, :func:`ssd_log.create_generation`), so a missing ``E`` record next to damage
        the salvage scan skipped (just before the first batch record, or in the dropped tail) was
        lost in that damage: the snapshot records that survived are used and a note is added to
        ``notes`` (blocks of lost snapshot records are lost; every kept block is still crc-checked).
        Without such damage a missing or misplaced record makes the generation unusable."""
        state: dict[StoreKey, tuple[int, int, int, int, int]] = {}
        ended = False
        after_damage = {last + 1: (first, last) for first, last in report.damaged_lsns}
        for lsn, payload in records:
            kind, entries = L.decode_record(payload)
            if kind == L.KIND_END:
                ended = True
                continue
            if kind == L.KIND_BATCH and not ended and lsn in after_damage:
                ended = True
                notes.append("the end-of-snapshot record was lost in damaged log records %d..%d; the snapshot "
                             "records before them were used" % after_damage[lsn])
            if (kind == L.KIND_SNAPSHOT) == ended:
                raise ValueError(f"record {lsn} of kind {kind!r} is out of place")
            for op, kb, seg, off, size, crc in entries:
                key = StoreKey.from_bytes(kb)
                if op == L.PUT:
                    state[key] = (seg, off, size, crc, lsn)
                elif op == L.DEL:
                    cur = state.get(key)
                    if cur is not None and cur[0] == seg and cur[1] == off:
                        del state[key]
                else:
                    raise ValueError(f"record {lsn}: unknown entry kind {op!r}")
        if not ended and report.dropped_reason:
            ended = True
            notes.append(f"the end-of-snapshot record was lost in the damaged tail of the log "
                         f"({report.dropped_reason}); the snapshot records before it were used")
        if not ended:
            raise ValueError("the generation's snapshot is incomplete (no end record)")
        return state

    def _resolve(self, state, rep: dict) -> dict[StoreKey, BlockRecord]:
        """Live records that lie inside a slab, do not overlap a newer record and pass their crc."""
        live: dict[StoreKey, BlockRecord] = {}
        spans: dict[int, list[tuple[int, int]]] = {}  # slab -> sorted [(start, end)] kept so far
        for key, (seg, off, size, crc, lsn) in sorted(state.items(), key=lambda kv: -kv[1][4]):
            slab = self.slabs.get(seg)
            if slab is None or off % PAGE_BYTES or size <= 0 or off + size > slab[1]:
                rep["dropped"].append((key.hex(), f"log points outside any slab (slab {seg}, offset {off}, {size} B)"))
                continue
            start, end = off, off + _round_up(size)
            sp = spans.setdefault(seg, [])
            i = bisect.bisect_left(sp, (start, end))
            if (i > 0 and sp[i - 1][1] > start) or (i < len(sp) and sp[i][0] < end):
                rep["dropped"].append((key.hex(), f"overlaps a newer block in slab {seg} at offset {off}"))
                continue
            if self.tuning.verify_on_open:
                data = self.fs.pread(slab[0], size, off)
                if len(data) != size or block_crc(key.to_bytes(), data) != crc:
                    rep["dropped"].append((key.hex(), f"crc32c mismatch in slab {seg} at offset {off} ({size} B)"))
                    continue
            sp.insert(i, (start, end))
            live[key] = BlockRecord(seg, off, size, crc, durable=True, lsn=lsn)
        return live

    def _damaged_generation(self, name: str) -> bool:
        """Whether a log generation that recovery did not pick is damaged (unreadable, records skipped or a
        dropped tail): such a file is quarantined, not removed."""
        try:
            report = L.scan_generation(self.fs, self._p(name))[0]
        except Exception:  # noqa: BLE001 - any damage that makes it unreadable
            return True
        return bool(report.damaged_lsns or report.dropped_reason)

    def _name_lost_keys(self, name: str, report: RecoveryReport, records: list[tuple[int, bytes]],
                        live: dict[StoreKey, BlockRecord], rep: dict) -> None:
        """Name in the report the blocks whose put entries were in the damaged records of the replayed log
        (``_damaged_puts``), those not served; the dropped tail's message names them too."""
        lost = [k for k in dict.fromkeys(_damaged_puts(self.fs.read_file(self._p(name)), report, records))
                if k not in live]
        why = f"{name}: its put entry is in a damaged log record (key read from the damaged bytes, unverified)"
        rep["dropped"] += [(k.hex(), why) for k in lost]
        if lost and report.dropped_reason:
            shown = ", ".join(k.hex() for k in lost[:8]) + (f" and {len(lost) - 8} more" if len(lost) > 8 else "")
            rep["log_tail"] += f"; the dropped record(s) named block(s) {shown} (unverified keys)"

    def _rotate(self, live: dict[StoreKey, BlockRecord], next_lsn: int, *,
                quarantine_rep: dict | None = None) -> None:
        """Start log generation gen+1 holding a snapshot of ``live`` (durable blocks only). With
        ``quarantine_rep`` (recovery replayed the current generation with damage) the old generation is moved to
        quarantine/ (recorded there), not removed."""
        entries = [L.ENTRY.pack(L.PUT, k.to_bytes(), r.segment_id, r.offset_bytes, r.size_bytes, r.crc)
                   for k, r in live.items() if r.durable]
        step = L.SNAPSHOT_ENTRIES_PER_RECORD
        records = [L.encode_record(L.KIND_SNAPSHOT, entries[i : i + step]) for i in range(0, len(entries), step)]
        records.append(L.encode_record(L.KIND_END, []))
        new_gen = self.gen + 1
        while self.fs.exists(self._p(_log_name(new_gen))):  # a foreign file/directory holds that name
            new_gen += 1
        path = self._p(_log_name(new_gen))
        try:
            new = L.create_generation(self.fs, path, next_lsn, records)  # name durable too
        except BaseException:
            self._undo_generation(path)
            raise
        old, self.log = self.log, new
        old_gen, self.gen = self.gen, new_gen
        self._snapshot_bytes = len(entries) * L.ENTRY_BYTES
        if old is not None:
            old.close()
        if old_gen >= 0 and self.fs.exists(self._p(_log_name(old_gen))):
            if quarantine_rep is not None:  # damaged: evidence, never deleted (if this fails, the next open does it)
                quarantine(self.fs, self.dir, _log_name(old_gen), quarantine_rep)
            else:
                self.fs.unlink(self._p(_log_name(old_gen)))  # not durable if this fails: recovery sweeps it
            self.fs.fsync_dir(self.dir)

    def _undo_generation(self, path: str) -> None:
        """``create_generation`` failed. If it got as far as renaming the new generation into place
        (its directory fsync failed), that complete, newer file would be picked by the next open
        while the tier keeps committing to the current generation, losing every commit made from
        now on: remove it and make that durable. If that fails too, raise
        :class:`StaleGenerationError` (the tier must stop acknowledging writes). The path did not
        exist before the rotation (``_rotate`` skips taken names), so a file there is ours."""
        if not self.fs.exists(path):
            return
        try:
            self.fs.unlink(path)
            self.fs.fsync_dir(self.dir)
        except OSError as exc:
            raise StaleGenerationError(
                errno.EIO, f"SSD tier {self.dir}: a failed log rotation left {path}, newer than the log in use, "
                           f"and removing it durably failed ({exc}); the next open may pick it, so no write "
                           f"may be acknowledged after this") from exc

    # ---------------------------------------------------------------- running
    def _new_slab(self) -> _Slab | None:
        total = sum(s.size_bytes for s in self.slabs.values())
        size = min(self.slab_bytes, self.capacity_bytes - total) // PAGE_BYTES * PAGE_BYTES
        if size < PAGE_BYTES:
            return None
        no = max(self.slabs, default=-1) + 1
        while self.fs.exists(self._p(_slab_name(no))) or self.fs.exists(self._p(_slab_name(no)) + ".tmp"):
            no += 1  # a foreign file/directory holds that name
        path = self._p(_slab_name(no))
        tmp = path + ".tmp"
        fs = self.fs
        fd = fs.open(tmp, "x")
        try:
            fs.fallocate(fd, 0, size)
            fs.fsync(fd)
            fs.rename(tmp, path)
            fs.fsync_dir(self.dir)
        except BaseException:
            fs.close(fd)
            if fs.exists(tmp):
                fs.unlink(tmp)
            elif fs.exists(path):  # renamed, its directory fsync failed: an empty slab nothing owns
                try:
                    fs.unlink(path)  # if this is lost in a crash, the next open adopts an empty slab
                except OSError:
                    pass  # the error that matters is the one raised below
            raise
        slab = _Slab(no, fd, size, [])
        self.slabs[no] = slab
        return slab

    def stage(self, key: StoreKey, data: memoryview, crc: int) -> BlockRecord:
        size = len(data)
        slab = x = None
        for s in sorted(self.slabs.values(), key=lambda s: -s.no):  # newest slab first
            try:
                x = s.alloc.allocate(size)
                slab = s
                break
            except _alloc.AllocatorError:  # no room (or the block is larger than this slab)
                continue
        if slab is None:
            try:
                slab = self._new_slab()
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise DiskFullError(f"SSD tier {self.dir}: disk full creating a slab for {size} B block "
                                        f"{key.hex()} ({exc})") from exc
                raise
            if slab is None:
                raise StoreFullError(
                    f"SSD tier {self.dir}: no room for a {size} B block {key.hex()} "
                    f"(capacity {self.capacity_bytes} B, {self.free_bytes()} B free)")
            try:
                x = slab.alloc.allocate(size)
            except _alloc.AllocatorError as exc:
                raise StoreFullError(f"SSD tier {self.dir}: no room for a {size} B block {key.hex()} "
                                     f"({self.free_bytes()} B free, fragmented: {exc})") from exc
        rec = BlockRecord(slab.no, x.offset, size, crc, handle=x.handle)
        try:
            self.fs.pwrite(slab.fd, data, x.offset)
        except BaseException:
            slab.alloc.free(x.handle)
            raise
        return rec

    def commit(self, puts: list[tuple[StoreKey, BlockRecord]], deletes: list[tuple[StoreKey, BlockRecord]]) -> None:
        fs = self.fs
        for no in sorted({r.segment_id for _, r in puts}):
            fs.fdatasync(self.slabs[no].fd)
        entries = [L.ENTRY.pack(L.PUT, k.to_bytes(), r.segment_id, r.offset_bytes, r.size_bytes, r.crc) for k, r in puts]
        entries += [L.ENTRY.pack(L.DEL, k.to_bytes(), r.segment_id, r.offset_bytes, 0, 0) for k, r in deletes]
        lsn = self.log.append(L.encode_record(L.KIND_BATCH, entries))
        self.log.sync()
        for _, r in puts:
            r.lsn = lsn

    def after_commit(self, live: dict[StoreKey, BlockRecord]) -> None:
        """Rotate the log when it has grown past its budget (called with nothing pending)."""
        if self.log.size_bytes > max(self.tuning.log_rotate_bytes, 4 * self._snapshot_bytes):
            self._rotate(live, self.log.next_lsn)

    def release(self, recs: Iterable[BlockRecord]) -> None:
        for r in recs:
            if r.handle >= 0:
                self.slabs[r.segment_id].alloc.free(r.handle)
                r.handle = -1

    abort = release

    def read_into(self, rec: BlockRecord, out: memoryview) -> int:
        return self.fs.preadinto(self.slabs[rec.segment_id].fd, out[: rec.size_bytes], rec.offset_bytes)

    @staticmethod
    def footprint_bytes(size_bytes: int) -> int:
        """Bytes of capacity one block of ``size_bytes`` takes."""
        return _round_up(size_bytes)

    def free_bytes(self) -> int:
        return self.capacity_bytes - sum(s.size_bytes - s.alloc.storage_report().total_free_bytes
                                         for s in self.slabs.values())

    def close(self) -> None:
        """Close the log and every slab handle (also after an open that failed half-way, when
        ``slabs`` still holds ``(fd, usable)`` tuples), even if closing the log fails."""
        try:
            if self.log is not None:
                self.log.close()
        finally:
            slabs, self.slabs = self.slabs, {}
            for s in slabs.values():
                self.fs.close(s.fd if isinstance(s, _Slab) else s[0])

