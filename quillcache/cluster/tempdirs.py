"""Temporary directories owned by one process, and the sweep of those whose owner died without
removing them (a SIGKILL runs no cleanup).

- ``make_owned_dir(prefix)``: ``tempfile.mkdtemp(prefix=prefix)`` with ``OWNER_FILE`` in it, naming
  this process by its pid, its start time in clock ticks since boot (``/proc/<pid>/stat``, field 22),
  the kernel's boot id and its pid namespace. They name one process for ever: a pid reused later, or
  after a reboot, comes with another start time or boot id. The file is written under a temporary
  name and renamed, so a reader sees all of it or none.
- ``sweep_stale_dirs(prefix, root=None)``: removes every directory ``root/prefix*`` (``root``
  defaults to ``tempfile.gettempdir()``, where ``make_owned_dir`` puts them) whose owner file names a
  process that is not running now (gone, a zombie, or its pid now another process's); returns the
  paths removed. A directory without a readable, well-formed owner file is never removed: it may be
  one being made at this moment, or not one of ours; nor is one whose owner ran in another pid
  namespace (a container sharing the folder: its pids mean nothing here). Best effort: a directory
  that cannot be read or removed (another sweep got there first, another user's) is skipped, never
  an error.
- Linux only (``/proc``); elsewhere nothing is ever found stale, so nothing is swept.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["OWNER_FILE", "ProcessIdentity", "make_owned_dir", "owner_of", "process_identity", "running",
           "sweep_stale_dirs"]

OWNER_FILE = ".owner.json"  # {"pid": int, "start_ticks": int, "boot_id": str, "pid_ns": int}

ProcessIdentity = tuple[int, int, str, int]  # (pid, start ticks since boot, boot id, pid namespace inode)


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> tuple[int, str] | None:
    """(start time in clock ticks since boot, state letter) of ``pid``, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()  # the command name may hold spaces and ')'
    except (OSError, IndexError):
        return None
    return int(fields[19]), fields[0]  # fields[0] is stat field 3 (state), fields[19] field 22 (starttime)


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def process_identity(pid: int | None = None) -> ProcessIdentity | None:
    """The identity of ``pid`` (default: this process) as ``OWNER_FILE`` records it; None without ``/proc``."""
    pid = os.getpid() if pid is None else pid
    st, boot, ns = _start_ticks(pid), _boot_id(), _pid_namespace()
    if st is None or boot is None or ns is None:
        return None
    return pid, st[0], boot, ns


def running(identity: ProcessIdentity) -> bool:
    """Whether the process ``identity`` names is running now (a zombie has exited: not running). True for
    one of another pid namespace: it cannot be looked up from here, so it is never taken for gone."""
    pid, ticks, boot, ns = identity
    if ns != _pid_namespace():
        return True
    st = _start_ticks(pid)
    return st is not None and st[0] == ticks and st[1] != "Z" and _boot_id() == boot


def make_owned_dir(prefix: str) -> Path:
    """A new directory ``tempfile.mkdtemp(prefix=prefix)`` with this process recorded as its owner
    (no owner file where ``/proc`` is missing: such a directory is never swept)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    ident = process_identity()
    if ident is not None:
        tmp = path / (OWNER_FILE + ".tmp")
        tmp.write_text(json.dumps({"pid": ident[0], "start_ticks": ident[1], "boot_id": ident[2],
                                   "pid_ns": ident[3]}))
        os.replace(tmp, path / OWNER_FILE)
    return path


def owner_of(path: str | os.PathLike) -> ProcessIdentity | None:
    """The owner recorded in ``path``'s owner file, or None when it has none or it is malformed."""
    try:
        doc = json.loads((Path(path) / OWNER_FILE).read_text())
        pid, ticks, boot, ns = doc["pid"], doc["start_ticks"], doc["boot_id"], doc["pid_ns"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not all(type(v) is int for v in (pid, ticks, ns)) or not isinstance(boot, str) or pid <= 0:
        return None
    return pid, ticks, boot, ns


def sweep_stale_dirs(prefix: str, root: str | os.PathLike | None = None) -> list[Path]:
    """Remove the ``prefix*`` directories under ``root`` whose recorded owner is not running (module doc);
    the paths removed."""
    if not prefix or os.sep in prefix:
        raise ValueError(f"prefix must be a non-empty file name prefix, got {prefix!r}")
    base = Path(tempfile.gettempdir() if root is None else root)
    removed = []
    try:
        entries = list(base.glob(prefix + "*"))
    except OSError:
        return removed
    for path in entries:
        try:
            if path.is_symlink() or not path.is_dir():
                continue
        except OSError:
            continue
        owner = owner_of(path)
        if owner is None or running(owner):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    return removed
