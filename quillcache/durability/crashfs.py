"""A crash-simulating, in-memory FileSystem (SQLite crash-VFS style) for crash tests of everything
durable: the write-ahead log, the SSD tier and the ART index (which may share one instance).

Model (pessimistic POSIX; what the tier may rely on is exactly what survives here):

- Every file (inode) keeps its *synced* image and the list of operations since its last
  successful ``fsync``/``fdatasync`` (writes, truncates, fallocate extensions). Reads see the
  current state, as with a page cache.
- Every directory keeps its *durable* name table and the name operations since its last
  ``fsync_dir`` (create, rename, link, unlink; a rename within one directory is one atomic
  operation). Syncing a file does NOT make its name durable. Directories themselves (``mkdir``)
  are durable at once (each component creates its own directory once). ``mkdir`` needs its parent
  (``FileNotFoundError``; ``NotADirectoryError`` when the parent is a file) and ``fsync_dir`` an
  existing directory (the same errors), as on a real disk. The root (``/`` for absolute paths,
  ``.`` for relative ones) is the simulation's boundary, not one of its directories: a top-level
  directory needs no parent, and ``fsync_dir`` of the root is a no-op that is not counted as a sync
  call (so a tier at ``/t`` can sync its parent as it does on a real disk).
- :meth:`CrashFs.crash` builds the disk a power loss would leave: each directory keeps a random
  *prefix* of its unsynced name operations (journaled file systems commit metadata in order), and
  each unsynced file operation is independently kept, dropped, torn (only a random prefix of the
  write lands) or garbled (a random sub-range of the write lands as random bytes), in order, on
  top of the synced image. The result is a fresh CrashFs (nothing pending) to reopen the tier on.
  ``crash(rng, zero_fill=True)`` adds a fifth fate, zeroed: the write's range lands as zero bytes
  (ext4/XFS after a power loss: the size was extended, the data blocks never written). The default
  draws exactly the four fates, with the same random sequence as before the fifth existed.
- ``crash_at_sync=n``: the n-th sync call (fsync, fdatasync or fsync_dir, counted from 1) raises
  :class:`SimulatedCrash` *instead of* syncing; from then on every call raises it, so the code
  under test cannot change the disk any more. ``crash()`` then gives the surviving disk.
- Fault injection: :meth:`fail_next_fsync` makes the next sync calls fail with ``EIO`` (nothing
  becomes durable). A failed ``fsync``/``fdatasync`` loses the file's unsynced operations for good,
  as Linux (>= 4.13) does when it marks the pages clean after a writeback error: no later sync makes
  them durable and a crash drops them, while reads still see them (the page cache). This is the
  pessimistic end (on a real disk some may have landed); what the simulator guarantees is only that
  a retried fsync saves nothing. A failed ``fsync_dir`` leaves its directory's name operations
  pending (journaled metadata: a crash keeps a prefix of them); ``disk_bytes`` caps the total file bytes (a write that does not fit lands
  partially and raises ``ENOSPC``; fallocate is all or nothing); :meth:`corrupt` flips bytes of a
  file as bit rot would (in the synced image too).

:class:`SimulatedCrash` is a ``BaseException`` so that ``except Exception``/``except OSError`` in
the code under test never swallows it.
"""

from __future__ import annotations

import errno
import os
import random
from dataclasses import dataclass, field

from quillcache.durability.fs import CREATE_EXCL, MODES, READ, FileStat, FileSystem


# What happens to one unsynced file operation at a crash, and how often (crash()).
_FATES = ("keep", "drop", "torn", "garble")
_WEIGHTS = (4, 2, 1, 1)


class SimulatedCrash(BaseException):
    """The simulated machine lost power; nothing after this point reaches the disk."""


@dataclass(slots=True)
class _Inode:
    data: bytearray  # what reads see
    synced: bytearray  # what is durable
    pending: list[tuple] = field(default_factory=list)  # ("w", offset, bytes) | ("t", size)
    lost: bool = False  # a failed fsync lost writes that ``data`` still shows: data != synced + pending


_ROOTS = ("/", ".")  # the boundary of the simulated tree (module docstring)


def _split(path: str) -> tuple[str, str]:
    path = os.path.normpath(path)
    return os.path.dirname(path) or ".", os.path.basename(path)


def _apply(img: bytearray, op: tuple) -> None:
    """Apply one file operation (a write or a truncate) to ``img`` in place."""
    if op[0] == "t":
        size = op[1]
        if size <= len(img):
            del img[size:]
        else:
            img.extend(bytes(size - len(img)))
        return
    _, off, raw = op
    if off > len(img):
        img.extend(bytes(off - len(img)))
    img[off : off + len(raw)] = raw


@dataclass(frozen=True)
class CrashStats:
    """What one ``crash()`` did to the unsynced state."""

    writes_kept: int = 0
    writes_dropped: int = 0
    writes_torn: int = 0
    writes_garbled: int = 0
    dir_ops_kept: int = 0
    dir_ops_lost: int = 0
    writes_zeroed: int = 0  # only with crash(..., zero_fill=True)


class CrashFs(FileSystem):
    """In-memory file system with simulated power loss; see the module docstring."""

    def __init__(self, *, disk_bytes: int | None = None, crash_at_sync: int | None = None) -> None:
        self.disk_bytes = disk_bytes
        self.crash_at_sync = crash_at_sync
        self.sync_calls = 0
        self._inodes: dict[int, _Inode] = {}
        self._dirs: dict[str, dict[str, int]] = {}
        self._durable: dict[str, dict[str, int]] = {}
        self._dir_ops: dict[str, list[tuple]] = {}
        self._fds: dict[int, tuple[int, bool]] = {}
        self._next_ino = 1
        self._next_fd = 3
        self._fail_syncs = 0
        self._crashed = False
        self.last_crash: CrashStats | None = None

    # ---------------------------------------------------------------- fault injection
    def fail_next_fsync(self, count: int = 1) -> None:
        """The next ``count`` sync calls fail with EIO (and sync nothing)."""
        self._fail_syncs = count

    def corrupt(self, path: str, offset: int, xor: int = 0x01) -> None:
        """XOR one byte of a file (current and synced image): bit rot."""
        ino = self._inodes[self._lookup(path)]
        if not 0 <= offset < len(ino.data):
            raise ValueError(f"offset {offset} is outside {path} ({len(ino.data)} B)")
        ino.data[offset] ^= xor
        if offset < len(ino.synced):
            ino.synced[offset] ^= xor

    @property
    def used_bytes(self) -> int:
        return sum(len(i.data) for i in self._inodes.values())

    # ---------------------------------------------------------------- helpers
    def _alive(self) -> None:
        if self._crashed:
            raise SimulatedCrash("the simulated disk has crashed")

    def _lookup(self, path: str) -> int:
        d, n = _split(path)
        names = self._dirs.get(d)
        if names is None or n not in names:
            raise FileNotFoundError(errno.ENOENT, "no such file", path)
        return names[n]

    def _fd(self, fd: int, write: bool = False) -> _Inode:
        self._alive()
        entry = self._fds.get(fd)
        if entry is None:
            raise OSError(errno.EBADF, f"bad file handle {fd}")
        if write and not entry[1]:
            raise OSError(errno.EBADF, f"handle {fd} is read-only")
        return self._inodes[entry[0]]

    def _sync_point(self) -> None:
        self._alive()
        self.sync_calls += 1
        if self.crash_at_sync is not None and self.sync_calls >= self.crash_at_sync:
            self._crashed = True
            raise SimulatedCrash(f"power lost at sync call {self.sync_calls}")
        if self._fail_syncs > 0:
            self._fail_syncs -= 1
            raise OSError(errno.EIO, "simulated fsync failure")

    def _room(self) -> int:
        return (self.disk_bytes - self.used_bytes) if self.disk_bytes is not None else 1 << 62

    def _gc(self) -> None:
        """Forget inodes no name (current or durable) and no handle refers to."""
        refs = {ino for ns in self._dirs.values() for ino in ns.values()}
        refs |= {ino for ns in self._durable.values() for ino in ns.values()}
        refs |= {ino for ino, _ in self._fds.values()}
        refs |= {op[-1] for ops in self._dir_ops.values() for op in ops if op[0] in ("set", "mv")}
        for ino in [i for i in self._inodes if i not in refs]:
            del self._inodes[ino]

    # ---------------------------------------------------------------- FileSystem
    def open(self, path: str, mode: str) -> int:
        self._alive()
        if mode not in MODES:
            raise ValueError(f"open mode must be one of {MODES}, got {mode!r}")
        d, n = _split(path)
        names = self._dirs.get(d)
        if names is None:
            raise FileNotFoundError(errno.ENOENT, "no such directory", d)
        if mode == CREATE_EXCL:
            if n in names or os.path.join(d, n) in self._dirs:
                raise FileExistsError(errno.EEXIST, "file exists", path)
            ino = self._next_ino
            self._next_ino += 1
            self._inodes[ino] = _Inode(bytearray(), bytearray())
            names[n] = ino
            self._dir_ops[d].append(("set", n, ino))
        else:
            ino = self._lookup(path)
        fd = self._next_fd
        self._next_fd += 1
        self._fds[fd] = (ino, mode != READ)
        return fd

    def close(self, fd: int) -> None:
        self._fd(fd)
        del self._fds[fd]
        self._gc()

    def pwrite(self, fd: int, data, offset: int) -> int:
        ino = self._fd(fd, write=True)
        raw = bytes(memoryview(data).cast("B"))
        grow = max(0, offset + len(raw) - len(ino.data))
        room = self._room()
        short = grow > room
        if short:
            raw = raw[: max(0, len(raw) - (grow - room))]
        if raw:
            if offset > len(ino.data):
                ino.data.extend(bytes(offset - len(ino.data)))
            ino.data[offset : offset + len(raw)] = raw
            ino.pending.append(("w", offset, raw))
        if short:
            raise OSError(errno.ENOSPC, "simulated disk full")
        return len(raw)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        ino = self._fd(fd)
        return bytes(ino.data[offset : offset + size])

    def fsync(self, fd: int) -> None:
        ino = self._fd(fd)
        try:
            self._sync_point()
        except OSError:  # EIO: the unsynced operations are lost for good (module docstring)
            if ino.pending:
                ino.pending.clear()
                ino.lost = True
            raise
        if ino.lost:  # data shows writes that were lost: only what came after them becomes durable
            for op in ino.pending:
                _apply(ino.synced, op)
        else:
            ino.synced = bytearray(ino.data)
        ino.pending.clear()

    fdatasync = fsync

    def truncate(self, fd: int, size: int) -> None:
        ino = self._fd(fd, write=True)
        if size > len(ino.data):
            if size - len(ino.data) > self._room():
                raise OSError(errno.ENOSPC, "simulated disk full")
            ino.data.extend(bytes(size - len(ino.data)))
        else:
            del ino.data[size:]
        ino.pending.append(("t", size))

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        ino = self._fd(fd, write=True)
        if offset + length > len(ino.data):
            self.truncate(fd, offset + length)

    def fsize(self, fd: int) -> int:
        return len(self._fd(fd).data)

    def map_copy(self, fd: int) -> None:
        self._fd(fd)  # a closed handle is EBADF here too
        return None  # the caller reads the file instead (FileSystem.map_copy)

    def rename(self, src: str, dst: str) -> None:
        self._alive()
        ino = self._lookup(src)
        sd, sn = _split(src)
        dd, dn = _split(dst)
        if dd not in self._dirs:
            raise FileNotFoundError(errno.ENOENT, "no such directory", dd)
        del self._dirs[sd][sn]
        self._dirs[dd][dn] = ino
        if sd == dd:
            self._dir_ops[sd].append(("mv", sn, dn, ino))
        else:
            self._dir_ops[dd].append(("set", dn, ino))
            self._dir_ops[sd].append(("del", sn))
        self._gc()

    def link(self, src: str, dst: str) -> None:
        self._alive()
        ino = self._lookup(src)
        dd, dn = _split(dst)
        if dd not in self._dirs:
            raise FileNotFoundError(errno.ENOENT, "no such directory", dd)
        if dn in self._dirs[dd]:
            raise FileExistsError(errno.EEXIST, "file exists", dst)
        self._dirs[dd][dn] = ino
        self._dir_ops[dd].append(("set", dn, ino))

    def unlink(self, path: str) -> None:
        self._alive()
        self._lookup(path)
        d, n = _split(path)
        del self._dirs[d][n]
        self._dir_ops[d].append(("del", n))
        self._gc()

    def listdir(self, path: str) -> list[str]:
        self._alive()
        path = os.path.normpath(path)
        if path not in self._dirs:
            raise FileNotFoundError(errno.ENOENT, "no such directory", path)
        subdirs = [os.path.basename(p) for p in self._dirs if os.path.dirname(p) == path and p != path]
        return sorted(list(self._dirs[path]) + subdirs)

    def _need_dir(self, path: str) -> None:
        """``FileNotFoundError``/``NotADirectoryError`` unless ``path`` (normalised) is a directory here."""
        if path in self._dirs or path in _ROOTS:
            return
        d, n = _split(path)
        if n in self._dirs.get(d, ()):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
        raise FileNotFoundError(errno.ENOENT, "no such directory", path)

    def mkdir(self, path: str) -> None:
        self._alive()
        path = os.path.normpath(path)
        d, n = _split(path)
        if path in self._dirs or path in _ROOTS or (d in self._dirs and n in self._dirs[d]):
            raise FileExistsError(errno.EEXIST, "exists", path)
        self._need_dir(d)
        self._dirs[path] = {}
        self._durable[path] = {}
        self._dir_ops[path] = []

    def fsync_dir(self, path: str) -> None:
        self._alive()
        path = os.path.normpath(path)
        if path in _ROOTS and path not in self._dirs:
            return  # the boundary of the simulated tree (e.g. a top-level tier's parent): not a sync
        self._need_dir(path)
        self._sync_point()
        self._durable[path] = dict(self._dirs[path])
        self._dir_ops[path].clear()
        self._gc()

    def stat(self, path: str) -> FileStat:
        self._alive()
        p = os.path.normpath(path)
        if p in self._dirs:
            return FileStat(0, False)
        return FileStat(len(self._inodes[self._lookup(p)].data), True)

    # ---------------------------------------------------------------- the crash
    def crash(self, rng: random.Random, *, zero_fill: bool = False) -> "CrashFs":
        """The disk a power loss at this instant leaves (this instance is dead afterwards);
        ``zero_fill`` adds the zeroed fate (module docstring)."""
        fates, weights = (_FATES + ("zero",), _WEIGHTS + (1,)) if zero_fill else (_FATES, _WEIGHTS)
        self._crashed = True
        new = CrashFs(disk_bytes=self.disk_bytes)
        kept = lost = 0
        for d, durable in self._durable.items():
            ns = dict(durable)
            ops = self._dir_ops.get(d, [])
            keep = rng.randint(0, len(ops))
            kept, lost = kept + keep, lost + len(ops) - keep
            for op in ops[:keep]:
                if op[0] == "set":
                    ns[op[1]] = op[2]
                elif op[0] == "del":
                    ns.pop(op[1], None)
                else:  # "mv"
                    ns.pop(op[1], None)
                    ns[op[2]] = op[3]
            new._dirs[d] = ns
            new._durable[d] = dict(ns)
            new._dir_ops[d] = []
        counts = dict.fromkeys(fates, 0)
        live = {ino for ns in new._dirs.values() for ino in ns.values()}
        for ino_no in sorted(live):
            ino = self._inodes[ino_no]
            img = bytearray(ino.synced)
            for op in ino.pending:
                fate = rng.choices(fates, weights=weights)[0]
                counts[fate] += 1
                if op[0] == "t":
                    if fate != "drop":
                        _apply(img, op)
                    continue
                _, off, raw = op
                if fate == "drop" or not raw:
                    continue
                if fate == "torn":
                    raw = raw[: rng.randrange(len(raw))]
                elif fate == "zero":
                    raw = bytes(len(raw))
                elif fate == "garble":
                    a = rng.randrange(len(raw))
                    b = rng.randint(a + 1, len(raw))
                    raw = raw[:a] + rng.randbytes(b - a) + raw[b:]
                _apply(img, ("w", off, raw))
            new._inodes[ino_no] = _Inode(img, bytearray(img))
        new._next_ino = self._next_ino
        self.last_crash = new.last_crash = CrashStats(counts["keep"], counts["drop"], counts["torn"],
                                                      counts["garble"], kept, lost, counts.get("zero", 0))
        return new

    def snapshot(self) -> "CrashFs":
        """A copy of the current state with everything synced (a clean shutdown image)."""
        new = CrashFs(disk_bytes=self.disk_bytes)
        new._dirs = {d: dict(ns) for d, ns in self._dirs.items()}
        new._durable = {d: dict(ns) for d, ns in self._dirs.items()}
        new._dir_ops = {d: [] for d in self._dirs}
        live = {ino for ns in new._dirs.values() for ino in ns.values()}
        new._inodes = {i: _Inode(self._written(self._inodes[i]), self._written(self._inodes[i])) for i in live}
        new._next_ino = self._next_ino
        return new

    @staticmethod
    def _written(ino: _Inode) -> bytearray:
        """The file once every operation not lost is on the disk."""
        if not ino.lost:
            return bytearray(ino.data)
        img = bytearray(ino.synced)
        for op in ino.pending:
            _apply(img, op)
        return img

    def paths(self, directory: str) -> list[str]:
        """Every file path directly in ``directory`` (for fault injection by tests)."""
        d = os.path.normpath(directory)
        return [os.path.join(d, n) for n in sorted(self._dirs.get(d, {}))]
