"""The exclusive lock an owner of a data dir holds on it for its whole life: one owner per data dir.

Two writers appending to one log overwrite each other's records, so acknowledged writes would be
lost: a master's operation log, a pool node's SSD tier (its slabs and log), a persistent ART index.
Each of them takes this lock on its dir before reading anything in it. Contract:
- ``DataDirLock(data_dir, lock_name=..., owner=...)`` takes an exclusive, non-blocking ``flock`` of
  ``<data_dir>/<lock_name>`` (default ``master.lock``; created when missing, never followed as a
  symlink; it holds the holder's pid as one decimal line and no data), or raises
  :class:`DataDirInUseError` naming the dir, the owner kind and the holder's pid. It waits
  only when the pid in the file is no longer running (below): a live holder is refused at once.
  Creating the dir and this file is all an owner does to a data dir before it has the lock.
- One holder per data dir, whoever asks: another process, or another ``DataDirLock`` in this process
  (an ``flock`` belongs to an open file description, so a second open in the same process is refused
  as well).
- ``release()`` (idempotent; also when the object is collected) closes the file, which ends the lock.
  A process that dies in any way (SIGKILL included) ends it with its file descriptors: a lock never
  outlives its holder. The file stays behind; its pid is read only while someone holds the lock.
- A child forked by this process (``os.fork``, e.g. the snapshot writer) closes its copies of every
  lock before ``os.fork`` returns in it, without unlocking: the lock stays the parent's and ends with the parent,
  never kept alive by an orphaned child for longer than that child takes to be scheduled. The file is
  close-on-exec, so no exec'd program inherits it.
- That instant is real: a holder SIGKILLed just after forking leaves a child that still has the file
  open until it first runs, so the lock outlives its holder for that long. A new holder that finds
  the lock taken while the pid in the file has exited therefore polls the lock for up to
  ``dead_holder_grace_s`` (default ``DEAD_HOLDER_GRACE_S``) before refusing, and its refusal says that
  the named holder has exited (some process it started still has the file open).
- Only the real file system is locked; callers skip the lock for a simulated one (it lives in one
  process's memory).
"""

from __future__ import annotations

import fcntl
import os
import time
import weakref

__all__ = ["DataDirInUseError", "DataDirLock", "LOCK_NAME"]

LOCK_NAME = "master.lock"
DEAD_HOLDER_GRACE_S = 5.0  # how long a lock whose recorded holder has exited is polled (module docstring)
_POLL_S = 0.005
_sleep = time.sleep  # (tests put the holder's letting go here)
_PID_READ_BYTES = 32  # a pid line is at most 20 digits and a newline

_HELD: weakref.WeakSet[DataDirLock] = weakref.WeakSet()  # locks this process holds (closed in forked children)


class DataDirInUseError(RuntimeError):
    """The data dir is locked by another owner; ``data_dir`` and ``pid`` (None when unknown) say which;
    ``holder_exited``: that pid has exited, but a process it started (forked) still has the lock file open."""

    def __init__(self, data_dir: str, pid: int | None, *, holder_exited: bool = False, lock_name: str = LOCK_NAME,
                 owner: str = "master") -> None:
        if pid is None:
            who = "pid unknown"
        elif pid == os.getpid():
            who = f"pid {pid}, this process"
        elif holder_exited:
            who = f"pid {pid}, which has exited, but a process it forked still has the lock file open"
        else:
            who = f"pid {pid}"
        super().__init__(f"data dir {data_dir} is in use by another {owner} ({who}; lock file "
                         f"{os.path.join(data_dir, lock_name)}): one {owner} per data dir")
        self.data_dir = data_dir
        self.pid = pid
        self.holder_exited = holder_exited


class DataDirLock:
    """An exclusive lock on one data dir (module docstring)."""

    def __init__(self, data_dir: str | os.PathLike, *, dead_holder_grace_s: float = DEAD_HOLDER_GRACE_S,
                 lock_name: str = LOCK_NAME, owner: str = "master") -> None:
        if not lock_name or os.sep in lock_name or lock_name in (".", ".."):
            raise ValueError(f"lock_name must be a plain file name, got {lock_name!r}")
        self.data_dir = os.fspath(data_dir)
        self.path = os.path.join(self.data_dir, lock_name)
        self.owner = owner
        self._fd = -1
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            _take(fd, self.data_dir, dead_holder_grace_s, lock_name, owner)
            try:  # who holds it, for the message another master gets; the lock does not depend on it
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError:
                pass
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        _HELD.add(self)

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def covers(self, data_dir: str | os.PathLike) -> bool:
        """Whether this lock is held and is the lock of ``data_dir`` (the same directory, however named)."""
        try:
            return self.held and os.path.samefile(self.data_dir, data_dir)
        except OSError:
            return False

    def release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            _HELD.discard(self)
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # interpreter shutdown: the process exit releases it anyway
            pass

    def __enter__(self) -> DataDirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"DataDirLock({self.data_dir!r}, {os.path.basename(self.path)!r}, held={self.held})"


def _take(fd: int, data_dir: str, grace_s: float, lock_name: str, owner: str) -> None:
    """flock ``fd``; while the recorded holder has exited, poll for up to ``grace_s`` (module docstring)."""
    deadline = None
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pid = _read_pid(fd)
            if pid is None or _running(pid):
                raise DataDirInUseError(data_dir, pid, lock_name=lock_name, owner=owner) from None
            now = time.monotonic()
            if deadline is None:
                deadline = now + grace_s
            elif now >= deadline:
                raise DataDirInUseError(data_dir, pid, holder_exited=True, lock_name=lock_name, owner=owner) from None
            _sleep(_POLL_S)


def _running(pid: int) -> bool:
    """Whether ``pid`` names a process that has not exited (a zombie has: its files are closed)."""
    if pid == os.getpid():
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, _PID_READ_BYTES, 0).decode("ascii").strip()
        return int(text) if text.isdigit() else None
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _close_in_child() -> None:
    """(``os.fork``, in the child) drop this process's copies of the locks, without unlocking them."""
    for lock in list(_HELD):
        fd, lock._fd = lock._fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)
