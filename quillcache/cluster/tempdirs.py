"""Temporary directories that name the processes using them, and the sweep of those that every such
process left without removing (a SIGKILL runs no cleanup).

- ``make_owned_dir(prefix)``: ``tempfile.mkdtemp(prefix=prefix)`` with ``OWNER_FILE`` in it naming
  this process; ``add_user(path, pid)`` adds a process that works in it too (a child started there).
  Both write the file under a temporary name and rename it, so a reader sees all of it or none;
  ``make_owned_dir`` removes what it made if it fails half-way.
- A process is named by its pid, its start time in clock ticks since boot (``/proc/<pid>/stat``
  field 22), the kernel's boot id (random at every boot), the inodes of the pid and time
  namespaces it was seen from, and the machine (``/etc/machine-id`` and host name; empty where
  there is no machine id). Within one boot and those namespaces, (pid, start time) names one
  process for ever: a pid reused later comes with another start time. Another boot id is an
  earlier boot only when the machine is known and the same: two hosts sharing a ``TMPDIR`` have
  different boot ids, and the namespace inodes of the initial namespaces are the same on every
  host (hosts cloned from one image, with the same machine id and host name, are taken for one).
- ``sweep_stale_dirs(prefix, root=None)`` removes each directory ``root/<prefix>*`` (``root``
  defaults to ``tempfile.gettempdir()``, where ``make_owned_dir`` puts them) that belongs to this
  user and whose owner file names only processes that are not running now (exited, zombies, or of
  an earlier boot of this machine); it returns the paths it swept. What it cannot tell, it keeps: a
  directory with no owner file or one it cannot read (missing, malformed, not a regular file, over
  ``OWNER_FILE_MAX_BYTES``: it may be one being made at this moment, or not ours); one naming a
  process seen from another pid or time namespace (its pid and start time mean nothing here), or of
  another boot of another or unknown machine (a ``TMPDIR`` shared over the network); every directory
  when this process has no ``/proc`` of its own pid namespace, no boot id or no namespace inodes;
  and a process whose ``/proc`` entry cannot be read for a reason other than its absence.
- A swept directory is first renamed to ``<prefix>swept-<16 hex digits>`` (atomic: of several
  sweeps, one wins), then removed; a removal cut short leaves that name, which every later sweep
  removes again without asking (``tempfile.mkdtemp`` never makes a ``-`` after the prefix, so no
  directory it made with that prefix has such a name). Symlinks under ``root`` are never followed.
  Best effort: a sweep raises for nothing but a bad prefix; a directory it cannot read, rename or
  remove (one nested too deep to remove, for one) is left, in part or whole.
- Windows of no record: between ``mkdtemp`` and the owner file (a directory without one is kept),
  and between starting a child and ``add_user`` (if the parent dies right then, a sweep does not
  wait for that child). ``add_user`` drops the processes already known to have exited, so restarts
  do not grow the file.
- Linux only (``/proc``); where this process cannot name itself (no ``/proc`` of its own pid
  namespace, no boot id, no namespace inodes) no owner file is written, so nothing it makes is ever
  swept.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
import threading
from dataclasses import asdict, dataclass, fields
from pathlib import Path

__all__ = ["OWNER_FILE", "OWNER_FILE_MAX_BYTES", "SWEPT_MARK", "ProcessIdentity", "add_user", "make_owned_dir",
           "owners_of", "process_identity", "running", "sweep_stale_dirs"]

OWNER_FILE = ".owner.json"  # {"processes": [ProcessIdentity as a dict, ...]}
OWNER_FILE_MAX_BYTES = 64 * 1024  # a larger one is not ours: the directory is kept
SWEPT_MARK = "swept-"  # <prefix>swept-<16 hex digits>: a directory being removed by a sweep
_MACHINE_ID = re.compile(r"[0-9a-f]{32}")
_TOMB = re.compile(re.escape(SWEPT_MARK) + r"[0-9a-f]{16}")  # what follows the prefix in a tombstone's name
_WRITE_LOCK = threading.Lock()  # add_user's read-modify-write, between this process's threads


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    pid: int
    start_ticks: int  # /proc/<pid>/stat field 22, clock ticks since boot
    machine: str  # /etc/machine-id and host name; "" where there is no machine id
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


def _machine() -> str:
    """``<machine id>/<host name>``, or "" without a machine id (32 hex digits; systemd's placeholder
    ``uninitialized`` and the like are no id)."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(path, "rb") as fh:
                mid = fh.read(256).decode("ascii").strip()
        except (OSError, UnicodeDecodeError):
            continue
        if _MACHINE_ID.fullmatch(mid):
            return f"{mid}/{socket.gethostname()}"
    return ""


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
    return ProcessIdentity(os.getpid() if pid is None else pid, st[0], _machine(), boot, pid_ns, time_ns)


def running(ident: ProcessIdentity) -> bool:
    """False only when the process is known to have exited: absent from ``/proc``, a zombie, its pid now
    another process's, or of an earlier boot of this machine. True whenever that cannot be told (module doc)."""
    if not _proc_is_ours() or ident.pid_ns != _ns_inode("pid") or ident.time_ns != _ns_inode("time"):
        return True
    boot = _boot_id()
    if boot is None:
        return True
    if boot != ident.boot_id:  # an earlier boot of this machine, or another machine's
        return not (ident.machine and ident.machine == _machine())
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
    """Name process ``pid`` in ``path``'s owner file too (a sweep then waits for it as well), dropping the
    processes named there that are known to have exited. Best effort: False, with the file as it was,
    when the directory has no readable owner file, ``pid`` cannot be named (it has already exited,
    for one) or the file cannot be written."""
    path = Path(path)
    with _WRITE_LOCK:
        owners = owners_of(path)
        ident = process_identity(pid)
        if owners is None or ident is None:
            return False
        keep = [o for o in owners if o != ident and running(o)]
        try:
            _write_owners(path, [*keep, ident])
        except OSError:
            return False
    return True


def _identity_from(doc: object) -> ProcessIdentity | None:
    if not isinstance(doc, dict) or set(doc) != {f.name for f in fields(ProcessIdentity)}:
        return None
    ints = [doc[k] for k in ("pid", "start_ticks", "pid_ns", "time_ns")]
    if (not all(type(v) is int and v >= 0 for v in ints) or doc["pid"] <= 0
            or not all(isinstance(doc[k], str) for k in ("machine", "boot_id"))):
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


def _remove(path: Path) -> None:
    try:
        shutil.rmtree(path, ignore_errors=True)
    except RecursionError:  # nested deeper than the interpreter recurses: left as it is
        pass


def sweep_stale_dirs(prefix: str, root: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the ``<prefix>*`` directories under ``root`` that every process they name has left (module
    doc); the paths swept, as they were named before the sweep renamed them. Raises only ValueError,
    for a ``prefix`` that is not a file name prefix."""
    if not prefix or os.sep in prefix or prefix in (".", ".."):
        raise ValueError(f"prefix must be a non-empty file name prefix, got {prefix!r}")
    swept: list[Path] = []
    try:
        base = Path(tempfile.gettempdir() if root is None else root)
        entries = [e for e in os.scandir(base) if e.name.startswith(prefix)]
        uid = os.geteuid()
    except OSError:  # no temporary folder, or one that cannot be listed
        return swept
    for entry in entries:
        try:
            if _sweep_one(entry, prefix, base, uid):
                swept.append(Path(entry.path))
        except Exception:  # best effort (module doc): one directory never stops the sweep of the others
            continue
    return swept


def _sweep_one(entry: os.DirEntry, prefix: str, base: Path, uid: int) -> bool:
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
        return False
    path = Path(entry.path)
    if _TOMB.fullmatch(entry.name[len(prefix):]):  # a sweep's removal cut short
        _remove(path)
        return False
    owners = owners_of(path)
    if owners is None or any(running(o) for o in owners):
        return False
    tomb = base / f"{prefix}{SWEPT_MARK}{secrets.token_hex(8)}"
    try:
        os.rename(path, tomb)
    except OSError:  # another sweep renamed it first, or it cannot be
        return False
    _remove(tomb)
    return True
