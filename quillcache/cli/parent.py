"""A child of ``LocalCluster`` (``quillcache cluster up``, ``replay --cluster``) stops when its
parent is gone, even one killed by SIGKILL, whose ``finally`` blocks never ran.

The parent names its pid in ``PARENT_ENV``. ``parent_watch``, called once at the very start of a
child, removes the variable from the environment (nothing the child starts inherits it) and
returns a check its serving loop polls: true once ``os.getppid()`` is no longer that pid (the child
was re-parented because its parent died), or at once if the parent had already died before the
call (the named pid no longer exists, or the child's parent is init). The child then stops as on
SIGTERM, so its own cleanup runs. A process started any other way (the variable unset, malformed,
or naming a live process that is not its parent) gets a check that is always false.

A child that is stopped (SIGSTOP: ``LocalCluster.pause_node``) cannot poll, and a child in its own
session gets no SIGCONT from the kernel when its process group is orphaned. So, on Linux, the
watch also asks the kernel for SIGCONT on the parent's death (``prctl(PR_SET_PDEATHSIG)``):
harmless to a running process, and it wakes a stopped one, which then sees the check. (That
signal is sent when the *thread* that started the child exits, which may be before the parent
does: another reason it is only SIGCONT, never a stop signal; the check is what decides.)

A child that is not ours to change (the ``etcd`` binary, which cannot poll) is started with
``kill_on_parent_death(sig)`` as its ``preexec_fn``: between fork and exec it asks the kernel for
``sig`` on its parent's death, and exits at once if the parent died before that (the request
would then never fire). Because that signal follows the starting *thread*, the guard is only
given when the child is started from the main thread (whose end is the process's end); from any
other thread ``kill_on_parent_death`` returns None and the child is not guarded.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

__all__ = ["PARENT_ENV", "kill_on_parent_death", "parent_watch"]

PARENT_ENV = "QUILLCACHE_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _never() -> bool:
    return False


def _always() -> bool:
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` with its argument types declared, or None off Linux or without it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def _continue_on_parent_death() -> None:
    prctl = _prctl()
    if prctl is not None:  # (without it, a stopped child waits for a SIGCONT from someone else)
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGCONT), 0, 0, 0)


def kill_on_parent_death(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that makes the kernel send ``sig`` to the child when
    this process dies (Linux, called from the main thread), or None where that cannot be promised.
    The child kills itself (SIGKILL) if this process is already gone when it runs. Should the kernel
    refuse the request (a seccomp filter), the child runs unguarded: nothing between fork and exec
    can report it."""
    if threading.current_thread() is not threading.main_thread():
        return None
    prctl = _prctl()  # resolved here, not between fork and exec
    if prctl is None:
        return None
    parent = os.getpid()
    sig = int(sig)

    def arm() -> None:  # runs in the child, before exec: no imports, no locks
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request was made
            os.kill(os.getpid(), signal.SIGKILL)

    return arm


def parent_watch() -> Callable[[], bool]:
    """Read (and remove) ``PARENT_ENV``; a check that says whether the parent it names is gone."""
    raw = os.environ.pop(PARENT_ENV, None)
    try:
        pid = int(raw) if raw is not None else None
    except ValueError:
        pid = None
    if pid is None or pid <= 1:
        return _never
    if pid != os.getppid():
        # the parent died before this call (re-parented to init or a subreaper), or the variable names
        # some other process (then it is not ours to watch)
        return _always if os.getppid() == 1 or not _alive(pid) else _never
    _continue_on_parent_death()
    return lambda: os.getppid() != pid
