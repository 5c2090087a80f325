"""Who writes a master snapshot: the serving thread itself (``inline``) or a forked child (``fork``).

Both publish the same file the same way (:func:`~quillcache.master.snapshot.publish_snapshot`); they
differ in who waits. The protocol with the log (:class:`~quillcache.master.oplog.OpLog`) is the same
for both and is what keeps a crash at any point harmless:

1. the log is committed and sealed at LSN L (the state's LSN): the active file becomes the sealed
   segment ``master.wal.<first lsn>`` and appends continue in a fresh active file from L + 1;
2. the snapshot of the state at L is written to a temporary file, fsynced and renamed over
   ``master.snap`` (directory fsynced);
3. only then are the sealed segments it covers deleted (``OpLog.drop_through(L)``).

A crash before 2 completes leaves the previous snapshot, the sealed segments and the active file:
recovery replays every record after the previous snapshot, across the files, in LSN order. A crash
after 2 leaves the new snapshot; recovery replays the active file and deletes the covered segments.

``fork``: ``os.fork()`` hands the child a copy-on-write image of the state at L, so the serving
thread pays only for the fork (copying page tables) and for the pages it then writes while the child
lives; encoding, writing and fsyncing run in the child, on another core and outside the parent's
GIL. The parent learns the outcome by polling (``waitpid(WNOHANG)``) after each call of the
service and waits for it at ``close``. The child:
- runs only the forking thread (no lock another thread might hold is ever taken: it touches the
  state's tables, numpy, msgpack and plain file calls), restores default signal dispositions, keeps
  the collector off, and leaves with ``os._exit`` (no atexit handler, no finalizer of the parent's
  sockets runs);
- publishes only while its parent is alive (``getppid`` checked under the publish lock) and never
  over a snapshot covering a later LSN, so a child orphaned by a SIGKILLed master cannot replace
  what a newer master wrote; its temporary file is removed by the next recovery.
Memory: the child's copy grows by the pages either process writes (at most the table's size).
``fork`` needs the real file system (a simulated one such as CrashFs lives in the parent's memory)
and ``os.fork``; otherwise the ``inline`` writer is used.

A child that fails (an exception, a signal, or an exit before publishing) publishes nothing: the log
still holds every record, and the next snapshot is taken inline, so a persistent failure turns the
master read-only (LOG_FAILED) exactly as an inline failure does.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import time
import warnings
from dataclasses import dataclass

from quillcache.durability.fs import FileSystem, RealFs
from quillcache.master.snapshot import encode_state, publish_snapshot
from quillcache.master.state import MasterState
from quillcache.registry import Registry

__all__ = ["SNAPSHOT_WRITERS", "ForkSnapshotWriter", "InlineSnapshotWriter", "SnapshotOutcome", "SnapshotWriter"]

log = logging.getLogger(__name__)

_CHILD_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")
                       if hasattr(signal, n))
_MAX_ERROR_BYTES = 4096


@dataclass(frozen=True, slots=True)
class SnapshotOutcome:
    """How one snapshot ended: ``published_bytes`` > 0 when ``master.snap`` now covers ``lsn``."""

    lsn: int
    published_bytes: int
    seconds: float
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.published_bytes > 0


class SnapshotWriter:
    """Writes the snapshot of a state at its current LSN in the background (module docstring). The
    base class writes nothing in the background: the service writes each snapshot itself
    (``MasterService.snapshot``), which is the ``inline`` writer."""

    name = "abstract"
    background = False

    @classmethod
    def supports(cls, fs: FileSystem) -> bool:
        """Whether this writer can write snapshots through ``fs``."""
        return True

    def start(self, fs: FileSystem, data_dir: str, state: MasterState) -> None:
        raise NotImplementedError(f"the {self.name} snapshot writer writes nothing in the background")

    @property
    def busy(self) -> bool:
        """A snapshot is being written and its outcome is not known yet."""
        return False

    def poll(self) -> SnapshotOutcome | None:
        """The outcome of the snapshot started last, once, when it is known; else None."""
        return None

    def wait(self) -> SnapshotOutcome | None:
        """Block until the snapshot in flight (if any) ends; its outcome (None when none was started)."""
        return self.poll()


class InlineSnapshotWriter(SnapshotWriter):
    """No background writer: the serving thread writes every snapshot (``MasterService.snapshot``)."""

    name = "inline"


class ForkSnapshotWriter(SnapshotWriter):
    """A forked child encodes, writes and publishes the snapshot (module docstring)."""

    name = "fork"
    background = True

    @classmethod
    def supports(cls, fs: FileSystem) -> bool:
        return hasattr(os, "fork") and type(fs) is RealFs  # a simulated file system lives in this process

    def __init__(self) -> None:
        self._pid = 0
        self._rfd = -1
        self._lsn = 0
        self._t0 = 0.0

    @property
    def busy(self) -> bool:
        return self._pid != 0

    def start(self, fs: FileSystem, data_dir: str, state: MasterState) -> None:
        if self._pid:
            raise RuntimeError("a snapshot is already being written")
        rfd, wfd = os.pipe()
        parent = os.getpid()
        self._t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():  # Python >= 3.12 warns about forking a threaded process; see docstring
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except BaseException:  # e.g. ENOMEM / EAGAIN (the caller writes the snapshot inline): no fd leaks
            os.close(rfd)
            os.close(wfd)
            raise
        if pid == 0:  # the child: never returns
            os.close(rfd)
            _child(fs, data_dir, state, parent, wfd)
        os.close(wfd)
        self._pid, self._rfd, self._lsn = pid, rfd, state.lsn

    def poll(self) -> SnapshotOutcome | None:
        if not self._pid:
            return None
        pid, status = os.waitpid(self._pid, os.WNOHANG)
        if pid == 0:
            return None
        return self._reap(status)

    def wait(self) -> SnapshotOutcome | None:
        if not self._pid:
            return None
        _, status = os.waitpid(self._pid, 0)
        return self._reap(status)

    def _reap(self, status: int) -> SnapshotOutcome:
        try:
            msg = os.read(self._rfd, _MAX_ERROR_BYTES)
        finally:
            os.close(self._rfd)
        seconds = time.perf_counter() - self._t0
        self._pid, self._rfd = 0, -1
        code = os.waitstatus_to_exitcode(status)
        if code == 0 and msg.startswith(b"ok "):
            return SnapshotOutcome(self._lsn, int(msg[3:]), seconds)
        why = msg.decode("utf-8", "replace") if msg else (
            f"killed by signal {-code}" if code < 0 else f"exited with status {code} before publishing")
        return SnapshotOutcome(self._lsn, 0, seconds, why or "not published")


def _child(fs: FileSystem, data_dir: str, state: MasterState, parent: int, wfd: int) -> None:
    code = 1
    try:
        gc.disable()
        _lowest_priority()
        for sig in _CHILD_SIGNALS:
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (ValueError, OSError):
                pass
        blob = encode_state(state)
        n = publish_snapshot(fs, data_dir, blob, state.lsn, tmp_suffix=f".{os.getpid()}",
                             still_wanted=lambda: os.getppid() == parent)
        os.write(wfd, b"ok %d" % n if n else b"not published: the master exited, or a later snapshot exists")
        code = 0 if n else 2
    except BaseException as exc:  # report it to the parent, whatever it is
        try:
            os.write(wfd, f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")[:_MAX_ERROR_BYTES])
        except OSError:
            pass
    finally:
        os._exit(code)


def _lowest_priority() -> None:
    """Run only on CPU time nothing else wants (SCHED_IDLE where the OS has it, else nice 19): the
    child must not slow the master or its clients; the master waits for it when its log allowance is
    spent, which frees a CPU for it (bounded tail, see MasterConfig.snapshot_inflight_records)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.nice(19)
        except (AttributeError, OSError):
            pass


SNAPSHOT_WRITERS: Registry[type[SnapshotWriter]] = Registry("snapshot writer")
SNAPSHOT_WRITERS.register("inline", InlineSnapshotWriter)
SNAPSHOT_WRITERS.register("fork", ForkSnapshotWriter)


def make_writer(kind: str, fs: FileSystem) -> SnapshotWriter:
    """The writer ``kind`` names, or the inline one where forking cannot work (module docstring)."""
    cls = SNAPSHOT_WRITERS.get(kind)
    return (cls if cls.supports(fs) else InlineSnapshotWriter)()
