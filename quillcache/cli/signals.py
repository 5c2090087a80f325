"""Stop signals handled like Ctrl-C, so a command's ``finally`` blocks run for them too.

``stop_signals_interrupt()`` is a context manager: inside it, the first ``STOP_SIGNALS`` signal
(SIGTERM: ``kill``, ``timeout``, a service manager; SIGHUP: the terminal closed) raises
:class:`Terminated` in the main thread. ``Terminated`` is a ``KeyboardInterrupt``, so every path
that already cleans up after Ctrl-C (stopping child processes, removing temporary files and
folders) runs unchanged; ``exit_status`` turns either into the conventional status (130 for Ctrl-C,
128 + the signal number otherwise). A second stop signal while that cleanup runs is ignored, so the
cleanup is never cut short by it. A stop signal ignored when the block is entered (``nohup``'s
SIGHUP) stays ignored. The previous handlers are restored on leaving the block; outside the main
thread (where Python cannot install handlers) it does nothing.

``interrupts_deferred()`` holds Ctrl-C and the stop signals off for a short critical section (renaming
a result set into place): they are recorded, not raised, and the caller acts on them once it is done.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["STOP_SIGNALS", "Terminated", "describe", "exit_status", "interrupts_deferred", "stop_signals_interrupt"]

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class Terminated(KeyboardInterrupt):
    """A stop signal (``signum``) arrived inside ``stop_signals_interrupt``; handled like Ctrl-C."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        super().__init__(f"{signal.Signals(self.signum).name} received")


def _signum(exc: KeyboardInterrupt) -> int:
    return getattr(exc, "signum", signal.SIGINT)  # a plain KeyboardInterrupt is Ctrl-C's


def exit_status(exc: KeyboardInterrupt) -> int:
    """128 + the signal number that ended the command: the exception's ``signum`` (``Terminated``,
    ``ResultsWritten``), else SIGINT's (Ctrl-C)."""
    return 128 + _signum(exc)


def describe(exc: KeyboardInterrupt) -> str:
    """``"interrupted"`` for Ctrl-C, ``"stopped by SIGTERM"`` (or SIGHUP) for a stop signal."""
    signum = _signum(exc)
    return "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"


@contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """Within the block, the first SIGTERM/SIGHUP raises ``Terminated``; later ones are ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised: list[int] = []

    def handler(signum: int, frame) -> None:  # noqa: ARG001 - signal handler signature
        if raised:  # cleanup for the first one is running: let it finish
            return
        raised.append(signum)
        raise Terminated(signum)

    # a signal ignored when the command started stays ignored (``nohup`` passes SIGHUP down ignored: the
    # user asked the command to outlive the terminal)
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


@contextmanager
def interrupts_deferred() -> Iterator[list[int]]:
    """Within the block, Ctrl-C and the stop signals are appended to the yielded list instead of
    raising; the previous handlers are restored on leaving. Outside the main thread: nothing to defer."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in (signal.SIGINT, *STOP_SIGNALS)}
    try:
        yield caught
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
