"""Socket helpers shared by the TCP client and server: exact reads into views, progress-bounded sends.

Every helper moves bytes with ``recv_into``/``send``/``sendmsg`` on memoryviews, which release the GIL
and copy nothing in Python; each call must make progress within ``progress_s`` seconds and the whole
operation must end by ``deadline`` (``time.monotonic()``), else ``socket.timeout`` is raised.
A peer that closes mid-frame raises ``ConnectionError`` saying how many bytes of how many arrived.
"""

from __future__ import annotations

import socket
import time

__all__ = ["TcpConfig", "recv_exact", "recv_exact_into", "send_all"]

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


def _timeout(progress_s: float, deadline: float | None) -> float:
    if deadline is None:
        return progress_s
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("deadline passed")
    return min(progress_s, left)


def recv_exact_into(sock: socket.socket, view: memoryview, progress_s: float, deadline: float | None = None,
                    first_s: float | None = None) -> None:
    """Fill ``view`` from ``sock``; ``first_s`` (if given) bounds the wait for the first byte instead."""
    got, n = 0, len(view)
    while got < n:
        sock.settimeout(first_s if (got == 0 and first_s is not None) else _timeout(progress_s, deadline))
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k


def recv_exact(sock: socket.socket, n: int, progress_s: float, deadline: float | None = None,
               first_s: float | None = None) -> bytearray:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf), progress_s, deadline, first_s)
    return buf


def send_all(sock: socket.socket, head: bytes, body: memoryview | None, progress_s: float,
             deadline: float | None = None) -> None:
    """Send ``head`` then ``body`` (one ``sendmsg`` for both when possible), progress-bounded."""
    sock.settimeout(_timeout(progress_s, deadline))
    if body is None or not len(body):
        sent = sock.send(head)
        total, parts = len(head), (memoryview(head),)
    else:
        sent = sock.sendmsg([head, body])
        total, parts = len(head) + len(body), (memoryview(head), body)
    if sent == total:
        return
    for part in parts:
        if sent >= len(part):
            sent -= len(part)
            continue
        off = sent
        sent = 0
        while off < len(part):
            sock.settimeout(_timeout(progress_s, deadline))
            off += sock.send(part[off:])
