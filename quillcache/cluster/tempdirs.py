"""Temporary directories that name the processes using them, and the sweep of those that every such
process left without removing (a SIGKILL runs no cleanup).

- ``make_owned_dir(prefix)``: ``tempfile.mkdtemp(prefix=prefix)`` with ``OWNER_FILE`` in it naming
  this process; ``add_user(path, pid)`` adds a process that works in it too (a child started there).
  Both write the file under a temporary name and rename it, so a reader sees all of it or none;
  ``make_owned_dir`` removes what it made if it fails half-way.
- A process is named by its pid, its start time in clock ticks since boot (``/proc/<pid>/stat``
  field 22), the kernel's boot id and the inodes of the pid and time namespaces it was seen from.
  Within one boot and those namespaces, (pid, start time) names one process for ever: a pid reused
  later comes with another start time.
- ``sweep_stale_dirs(prefix, root=None)`` removes each directory ``root/<prefix>*`` (``root``
  defaults to ``tempfile.gettempdir()``, where ``make_owned_dir`` puts them) that belongs to this
  user and whose owner file names only processes that are not running now (exited, zombies, or of
  an earlier boot); it returns the paths removed. What it cannot tell, it keeps: a directory with no
  owner file or one it cannot read (missing, malformed, not a regular file, over
  ``OWNER_FILE_MAX_BYTES``: it may be one being made at this moment, or not ours), one naming a
  process seen from another pid or time namespace (its pid and start time mean nothing here), and
  any process whose ``/proc`` entry cannot be read for a reason other than its absence.
- A swept directory is first renamed to ``<prefix>swept-<random>`` (atomic: of several sweeps, one
  wins), then removed; a removal cut short leaves that name, which every later sweep removes
  without asking (``tempfile.mkdtemp`` never makes a ``-`` after the prefix, so no live directory
  has it). Symlinks are never followed. Best effort: nothing here raises for a directory it cannot
  read, rename or remove.
- Linux only (``/proc``); where this process cannot name itself through ``/proc`` no owner file is
  written, so nothing it makes is ever swept.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["OWNER_FILE", "OWNER_FILE_MAX_BYTES", "SWEPT_MARK", "ProcessIdentity", "add_user", "make_owned_dir",
           "owners_of", "process_identity", "running", "sweep_stale_dirs"]

OWNER_FILE = ".owner.json"  # {"processes": [ProcessIdentity as a dict, ...]}
OWNER_FILE_MAX_BYTES = 64 * 1024  # a larger one is not ours: the directory is kept
SWEPT_MARK = "swept-"  # <prefix>swept-<random>: a directory being removed by a sweep
_WRITE_LOCK = threading.Lock()  # add_user's read-modify-write, between this process's threads


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    pid: int
    start_ticks: int  # /proc/<pid>/stat field 22, clock ticks since boot
    boot_id: str
    pid_ns: int  # inode of the pid namespace it was seen from
    time_ns: int  # inode of the time namespace it was seen from (0: the kernel has none)


class _Unknown(Exception):
    """A process's state could not be read (not because it is absent)."""


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as fh:
            return fh.read().decode("ascii").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _ns_inode(kind: str) -> int | None:
    try:
        return os.stat(f"/proc/self/ns/{kind}").st_ino
    except FileNotFoundError:
        return 0 if kind == "time" else None  # kernels before 5.6 have no time namespaces
    except OSError:
        return None


def _stat_start_and_state(entry: str) -> tuple[int, str] | None:
    """(start ticks, state letter) from ``/proc/<entry>/stat``; None when there is no such process;
    ``_Unknown`` when it cannot be read or parsed."""
    try:
        with open(f"/proc/{entry}/stat", "rb") as fh:
            raw = fh.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError as exc:
        raise _Unknown(str(exc)) from exc
    try:
        fields = raw.rsplit(b")", 1)[1].split()  # the command name may hold spaces, ')' and any byte
        return int(fields[19]), fields[0].decode("ascii", "replace")  # fields 22 (starttime) and 3 (state)
    except (IndexError, ValueError) as exc:
        raise _Unknown(f"unparsable /proc/{entry}/stat") from exc


def _proc_is_ours() -> bool:
    """Whether ``/proc`` shows this process's pid namespace (it does not after ``unshare -p`` without a new mount)."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def process_identity(pid: int | None = None) -> ProcessIdentity | None:
    """The identity of ``pid`` (default: this process) as seen from here; None when it cannot be told
    (no ``/proc`` of this pid namespace, no such process, an unreadable entry)."""
    if not _proc_is_ours():
        return None
    boot, pid_ns, time_ns = _boot_id(), _ns_inode("pid"), _ns_inode("time")
    if boot is None or pid_ns is None or time_ns is None:
        return None
    try:
        st = _stat_start_and_state("self" if pid is None else str(pid))
    except _Unknown:
        return None
    if st is None:
        return None
    return ProcessIdentity(os.getpid() if pid is None else pid, st[0], boot, pid_ns, time_ns)


def running(ident: ProcessIdentity) -> bool:
    """False only when the process is known to have exited: absent from ``/proc``, a zombie, its pid now
    another process's, or of an earlier boot. True whenever that cannot be told (module doc)."""
    if not _proc_is_ours() or ident.pid_ns != _ns_inode("pid") or ident.time_ns != _ns_inode("time"):
        return True
    boot = _boot_id()
    if boot is None:
        return True
    if boot != ident.boot_id:
        return False
    try:
        st = _stat_start_and_state(str(ident.pid))
    except _Unknown:
        return True
    return st is not None and st[0] == ident.start_ticks and st[1] != "Z"


def _write_owners(path: Path, owners: list[ProcessIdentity]) -> None:
    tmp = path / f"{OWNER_FILE}.{secrets.token_hex(4)}.tmp"
    try:
        tmp.write_text(json.dumps({"processes": [asdict(o) for o in owners]}))
        os.replace(tmp, path / OWNER_FILE)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def make_owned_dir(prefix: str) -> Path:
    """A new directory ``tempfile.mkdtemp(prefix=prefix)`` naming this process as its user (no owner file
    where this process cannot be named: such a directory is never swept). Removed again if this fails."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        me = process_identity()
        if me is not None:
            _write_owners(path, [me])
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def add_user(path: str | os.PathLike, pid: int) -> bool:
    """Name process ``pid`` in ``path``'s owner file too (a sweep then waits for it as well). Best effort:
    False, with the file as it was, when the directory has no readable owner file, ``pid`` cannot be
    named (it has already exited, for one) or the file cannot be written."""
    path = Path(path)
    with _WRITE_LOCK:
        owners = owners_of(path)
        ident = process_identity(pid)
        if owners is None or ident is None:
            return False
        if ident not in owners:
            try:
                _write_owners(path, [*owners, ident])
            except OSError:
                return False
    return True


def _identity_from(doc: object) -> ProcessIdentity | None:
    if not isinstance(doc, dict) or set(doc) != {"pid", "start_ticks", "boot_id", "pid_ns", "time_ns"}:
        return None
    ints = [doc[k] for k in ("pid", "start_ticks", "pid_ns", "time_ns")]
    if not all(type(v) is int and v >= 0 for v in ints) or doc["pid"] <= 0 or not isinstance(doc["boot_id"], str):
        return None
    return ProcessIdentity(**doc)


def owners_of(path: str | os.PathLike) -> list[ProcessIdentity] | None:
    """The processes ``path``'s owner file names, or None when it has none that can be read and trusted
    (missing, a symlink, not a regular file, over ``OWNER_FILE_MAX_BYTES``, malformed)."""
    try:
        fd = os.open(Path(path) / OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > OWNER_FILE_MAX_BYTES:
            return None
        raw = os.read(fd, OWNER_FILE_MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        doc = json.loads(raw)
    except Exception:  # ValueError, UnicodeDecodeError, RecursionError (deep nesting)
        return None
    procs = doc.get("processes") if isinstance(doc, dict) else None
    if not isinstance(procs, list) or not procs:
        return None
    owners = [_identity_from(p) for p in procs]
    return None if any(o is None for o in owners) else owners


def _remove(path: Path) -> bool:
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


def sweep_stale_dirs(prefix: str, root: str | os.PathLike | None = None) -> list[Path]:
    """Remove the ``<prefix>*`` directories under ``root`` that every process they name has left (module
    doc); the paths removed (as they were named before the sweep renamed them). Raises only ValueError,
    for a ``prefix`` that is not a file name prefix."""
    if not prefix or os.sep in prefix or prefix in (".", ".."):
        raise ValueError(f"prefix must be a non-empty file name prefix, got {prefix!r}")
    base = Path(tempfile.gettempdir() if root is None else root)
    uid = os.geteuid()
    removed: list[Path] = []
    try:
        entries = [e for e in os.scandir(base) if e.name.startswith(prefix)]
    except OSError:
        return removed
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            continue
        path = Path(entry.path)
        if entry.name.startswith(prefix + SWEPT_MARK):  # a sweep's removal cut short
            _remove(path)
            continue
        owners = owners_of(path)
        if owners is None or any(running(o) for o in owners):
            continue
        tomb = base / f"{prefix}{SWEPT_MARK}{secrets.token_hex(8)}"
        try:
            os.rename(path, tomb)
        except OSError:  # another sweep renamed it first, or it cannot be
            continue
        _remove(tomb)
        removed.append(path)
    return removed
