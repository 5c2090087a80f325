"""The SSD tier's file-per-block layout: one self-describing object file per block.

An object file ``o-XXXXXXXX.qco`` (XXXXXXXX = the object number, the block's ``segment_id``) is a
64-byte header ``magic | key 24 B | size u64 | crc32c(key || payload) u32 | object no u32 |
header crc32c u32`` followed by the payload. Publication is the textbook atomic publish
(REFERENCE §7): write ``o-XXXXXXXX.tmp``, fdatasync it, rename it to its final name, fsync the
directory; a group commit fdatasyncs every temp file of the batch, renames them all, unlinks the
deleted blocks' files and fsyncs the directory once. The directory is this layout's log: a final
name exists only for a fully synced object, so recovery = list the directory, check every
header and payload crc32c, sweep temp files. A damaged object (header, size or crc32c) is named in
the report (by key when its header still decodes) and moved to ``quarantine/``; so is the file of a
block found damaged on read (``BlockRecord.damaged``): at the group commit that logs its delete, or
at once if it was still staged. Only files of blocks deleted by the caller, superseded copies and
unpublished temp files are ever unlinked. Object numbers are
taken from the free ones (the next one up, else the lowest free), so no file name can exhaust them.
"""

from __future__ import annotations

import struct

import crc32c as _crc

from quillcache.store.errors import StoreFullError
from quillcache.durability.fs import FileSystem
from quillcache.store.keys import StoreKey
from quillcache.store.ssd_format import PAGE_BYTES, BlockRecord, SsdTuning, block_crc, quarantine

_MAGIC = b"QCOBJ\x00\x01\x00"
_HEAD = struct.Struct("<8s24sQII")  # magic, key, size, crc, object no; header crc follows
HEADER_BYTES = 64
_MAX_OBJECT_NO = (1 << 32) - 1


def _final(no: int) -> str:
    return f"o-{no:08x}.qco"


def _tmp(no: int) -> str:
    return f"o-{no:08x}.tmp"


def encode_header(key_bytes: bytes, size: int, crc: int, no: int) -> bytes:
    body = _HEAD.pack(_MAGIC, key_bytes, size, crc, no)
    head = body + struct.pack("<I", _crc.crc32c(body))
    return head + bytes(HEADER_BYTES - len(head))


def decode_header(raw: bytes) -> tuple[bytes, int, int, int] | None:
    if len(raw) < HEADER_BYTES:
        return None
    body = raw[: _HEAD.size]
    if raw[_HEAD.size + 4 : HEADER_BYTES] != bytes(HEADER_BYTES - _HEAD.size - 4):
        return None  # the padding is zero: a flip anywhere in the header is detected
    if struct.unpack_from("<I", raw, _HEAD.size)[0] != _crc.crc32c(body):
        return None
    magic, kb, size, crc, no = _HEAD.unpack(body)
    if magic != _MAGIC:
        return None
    return kb, size, crc, no


class FilesLayout:
    """One file per block. Called by SsdTier with its lock held; raises OSError / StoreFullError."""

    name = "files"

    def __init__(self, fs: FileSystem, directory: str, capacity_bytes: int, tuning: SsdTuning, slab_bytes: int) -> None:
        self.fs, self.dir, self.capacity_bytes, self.tuning = fs, directory, capacity_bytes, tuning
        self.max_block_bytes = min(tuning.max_block_bytes or capacity_bytes, capacity_bytes)
        self.next_no = 1
        self._used_nos: set[int] = set()  # numbers of live and staged objects
        self._allocated = 0

    def _p(self, name: str) -> str:
        return f"{self.dir}/{name}"

    @staticmethod
    def footprint_bytes(size_bytes: int) -> int:
        return -(-(size_bytes + HEADER_BYTES) // PAGE_BYTES) * PAGE_BYTES

    def free_bytes(self) -> int:
        return self.capacity_bytes - self._allocated

    # ---------------------------------------------------------------- recovery
    def recover(self, files: dict[str, list[tuple[int, str]]], rep: dict) -> dict[StoreKey, BlockRecord]:
        fs = self.fs
        for no, name in files.get("object_tmp", []):
            fs.unlink(self._p(name))
            rep["swept"].append(name)
        live: dict[StoreKey, BlockRecord] = {}
        doomed: list[str] = []
        damaged: list[str] = []
        for no, name in sorted(files.get("object", [])):
            why, head = self._check_object(no, name)
            if why:
                rep["dropped"].append((StoreKey.from_bytes(head[0]).hex() if head else name, f"{name}: {why}"))
                damaged.append(name)
                continue
            kb, size, crc, _ = head
            key = StoreKey.from_bytes(kb)
            old = live.get(key)
            if old is not None:  # a delete + re-put whose unlink was lost: the newer copy wins
                doomed.append(_final(old.segment_id))
            live[key] = BlockRecord(no, HEADER_BYTES, size, crc, durable=True)
        for name in damaged:
            quarantine(fs, self.dir, name, rep)  # evidence: moved aside, never deleted
        for name in doomed:
            fs.unlink(self._p(name))
        if doomed or damaged:
            fs.fsync_dir(self.dir)
        self._used_nos = {r.segment_id for r in live.values()}
        self.next_no = max(self._used_nos, default=0) + 1
        self._allocated = sum(self.footprint_bytes(r.size_bytes) for r in live.values())
        return live

    def _check_object(self, no: int, name: str) -> tuple[str, tuple | None]:
        """``(why it is damaged or "", decoded header or None)`` for one object file."""
        fs = self.fs
        fd = fs.open(self._p(name), "r")
        try:
            head = decode_header(fs.pread(fd, HEADER_BYTES, 0))
            if head is None:
                return "object header damaged", None
            kb, size, crc, hno = head
            if hno != no:
                return f"header names object {hno:08x} (renamed file)", head
            if fs.fsize(fd) != HEADER_BYTES + size:
                return f"object file is {fs.fsize(fd)} B, header says {HEADER_BYTES + size}", head
            if self.tuning.verify_on_open and block_crc(kb, fs.pread(fd, size, HEADER_BYTES)) != crc:
                return "crc32c mismatch", head
            return "", head
        finally:
            fs.close(fd)

    def _take_no(self) -> int:
        """A free object number: the next one up, else (numbers up to 2^32-1 used or named) the
        lowest number no live or staged object holds and no file in the directory is named after."""
        fs, taken = self.fs, self._used_nos

        def free(n: int) -> bool:  # a foreign directory may hold an object's name
            return n not in taken and not fs.exists(self._p(_final(n))) and not fs.exists(self._p(_tmp(n)))

        no = self.next_no
        while no <= _MAX_OBJECT_NO and not free(no):
            no += 1
        if no > _MAX_OBJECT_NO:
            no = next((n for n in range(1, _MAX_OBJECT_NO + 1) if free(n)), None)
            if no is None:
                raise StoreFullError(f"SSD tier {self.dir}: every object number is in use")
        self.next_no = no + 1
        self._used_nos.add(no)
        return no

    # ---------------------------------------------------------------- running
    def stage(self, key: StoreKey, data: memoryview, crc: int) -> BlockRecord:
        size = len(data)
        need = self.footprint_bytes(size)
        if need > self.free_bytes():
            raise StoreFullError(f"SSD tier {self.dir}: no room for a {size} B block {key.hex()} "
                                 f"(capacity {self.capacity_bytes} B, {self.free_bytes()} B free)")
        no = self._take_no()
        fs = self.fs
        path = self._p(_tmp(no))
        try:
            fd = fs.open(path, "x")
        except BaseException:
            self._used_nos.discard(no)
            raise
        try:
            fs.pwrite(fd, encode_header(key.to_bytes(), size, crc, no), 0)
            fs.pwrite(fd, data, HEADER_BYTES)
        except BaseException:
            fs.close(fd)
            fs.unlink(path)
            self._used_nos.discard(no)
            raise
        self._allocated += need
        return BlockRecord(no, HEADER_BYTES, size, crc, fd=fd)

    def commit(self, puts: list[tuple[StoreKey, BlockRecord]], deletes: list[tuple[StoreKey, BlockRecord]]) -> None:
        fs = self.fs
        for _, r in puts:
            fs.fdatasync(r.fd)
        for _, r in puts:
            fs.close(r.fd)
            r.fd = -1
            fs.rename(self._p(_tmp(r.segment_id)), self._p(_final(r.segment_id)))
        for _, r in deletes:
            try:
                if r.damaged:  # evidence: moved aside, never deleted
                    quarantine(fs, self.dir, _final(r.segment_id), {})
                else:
                    fs.unlink(self._p(_final(r.segment_id)))
            except FileNotFoundError:
                pass
        fs.fsync_dir(self.dir)

    def after_commit(self, live: dict[StoreKey, BlockRecord]) -> None:
        pass

    def release(self, recs) -> None:
        for r in recs:
            self._allocated -= self.footprint_bytes(r.size_bytes)
            self._used_nos.discard(r.segment_id)

    def abort(self, recs) -> None:
        """Drop staged (never published) objects: close and unlink their temp files (one that failed its
        check on read is moved to quarantine/ instead)."""
        for r in recs:
            if r.fd >= 0:
                try:
                    self.fs.close(r.fd)
                except OSError:
                    pass
                r.fd = -1
            for name in (_tmp(r.segment_id), _final(r.segment_id)):  # renamed already if the dir fsync failed
                try:
                    if r.damaged:
                        quarantine(self.fs, self.dir, name, {})
                        self.fs.fsync_dir(self.dir)
                        break
                    self.fs.unlink(self._p(name))
                except OSError:
                    pass
            self._allocated -= self.footprint_bytes(r.size_bytes)
            self._used_nos.discard(r.segment_id)

    def read_into(self, rec: BlockRecord, out: memoryview) -> int:
        name = _final(rec.segment_id) if rec.fd < 0 else _tmp(rec.segment_id)
        if rec.fd >= 0:
            return self.fs.preadinto(rec.fd, out[: rec.size_bytes], HEADER_BYTES)
        fd = self.fs.open(self._p(name), "r")
        try:
            return self.fs.preadinto(fd, out[: rec.size_bytes], HEADER_BYTES)
        finally:
            self.fs.close(fd)

    def close(self) -> None:
        pass
