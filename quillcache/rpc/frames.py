"""Length-prefixed frames on a blocking TCP socket: what both ends of the plain-TCP transport
(:mod:`quillcache.rpc.stream`) read and write with.

Contract:
- A frame is ``HEADER`` (``u32`` big-endian length) + that many bytes.
- :class:`Reader` buffers whole frames from one socket: ``fill`` blocks (each wait cut to a deadline when given,
  ``Stalled`` once it passed, ``BlockingIOError`` when a wait runs out), ``spin`` polls without blocking for a
  short window first (adaptive: a window that passed in vain turns polling off for ``SPIN_BACKOFF`` calls).
- Waits are set with :func:`set_wait` (``SO_RCVTIMEO`` / ``SO_SNDTIMEO``), which leaves the socket blocking so
  ``MSG_DONTWAIT`` polls stay cheap; deadlines are :data:`clock` times.
- :func:`hang_up` closes a connection without a reset overtaking what was sent last: stop sending, read and
  discard what the peer still sends (bounded in bytes and time), close.
"""

from __future__ import annotations

import socket
import struct
import time

__all__ = ["DONTWAIT", "HEADER", "RECV_BYTES", "SPIN_BACKOFF", "Reader", "Stalled", "clock", "hang_up", "set_wait"]

HEADER = struct.Struct(">I")
RECV_BYTES = 1 << 16
DONTWAIT = socket.MSG_DONTWAIT
SPIN_BACKOFF = 15
clock = time.perf_counter  # the clock of every deadline given to this module
_TIMEVAL = struct.Struct("@ll")  # struct timeval, for SO_RCVTIMEO / SO_SNDTIMEO
_MAX_WAIT_S = 1e9  # a longer wait is set as this one (it fits any timeval; decades are forever here)


def set_wait(sock: socket.socket, option: int, seconds: float) -> None:
    """Limit each blocking ``recv`` (``SO_RCVTIMEO``) or ``send`` (``SO_SNDTIMEO``) of ``sock`` to ``seconds`` (at
    least 1 ms; 0 would mean no limit); one that waits that long fails with ``BlockingIOError``. Unlike a Python
    socket timeout this leaves the socket blocking, so ``MSG_DONTWAIT`` polls (``Reader.spin``) stay cheap."""
    seconds = min(max(seconds, 1e-3), _MAX_WAIT_S)
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(whole, int((seconds - whole) * 1e6)))


class Stalled(Exception):
    """A frame that did not arrive whole by its deadline."""


class Reader:
    """Buffered reads of whole frames from a blocking socket."""

    __slots__ = ("sock", "buf", "skip", "wait_s")

    def __init__(self, sock: socket.socket, wait_s: float | None = None) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.skip = 0  # spin() calls left that do not poll (after a window that passed in vain)
        self.wait_s = wait_s  # the socket's SO_RCVTIMEO between frames (server side), restored after a deadline

    def fill(self, n: int, deadline: float | None = None) -> bool:
        """At least ``n`` bytes buffered; False at end of stream first. With ``deadline`` (a ``clock()`` time; the
        socket's ``SO_RCVTIMEO`` in use) each wait is cut to what is left of it and ``Stalled`` is raised once it
        has passed; a wait that runs out raises ``BlockingIOError``."""
        buf, recv = self.buf, self.sock.recv
        if len(buf) >= n:
            return True
        limited = False
        try:
            while len(buf) < n:
                if deadline is not None:
                    left = deadline - clock()
                    if left <= 0:
                        raise Stalled()
                    set_wait(self.sock, socket.SO_RCVTIMEO, left)
                    limited = True
                chunk = recv(max(RECV_BYTES, n - len(buf)))
                if not chunk:
                    return False
                buf += chunk
        finally:
            if limited and self.wait_s is not None:
                set_wait(self.sock, socket.SO_RCVTIMEO, self.wait_s)
        return True

    def spin(self, n: int, spin_s: float) -> bool | None:
        """Poll without blocking (``MSG_DONTWAIT``) for up to ``spin_s`` until ``n`` bytes are buffered: True when
        they are, False at end of stream, None when the window passed (the caller then blocks). Adaptive: after a
        window that passed in vain, the next ``SPIN_BACKOFF`` calls return None at once (the peer is not
        answering within the window, e.g. it shares this core: polling would only take the CPU from it). The
        socket must not have a timeout > 0 (Python would wait in poll first): blocking (None) or non-blocking."""
        buf = self.buf
        if len(buf) >= n:
            return True
        if self.skip:
            self.skip -= 1
            return None
        recv = self.sock.recv
        end = clock() + spin_s
        while len(buf) < n:
            try:
                chunk = recv(RECV_BYTES, DONTWAIT)
            except BlockingIOError:
                if clock() >= end:
                    self.skip = SPIN_BACKOFF
                    return None
                continue
            if not chunk:
                return False
            buf += chunk
        return True

    def take(self, n: int) -> bytes:
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def discard(self, n: int, deadline: float | None = None) -> bool:
        """Discard ``n`` bytes without holding them; False at end of stream first (``deadline`` as in ``fill``)."""
        while n > 0:
            if not self.buf and not self.fill(1, deadline):
                return False
            k = min(n, len(self.buf))
            del self.buf[:k]
            n -= k
        return True


def hang_up(sock: socket.socket, drain_bytes: int, drain_s: float) -> None:
    """Stop sending, read and discard what the peer still sends (at most ``drain_bytes``, until it stops sending
    or ``drain_s`` passed; 0: only what is waiting now) and close: an unread receive queue would make close send a
    RST, which can overtake what was sent last."""
    try:
        sock.shutdown(socket.SHUT_WR)
        end = clock() + drain_s
        while drain_bytes > 0:
            wait = end - clock()
            if wait > 0:
                set_wait(sock, socket.SO_RCVTIMEO, wait)
                chunk = sock.recv(min(RECV_BYTES, drain_bytes))
            else:
                chunk = sock.recv(min(RECV_BYTES, drain_bytes), DONTWAIT)
            if not chunk:
                break
            drain_bytes -= len(chunk)
    except OSError:
        pass  # nothing more waiting (BlockingIOError), or the peer is gone
    finally:
        sock.close()
