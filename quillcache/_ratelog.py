"""Rate-limited log lines for events a peer can cause at will (connections dropped or turned away, requests,
calls and items refused).

A server must say what it refuses, or an attack leaves no trace in its log; it must not write a line per refusal,
or the log becomes the attack's amplifier. Every server here logs such events through one ``BurstLog``:

- a window of ``window_s`` opens at the first event after the previous window ended;
- the window's first ``burst`` events are logged as they happen, each at the level it was noted with;
- the rest are only counted by kind, and one summary line sums up the window (every event of it by kind, how
  many were not logged one by one, and the latest of those) once the window is over: at the next event
  (``note``), at ``tick()`` from an owner that has a loop of its own (``wait_s`` says when one is due), or at
  ``tick(final=True)`` when the owner closes. A summary is logged at the highest level among the events it
  counts, so a warning-level event never hides in an info-level line.

Invariants: a window costs at most ``burst + 1`` lines however many events it has; every event is either a line
of its own or counted in exactly one summary line (``suppressed_total`` counts the events that were only counted,
since the log was made); a summary is written only for a window that had such an event. Thread-safe: ``note``,
``tick`` and ``wait_s`` may be called from any thread. The clock is ``time.monotonic`` unless one is given.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["BurstLog"]


class BurstLog:
    """``burst`` lines per window of ``window_s``, then one summary line (module docstring). ``what`` names the
    events in the summary ("unauthenticated connections dropped"); ``prefix`` starts every line (a node's id)."""

    def __init__(self, log: logging.Logger, what: str, *, window_s: float, burst: int, prefix: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not window_s >= 0 or burst < 0:
            raise ValueError(f"BurstLog needs window_s >= 0 and burst >= 0, got {window_s!r} and {burst!r}")
        self.log, self.what, self.window_s, self.burst, self.prefix = log, what, float(window_s), int(burst), prefix
        self._clock = clock
        self._lock = threading.Lock()
        self._started_s = self._ends_s = float("-inf")  # the current window; none open once it ended
        self._counts: dict[str, int] = {}  # by kind, every event of the window (logged or not)
        self._logged = 0  # events of the window logged one by one
        self._suppressed = 0  # events of the window only counted
        self._level = logging.NOTSET  # the highest level among the counted events
        self._latest = ""  # the latest counted event, as its line would have read
        self.suppressed_total = 0

    def note(self, kind: str, fmt: str, *args: object, n: int = 1, level: int = logging.WARNING) -> None:
        """One event of ``kind`` (``n`` things: items of one call, say) that ``fmt % args`` describes."""
        with self._lock:
            now = self._clock()
            if now >= self._ends_s:
                self._summary(now)
                self._started_s, self._ends_s = now, now + self.window_s
            self._counts[kind] = self._counts.get(kind, 0) + n
            if self._logged < self.burst:
                self._logged += 1
                if args:  # the prefix is data, never part of the format (a '%' in a node id)
                    self.log.log(level, self.prefix.replace("%", "%%") + fmt, *args)
                else:  # no arguments: ``fmt`` is the line itself, never formatted
                    self.log.log(level, "%s%s", self.prefix, fmt)
                return
            self._suppressed += 1
            self.suppressed_total += 1
            self._level = max(self._level, level)
            self._latest = (fmt % args) if args else fmt

    def wait_s(self) -> float | None:
        """Seconds until a summary is due, or None when the window has nothing to sum up."""
        with self._lock:
            return max(0.0, self._ends_s - self._clock()) if self._suppressed else None

    def tick(self, *, final: bool = False) -> None:
        """Log the window's summary if it is due (``final``: now, whether or not the window is over)."""
        with self._lock:
            now = self._clock()
            if self._suppressed and (final or now >= self._ends_s):
                self._summary(now)

    def _summary(self, now: float) -> None:
        """(Under the lock.) The summary line of the window so far, if any event went unlogged; then start afresh."""
        if self._suppressed:
            detail = ", ".join(f"{n} {kind}" for kind, n in sorted(self._counts.items()))
            self.log.log(self._level, "%s%s in the last %.1f s: %d (%s); %d event(s) not logged one by one, the "
                         "latest: %s", self.prefix, self.what, min(now, self._ends_s) - self._started_s,
                         sum(self._counts.values()), detail, self._suppressed, self._latest)
        self._counts.clear()
        self._logged = self._suppressed = 0
        self._level = logging.NOTSET
        self._latest = ""
        self._ends_s = min(self._ends_s, now)
