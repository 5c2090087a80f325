"""The RDMA backend's control connection: an authenticated TCP socket that carries QP records.

The ``rdma`` backend exchanges queue-pair information (``rdma_info``) over a SEPARATE small control
socket of its own (``rdma://HOST:TCP_PORT/CTRL_PORT``: the ``CTRL_PORT`` part), not over a new
opcode of the TCP transfer protocol. The connection first passes exactly the TCP protocol's HMAC
challenge-response, with ``protocol``'s helpers: the server sends HELLO (``encode_hello``), the
client answers PROOF (``client_proof``/``encode_proof``), the server checks it in constant time
(``decode_proof``) and answers ACCEPT (``server_proof``/``encode_accept``), which the client checks
(``decode_accept``). Both sides prove the cluster's secret; neither sends it. Then the client sends
its QP record and the server answers with its own; a later record on the same connection is a
refresh. A server with no slot for the connection (its authenticated slots are full, or it dropped
this connection, still authenticating, for a newer one) sends, in place of HELLO or ACCEPT, the TCP
protocol's response frame with status BUSY and a reason, then closes; ``connect_peer`` raises
``Busy`` for it (the caller may try again on a fresh connection: nothing was exchanged yet).

The serving half of the handshake is not here: ``RdmaBackend`` runs it without blocking on the
accepting thread of its ``PreauthAcceptor`` (``backends/acceptor``), as the TCP server does.

Invariants:
- Every read is bounded: a record's header is validated (``read_region_count``) before its region
  entries are read, so a peer cannot make us read more than ``max_regions`` entries.
- Every wait is bounded by ``progress_s`` per call (``first_s`` for a first byte) and by the
  caller's deadline; ``socket.timeout`` past it, ``ConnectionError`` on EOF mid-record.
- A control connection has no idle timeout on the serving side (``CTRL_IDLE_S``): RDMA traffic never
  touches it, and closing it destroys the peer's QP. TCP keepalive finds a dead host instead.
"""

from __future__ import annotations

import socket
import struct
import time

from quillcache.transfer import protocol as P
from quillcache.transfer.rdma_info import HEADER, REGION, QpInfo, decode_qp_info, encode_qp_info, read_region_count
from quillcache.transfer.types import AuthenticationError, ProtocolError

__all__ = ["CTRL_IDLE_S", "Busy", "alive", "connect_peer", "recv_exact", "recv_info", "send_all",
           "send_info", "tune"]

CTRL_IDLE_S = 365 * 86400.0


def _wait(seconds: float, deadline: float | None) -> float:
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("deadline passed")
        seconds = min(seconds, left)
    return seconds


def recv_exact(sock: socket.socket, n: int, progress_s: float, deadline: float | None = None,
               first_s: float | None = None) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        sock.settimeout(_wait(first_s if (got == 0 and first_s is not None) else progress_s, deadline))
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k
    return bytes(buf)


def send_all(sock: socket.socket, data: bytes, progress_s: float, deadline: float | None = None) -> None:
    sock.settimeout(_wait(progress_s, deadline))
    sock.sendall(data)  # control records are small


def alive(sock: socket.socket | None) -> bool:
    """A non-blocking peek: False when the peer closed the connection (or it broke, or is out of step)."""
    if sock is None:
        return False
    try:
        sock.settimeout(0.0)
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False
    return False


class Busy(Exception):
    """The server answered the handshake BUSY: no slot for this connection now; a fresh one may get one later."""


def tune(sock: socket.socket) -> None:
    """Every control connection: no Nagle delay (records are small), TCP keepalive (no idle timeout)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def _handshake_frame(sock: socket.socket, kind: str, fmt: struct.Struct, magic: bytes, progress_s: float,
                     deadline: float, where: str) -> bytes:
    """The server's next handshake frame (``protocol.read_handshake_frame`` on this socket: another protocol
    version or an OK in its place is a ``ProtocolError``). A refusal in its place: BUSY raises ``Busy``, any
    other status ``ProtocolError``, each with the server's reason."""
    try:
        return P.read_handshake_frame(lambda n: recv_exact(sock, n, progress_s, deadline), kind, fmt, magic, where)
    except P.HandshakeRefused as r:
        if r.status is P.Status.BUSY:
            raise Busy(f"{where} is busy: {r.reason}") from None
        raise ProtocolError(f"{where} refused the control connection ({r.status.name}): {r.reason}") from None


def connect_peer(host: str, port: int, secret: bytes, *, connect_timeout_s: float, auth_timeout_s: float,
                 progress_s: float, deadline: float) -> socket.socket:
    """Connect (bounded by ``connect_timeout_s`` and ``deadline``) and authenticate; the caller owns the socket.

    ``Busy`` when the server answers BUSY in place of HELLO or ACCEPT (the socket is closed)."""
    timeout = max(0.001, min(connect_timeout_s, deadline - time.monotonic()))
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        tune(sock)
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        hs_deadline = min(deadline, time.monotonic() + auth_timeout_s + connect_timeout_s)
        hello = _handshake_frame(sock, "hello", P.HELLO, P.HELLO_MAGIC, progress_s, hs_deadline, where)
        server_nonce = P.decode_hello(hello)
        client_nonce = P.new_nonce()
        send_all(sock, P.encode_proof(client_nonce, P.client_proof(secret, server_nonce, client_nonce)),
                 progress_s, hs_deadline)
        try:
            accept = _handshake_frame(sock, "accept", P.ACCEPT, P.ACCEPT_MAGIC, progress_s, hs_deadline, where)
        except ConnectionError:
            raise AuthenticationError(f"{where} closed the control connection during authentication "
                                      "(wrong shared secret?)") from None
        P.decode_accept(accept, secret, server_nonce, client_nonce)
    except BaseException:
        sock.close()
        raise
    return sock


def send_info(sock: socket.socket, info: QpInfo, progress_s: float, deadline: float | None) -> None:
    send_all(sock, encode_qp_info(info), progress_s, deadline)


def recv_info(sock: socket.socket, progress_s: float, max_regions: int, deadline: float | None,
              first_s: float | None = None) -> QpInfo:
    head = recv_exact(sock, HEADER.size, progress_s, deadline, first_s)
    count = read_region_count(head, max_regions)
    body = recv_exact(sock, count * REGION.size, progress_s, deadline) if count else b""
    return decode_qp_info(head + body, max_regions)
