"""The TCP backend's configuration and its ``Channel``: exact reads into views, progress-bounded sends.

Every call moves bytes with ``recv_into``/``recvmsg_into``/``send``/``sendmsg`` on memoryviews, which
release the GIL and copy nothing in Python; each must make progress within ``progress_s`` seconds and
the whole operation must end by ``deadline`` (``time.monotonic()``), else ``socket.timeout``.
"""

from __future__ import annotations

import socket
import struct
import time

__all__ = ["Channel", "TcpConfig"]

from dataclasses import dataclass


@dataclass(frozen=True)
class TcpConfig:
    """Knobs of the TCP backend (both sides). Times in seconds, sizes in bytes.

    ``connections_per_peer`` bounds the client's persistent connections to one peer;
    ``window`` the requests in flight on one connection; ``progress_timeout_s`` how long any one
    socket call may go without moving a byte; ``idle_check_s`` after how long idle a pooled
    connection is probed for liveness before reuse; ``max_request_bytes`` the largest READ/WRITE a
    server accepts; ``max_server_connections`` the connections a server holds at once;
    ``auth_timeout_s`` how long an unauthenticated peer may take; ``server_idle_timeout_s`` when a
    server drops a connection that sends nothing; ``lane_min_bytes`` the least bytes worth a
    connection of their own when a batch is spread over connections.
    """

    connections_per_peer: int = 4
    window: int = 16
    connect_timeout_s: float = 5.0
    progress_timeout_s: float = 10.0
    idle_check_s: float = 1.0
    max_request_bytes: int = 1 << 30
    max_server_connections: int = 256
    auth_timeout_s: float = 2.0
    server_idle_timeout_s: float = 600.0
    lane_min_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        for name in ("connections_per_peer", "window", "max_request_bytes", "max_server_connections",
                     "lane_min_bytes"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"TcpConfig.{name} must be a positive int, got {v!r}")
        for name in ("connect_timeout_s", "progress_timeout_s", "idle_check_s", "auth_timeout_s",
                     "server_idle_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"TcpConfig.{name} must be a positive number of seconds, got {v!r}")


class Channel:
    """A blocking socket whose every call must make progress within a per-call timeout.

    The timeouts are the kernel's (``SO_RCVTIMEO``/``SO_SNDTIMEO``), not Python's: a Python socket
    timeout makes every call ``poll`` first and every ``settimeout`` switch the descriptor's mode,
    two extra system calls per call on the hot path. The kernel timeout is changed only when a
    deadline comes nearer than ``progress_s``. A call that times out raises ``socket.timeout``; a
    peer that closes mid-frame raises ``ConnectionError`` saying how many bytes of how many came.
    """

    __slots__ = ("sock", "progress_s", "_armed_s")

    def __init__(self, sock: socket.socket, progress_s: float) -> None:
        sock.settimeout(None)
        self.sock = sock
        self.progress_s = progress_s
        self._armed_s = -1.0
        self._set(progress_s)

    def _set(self, seconds: float) -> None:
        seconds = max(seconds, 1e-6)
        tv = struct.pack("ll", int(seconds), int((seconds % 1.0) * 1e6))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self._armed_s = seconds

    def arm(self, deadline: float | None, wait_s: float | None = None) -> None:
        """Bound the next calls by ``wait_s`` (default ``progress_s``) and by ``deadline``."""
        t = self.progress_s if wait_s is None else wait_s
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("deadline passed")
            if left < t:
                t = left
        if t != self._armed_s:
            self._set(t)

    def recv_into(self, view: memoryview, deadline: float | None = None, first_wait_s: float | None = None) -> None:
        """Fill ``view``; ``first_wait_s`` bounds the wait for its first byte instead of ``progress_s``."""
        got, n, sock = 0, len(view), self.sock
        self.arm(deadline, first_wait_s)
        try:
            while got < n:
                k = sock.recv_into(view[got:] if got else view)
                if k == 0:
                    raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
                if not got and first_wait_s is not None:
                    self.arm(deadline)
                got += k
                if got < n and deadline is not None:
                    self.arm(deadline)
        except BlockingIOError:
            raise socket.timeout(f"no progress after {got} of {n} bytes") from None

    def recv_idle_into(self, view: memoryview, idle_s: float) -> None:
        """Fill ``view``, waiting up to ``idle_s`` for its first byte without re-arming the kernel timeout
        unless ``idle_s`` is the shorter (a server waiting for the next request pays no system call for it)."""
        start = time.monotonic()
        if idle_s < self._armed_s:  # a longer kernel timeout would hold an idle peer past idle_s
            self._set(idle_s)
        while True:
            try:
                k = self.sock.recv_into(view)
            except BlockingIOError:
                if time.monotonic() - start >= idle_s:
                    raise socket.timeout(f"idle for {idle_s} s") from None
                continue
            if k == 0:
                raise ConnectionError(f"peer closed the connection after 0 of {len(view)} bytes")
            if k < len(view):
                self.recv_into(view[k:])
            return

    def recv_two(self, head: memoryview, body: memoryview, deadline: float | None = None) -> int:
        """Read into ``head`` and as much of ``body`` as arrives with it (one ``recvmsg_into``); returns the
        bytes of ``body`` filled. ``head`` is always filled completely."""
        self.arm(deadline)
        try:
            k = self.sock.recvmsg_into([head, body])[0]
        except BlockingIOError:
            raise socket.timeout(f"no progress after 0 of {len(head)} bytes") from None
        if k == 0:
            raise ConnectionError(f"peer closed the connection after 0 of {len(head)} bytes")
        if k < len(head):
            self.recv_into(head[k:], deadline)
            return 0
        return k - len(head)

    def recv(self, n: int, deadline: float | None = None, first_wait_s: float | None = None) -> bytearray:
        buf = bytearray(n)
        if n:
            self.recv_into(memoryview(buf), deadline, first_wait_s)
        return buf

    def send(self, head: bytes, body: memoryview | None = None, deadline: float | None = None) -> None:
        """Send ``head`` then ``body`` (one ``sendmsg`` for both), each call progress-bounded."""
        self.arm(deadline)
        sock = self.sock
        try:
            if body is None or not len(body):
                sent, total, parts = sock.send(head), len(head), (head,)
            else:
                sent, total, parts = sock.sendmsg([head, body]), len(head) + len(body), (head, body)
            if sent == total:
                return
            for part in parts:
                if sent >= len(part):
                    sent -= len(part)
                    continue
                view, off, sent = memoryview(part), sent, 0
                while off < len(view):
                    if deadline is not None:
                        self.arm(deadline)
                    off += sock.send(view[off:])
        except BlockingIOError:
            raise socket.timeout("no progress sending") from None

    def alive(self) -> bool:
        """A non-blocking peek: False when the peer closed (or sent something nobody asked for)."""
        try:
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        return False

    def close(self) -> None:
        self.sock.close()
