"""File descriptors a test process holds: ``fds_into(path)`` names the open files under ``path`` (Linux /proc)."""

from __future__ import annotations

import os


def fds_into(path: str) -> list[str]:
    """Targets of this process's open descriptors that lie under ``path``."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(path):
            out.append(target)
    return out
