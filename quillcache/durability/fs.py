"""The small file-system interface every durable I/O goes through, and ``RealFs`` (os calls).

The SSD tier, the write-ahead log and the ART index never call ``os`` for their files: they talk
to a :class:`FileSystem`, so the same code runs on the real disk (:class:`RealFs`, the default)
and on the crash simulator (:class:`quillcache.durability.crashfs.CrashFs`), which buffers unsynced
writes and directory changes and can drop or garble them at a simulated power loss.

Contract (what a caller may rely on, and what it must not):
- Handles are opaque ints returned by :meth:`FileSystem.open` (never OS file descriptors, and never
  reused); every call on a closed handle raises ``OSError(EBADF)``, so a use after close can never
  reach a file opened since. (A handle closed by one thread *while* another's call on it runs is the
  caller's race.)
- ``pwrite``/``fallocate``/``truncate`` are *not* durable until ``fsync``/``fdatasync`` of that
  file returned; a newly created, renamed, linked or unlinked name is not durable until
  ``fsync_dir`` of its directory returned (POSIX; ext4/xfs happen to be kinder, the simulator is not).
- ``rename(src, dst)`` atomically replaces ``dst``; ``link(src, dst)`` never clobbers
  (``FileExistsError``).
- Errors are ``OSError`` with an ``errno`` (``ENOSPC`` for a full disk, ``EIO`` for a failed
  fsync); the tier maps them to typed store errors. An fsync error is never retried.
- ``map_copy`` is optional: a file system that cannot map files returns None and the caller
  reads the file instead (the ART index does, for its checkpoint).
"""

from __future__ import annotations

import abc
import errno
import itertools
import mmap
import os
import stat as _stat
from dataclasses import dataclass

# open modes
READ = "r"  # existing file, read only
READ_WRITE = "rw"  # existing file, read and write
CREATE_EXCL = "x"  # new file (fails if it exists), read and write
MODES = (READ, READ_WRITE, CREATE_EXCL)


@dataclass(frozen=True, slots=True)
class FileStat:
    """What the tier needs from ``stat``: size and whether it is a regular file."""

    size_bytes: int
    is_file: bool


class FileSystem(abc.ABC):
    """File operations of the durable components (paths are ``str``; handles are ints)."""

    @abc.abstractmethod
    def open(self, path: str, mode: str) -> int:
        """Open ``path`` in one of :data:`MODES`; returns a handle. A directory is refused in every mode
        (``IsADirectoryError`` naming ``path``): it is never a file of a log or a store."""

    @abc.abstractmethod
    def close(self, fd: int) -> None: ...

    @abc.abstractmethod
    def pwrite(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        """Write all of ``data`` at ``offset`` (short writes are retried inside); returns its length."""

    @abc.abstractmethod
    def pread(self, fd: int, size: int, offset: int) -> bytes:
        """Up to ``size`` bytes from ``offset`` (fewer at end of file)."""

    def preadinto(self, fd: int, out: memoryview, offset: int) -> int:
        """Read into ``out`` (a writable byte view); returns the bytes read."""
        data = self.pread(fd, len(out), offset)
        out[: len(data)] = data
        return len(data)

    @abc.abstractmethod
    def fsync(self, fd: int) -> None: ...

    @abc.abstractmethod
    def fdatasync(self, fd: int) -> None: ...

    @abc.abstractmethod
    def truncate(self, fd: int, size: int) -> None: ...

    @abc.abstractmethod
    def fallocate(self, fd: int, offset: int, length: int) -> None:
        """Reserve ``[offset, offset+length)`` (extends the file with zeros); ENOSPC if the disk is full."""

    @abc.abstractmethod
    def fsize(self, fd: int) -> int: ...

    @abc.abstractmethod
    def rename(self, src: str, dst: str) -> None: ...

    @abc.abstractmethod
    def link(self, src: str, dst: str) -> None: ...

    @abc.abstractmethod
    def unlink(self, path: str) -> None: ...

    @abc.abstractmethod
    def listdir(self, path: str) -> list[str]: ...

    @abc.abstractmethod
    def mkdir(self, path: str) -> None:
        """Create one directory (``FileExistsError`` if it exists)."""

    @abc.abstractmethod
    def fsync_dir(self, path: str) -> None:
        """Make the directory's entries (creates, renames, unlinks) durable."""

    @abc.abstractmethod
    def stat(self, path: str) -> FileStat:
        """``FileNotFoundError`` if absent."""

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
        except FileNotFoundError:
            return False
        return True

    def is_dir(self, path: str) -> bool:
        try:
            return not self.stat(path).is_file
        except FileNotFoundError:
            return False

    def read_file(self, path: str) -> bytes:
        """The whole content of a file."""
        fd = self.open(path, READ)
        try:
            return self.pread(fd, self.fsize(fd), 0)
        finally:
            self.close(fd)

    def map_copy(self, fd: int) -> mmap.mmap | None:
        """A private copy-on-write mapping of the whole (non-empty) file, or None where this file
        system cannot map files. Writes to the mapping never reach the file."""
        return None


# RealFs handles -> OS file descriptors, shared by every RealFs (one process, one disk). Handles start far above
# any descriptor, so a handle passed to an os call by mistake fails (EBADF) instead of reaching some file.
_FDS: dict[int, int] = {}
_NEXT_HANDLE = itertools.count(1 << 30)  # next() on a count is atomic under the GIL


def _os_fd(handle: int) -> int:
    try:
        return _FDS[handle]
    except (KeyError, TypeError):
        raise OSError(errno.EBADF, f"bad file handle {handle!r} (closed, or never opened)") from None


class RealFs(FileSystem):
    """The real disk through ``os`` calls; handles are opaque and never reused (module doc)."""

    _FLAGS = {READ: os.O_RDONLY, READ_WRITE: os.O_RDWR, CREATE_EXCL: os.O_RDWR | os.O_CREAT | os.O_EXCL}

    def open(self, path: str, mode: str) -> int:
        flags = self._FLAGS.get(mode)
        if flags is None:
            raise ValueError(f"open mode must be one of {MODES}, got {mode!r}")
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:  # a directory opens read-only, then fails every read with an error that names no file
            if _stat.S_ISDIR(os.fstat(fd).st_mode):
                raise IsADirectoryError(errno.EISDIR, "a directory where a file was expected", path)
        except BaseException:
            os.close(fd)
            raise
        handle = next(_NEXT_HANDLE)
        _FDS[handle] = fd
        return handle

    def close(self, fd: int) -> None:
        try:
            os_fd = _FDS.pop(fd)  # atomic: of two closes of one handle, exactly one closes the descriptor
        except (KeyError, TypeError):
            raise OSError(errno.EBADF, f"bad file handle {fd!r} (closed, or never opened)") from None
        os.close(os_fd)

    def pwrite(self, fd: int, data, offset: int) -> int:
        fd = _os_fd(fd)
        view = memoryview(data).cast("B")
        total = len(view)
        done = 0
        while done < total:
            n = os.pwrite(fd, view[done:], offset + done)
            if n <= 0:  # pragma: no cover - the kernel reports errors as exceptions
                raise OSError(f"pwrite returned {n}")
            done += n
        return total

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        fd = _os_fd(fd)
        out = os.pread(fd, size, offset)
        if len(out) < size:  # a short read in the middle of a file: keep reading
            parts = [out]
            got = len(out)
            while got < size:
                more = os.pread(fd, size - got, offset + got)
                if not more:
                    break
                parts.append(more)
                got += len(more)
            out = b"".join(parts)
        return out

    def preadinto(self, fd: int, out: memoryview, offset: int) -> int:
        fd = _os_fd(fd)
        view = memoryview(out).cast("B")
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                break
            got += n
        return got

    def fsync(self, fd: int) -> None:
        os.fsync(_os_fd(fd))

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(_os_fd(fd))

    def truncate(self, fd: int, size: int) -> None:
        os.ftruncate(_os_fd(fd), size)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        os.posix_fallocate(_os_fd(fd), offset, length)

    def fsize(self, fd: int) -> int:
        return os.fstat(_os_fd(fd)).st_size

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def link(self, src: str, dst: str) -> None:
        os.link(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def mkdir(self, path: str) -> None:
        os.mkdir(path)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def stat(self, path: str) -> FileStat:
        st = os.stat(path)
        return FileStat(st.st_size, _stat.S_ISREG(st.st_mode))

    def map_copy(self, fd: int) -> mmap.mmap | None:
        fd = _os_fd(fd)
        return mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_COPY)


__all__ = ["CREATE_EXCL", "FileStat", "FileSystem", "MODES", "READ", "READ_WRITE", "RealFs"]
