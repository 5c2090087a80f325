"""A child of ``LocalCluster`` (``quillcache cluster up``, ``replay --cluster``) stops when its
parent is gone, even one killed by SIGKILL, whose ``finally`` blocks never ran.

``PR_SET_PDEATHSIG`` would need ``preexec_fn``, which is unsafe in a parent with threads. Instead
the parent names its pid in ``PARENT_ENV``; ``parent_watch`` (called once, at a child's start)
removes the variable from the environment, so nothing the child starts inherits it, and returns a
check the child's serving loop polls: true once ``os.getppid()`` is no longer that pid (the child
was re-parented: its parent died). The child then stops as on SIGTERM, so its own cleanup runs. A
process started any other way (the variable unset, malformed, or naming a pid that is not its
parent's) gets a check that is always false.
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["PARENT_ENV", "parent_watch"]

PARENT_ENV = "QUILLCACHE_PARENT_PID"


def _never() -> bool:
    return False


def parent_watch() -> Callable[[], bool]:
    """Read (and remove) ``PARENT_ENV``; a check that says whether the parent it names is gone."""
    raw = os.environ.pop(PARENT_ENV, None)
    try:
        pid = int(raw) if raw is not None else None
    except ValueError:
        pid = None
    if pid is None or pid <= 1 or pid != os.getppid():
        return _never
    return lambda: os.getppid() != pid
