"""Deadline-bounded waits for tests (never fixed sleeps): one definition for every test module.

- ``wait_until(predicate, timeout_s, what, poll_s=0.02)``: poll until ``predicate()`` is truthy and return that
  value; past the deadline, ``AssertionError`` naming ``what`` (put the RNG seed in it where a failure must be
  replayable).
- ``wait_stopped(pid, timeout_s)``: until every thread of ``pid`` is stopped (SIGSTOP is delivered
  asynchronously; read from ``/proc``).
"""

from __future__ import annotations

import contextlib
import os
import time

__all__ = ["wait_stopped", "wait_until"]


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.02):
    """Poll ``predicate`` until it returns a truthy value (returned) or ``timeout_s`` passes (AssertionError)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(poll_s)  # the poll interval of a deadline-bounded wait


def _all_threads_stopped(pid: int) -> bool:
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                states.append(fh.read().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(s in "tT" for s in states)


def wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Wait until every thread of ``pid`` is stopped (module docstring)."""
    wait_until(lambda: _all_threads_stopped(pid), timeout_s, f"every thread of {pid} stopped", poll_s=0.002)
