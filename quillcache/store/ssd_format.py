"""What the SSD tier's two layouts share: tuning, the per-block record, the recovery report, the
directory's file names and its metadata file.

Every name the tier creates matches :func:`owned_kind`; any other name in the directory is
*foreign*: reported, never opened for writing, never deleted. The lock file ``quillcache-ssd.lock``
(:class:`quillcache.durability.dirlock.DataDirLock`, one tier per directory on the real file system) is
the tier's too: it holds the holder's pid and no data. The metadata file
``quillcache-ssd.meta`` (magic, layout, slab geometry, crc32c) is written once, atomically, when
the directory is initialised; a non-empty directory without it is refused (ForeignFileError).
"""

from __future__ import annotations

import json
import re
import struct
import time
from dataclasses import dataclass, field

import crc32c as _crc

from quillcache._checks import check_int
from quillcache.store.errors import ForeignFileError
from quillcache.durability.fs import FileSystem
from quillcache.store.keys import StoreKey

LAYOUTS = ("slab", "files")
DEFAULT_LAYOUT = "slab"  # chosen by measurement: see quillcache.store.ssd and results/store_ssd
META = "quillcache-ssd.meta"
LOCK = "quillcache-ssd.lock"  # the DataDirLock of the directory (real file system only)
QUARANTINE = "quarantine"  # folder inside the tier directory where damaged files are moved, never deleted
ON_MISSING_LOG = ("refuse", "empty")
_META_MAGIC = b"QCSSDT01"
PAGE_BYTES = 4096

_OWNED = {
    "meta": re.compile(r"^quillcache-ssd\.meta(\.tmp)?$"),
    "lock": re.compile(r"^quillcache-ssd\.lock$"),
    "log": re.compile(r"^log-(\d{8,})\.qcl$"),
    "log_tmp": re.compile(r"^log-(\d{8,})\.qcl\.tmp$"),
    "slab": re.compile(r"^slab-(\d{5})\.qcs$"),
    "slab_tmp": re.compile(r"^slab-(\d{5})\.qcs\.tmp$"),
    "object": re.compile(r"^o-([0-9a-f]{8})\.qco$"),
    "object_tmp": re.compile(r"^o-([0-9a-f]{8})\.tmp$"),
}


def owned_kind(name: str) -> tuple[str, int] | None:
    """``(kind, number)`` of a file name the tier owns, or None for a foreign name."""
    for kind, rx in _OWNED.items():
        m = rx.match(name)
        if m:
            if kind in ("meta", "lock"):
                return kind, 0
            return kind, int(m.group(1), 16 if kind.startswith("object") else 10)
    return None


@dataclass(frozen=True, kw_only=True)
class SsdTuning:
    """Knobs of the SSD tier (all have defaults; pass them as keyword arguments to SsdTier)."""

    layout: str | None = None  # None: the directory's layout, or DEFAULT_LAYOUT for a new one
    slab_bytes: int = 256 << 20  # slab layout: size of one slab file (fallocated when created)
    max_block_bytes: int | None = None  # default: slab_bytes (slab) / capacity (files)
    group_commit_blocks: int = 64  # put_async: commit automatically once this many are pending...
    group_commit_bytes: int = 32 << 20  # ...or this many bytes
    log_rotate_bytes: int = 64 << 20  # start a new log generation past this size (and 4x the snapshot)
    verify_on_open: bool = True  # read every object and check its crc32c during recovery
    on_missing_log: str = "refuse"  # slab layout, log missing/unusable while slabs exist: "refuse" or "empty"

    def __post_init__(self) -> None:
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} must be one of {LAYOUTS}")
        for name in ("slab_bytes", "group_commit_blocks", "group_commit_bytes", "log_rotate_bytes"):
            check_int(name, getattr(self, name), 1, type_error=ValueError)
        if self.on_missing_log not in ON_MISSING_LOG:
            raise ValueError(f"on_missing_log={self.on_missing_log!r} must be one of {ON_MISSING_LOG}")
        if self.slab_bytes % PAGE_BYTES:
            raise ValueError(f"slab_bytes={self.slab_bytes} must be a multiple of {PAGE_BYTES}")
        if self.max_block_bytes is not None:
            check_int("max_block_bytes", self.max_block_bytes, 1, type_error=ValueError)


@dataclass(slots=True)
class BlockRecord:
    """Where one stored block lives. ``segment_id`` is the slab number (slab layout) or the object
    file number (files layout); ``crc`` is crc32c(key bytes || payload)."""

    segment_id: int
    offset_bytes: int
    size_bytes: int
    crc: int
    handle: int = -1  # allocator handle (slab layout)
    durable: bool = False
    lsn: int = 0  # log LSN of the put (slab layout; orders overlapping records at recovery)
    fd: int = -1  # open temp file while staged (files layout)
    damaged: bool = False  # failed its check on read: its file goes to quarantine/, never deleted (files layout)


def block_crc(key_bytes: bytes, data) -> int:
    return _crc.crc32c(data, _crc.crc32c(key_bytes))


@dataclass(frozen=True)
class SsdRecoveryReport:
    """What opening (= recovering) the tier found and did."""

    directory: str
    layout: str
    created: bool  # the directory was initialised by this open
    blocks_kept: int
    bytes_kept: int
    dropped: tuple[tuple[str, str], ...] = field(default=())  # (block key hex or file, why)
    swept_temp_files: tuple[str, ...] = field(default=())
    foreign_files: tuple[str, ...] = field(default=())
    log_records: int = 0
    log_damaged_lsns: tuple[tuple[int, int], ...] = field(default=())
    log_tail: str = ""  # why log replay stopped before the end of the file ("" = clean)
    log_rotated: bool = False
    quarantined: tuple[str, ...] = field(default=())  # damaged files moved under <directory>/quarantine/

    @property
    def clean(self) -> bool:
        return not (self.dropped or self.swept_temp_files or self.log_damaged_lsns or self.log_tail
                    or self.quarantined)


_META_HEAD = struct.Struct("<8sI")  # magic, json length; crc32c u32 follows the json


def encode_meta(layout: str, slab_bytes: int) -> bytes:
    body = json.dumps({"layout": layout, "slab_bytes": slab_bytes, "page_bytes": PAGE_BYTES}).encode()
    raw = _META_HEAD.pack(_META_MAGIC, len(body)) + body
    return raw + struct.pack("<I", _crc.crc32c(raw))


def decode_meta(raw: bytes, path: str) -> dict:
    if len(raw) < _META_HEAD.size + 4 or raw[:8] != _META_MAGIC:
        raise ForeignFileError(f"{path}: not a QuillCache SSD tier metadata file")
    _, n = _META_HEAD.unpack_from(raw, 0)
    end = _META_HEAD.size + n
    if len(raw) != end + 4 or struct.unpack_from("<I", raw, end)[0] != _crc.crc32c(raw[:end]):
        raise ForeignFileError(f"{path}: SSD tier metadata file is damaged (crc32c mismatch)")
    meta = json.loads(raw[_META_HEAD.size : end])
    if meta.get("layout") not in LAYOUTS:
        raise ForeignFileError(f"{path}: unknown layout {meta.get('layout')!r}")
    return meta


def write_meta(fs: FileSystem, directory: str, layout: str, slab_bytes: int) -> None:
    """Atomic publish of the metadata file (temp, fsync, rename, fsync dir)."""
    tmp = f"{directory}/{META}.tmp"
    if fs.exists(tmp):
        fs.unlink(tmp)
    fd = fs.open(tmp, "x")
    try:
        fs.pwrite(fd, encode_meta(layout, slab_bytes), 0)
        fs.fsync(fd)
    finally:
        fs.close(fd)
    fs.rename(tmp, f"{directory}/{META}")
    fs.fsync_dir(directory)


def _quarantine_slot(fs: FileSystem, directory: str, name: str) -> tuple[str, str]:
    """``(quarantine dir, a free file name in it for name)``: ``<UTC timestamp>-<name>``, or
    ``<timestamp>.<n>-<name>`` when taken; the quarantine dir is created (and made durable) when missing."""
    qdir = f"{directory}/{QUARANTINE}"
    if not fs.exists(qdir):
        fs.mkdir(qdir)
        fs.fsync_dir(directory)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dst, n = f"{stamp}-{name}", 1
    while fs.exists(f"{qdir}/{dst}"):
        n += 1
        dst = f"{stamp}.{n}-{name}"
    return qdir, dst


def quarantine_tail(fs: FileSystem, directory: str, name: str, offset: int, rep: dict) -> str:
    """Copy the bytes of ``directory/name`` from ``offset`` on (a log's dropped tail: a crash's torn write, or
    damage to its last records, which the log cannot tell apart) to ``quarantine/<UTC timestamp>-<name>.tail-<offset>``,
    fsynced, and record it in ``rep["quarantined"]``. Keeps the evidence at the size of the damage, so a tier that
    crashes often does not fill its disk with whole log generations."""
    fd = fs.open(f"{directory}/{name}", "r")
    try:
        data = fs.pread(fd, max(0, fs.fsize(fd) - offset), offset)
    finally:
        fs.close(fd)
    qdir, dst = _quarantine_slot(fs, directory, f"{name}.tail-{offset}")
    out = fs.open(f"{qdir}/{dst}", "x")
    try:
        fs.pwrite(out, data, 0)
        fs.fsync(out)
    finally:
        fs.close(out)
    fs.fsync_dir(qdir)
    rep.setdefault("quarantined", []).append(f"{QUARANTINE}/{dst}")
    return dst


def quarantine(fs: FileSystem, directory: str, name: str, rep: dict) -> str:
    """Move ``directory/name`` to ``directory/quarantine/<UTC timestamp>-<name>`` (never delete a
    damaged file: it is evidence); record the new relative path in ``rep["quarantined"]``. The caller
    fsyncs ``directory`` (one directory fsync covers every move of a recovery)."""
    qdir, dst = _quarantine_slot(fs, directory, name)
    fs.rename(f"{directory}/{name}", f"{qdir}/{dst}")
    fs.fsync_dir(qdir)
    rep.setdefault("quarantined", []).append(f"{QUARANTINE}/{dst}")
    return dst


def key_hex(key: StoreKey) -> str:
    return key.hex()
