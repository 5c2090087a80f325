"""The initiating half of the TCP backend: bounded persistent connections, pipelined requests.

Invariants:
- At most ``connections_per_peer`` connections to one peer exist at once; a caller that needs one
  more waits for a free one (never past its requests' deadlines). Connections are reused, so a
  steady workload holds a fixed number of sockets (no ephemeral-port exhaustion).
- A connection idle longer than ``idle_check_s`` is probed (a non-blocking ``MSG_PEEK``) before
  reuse; one the peer closed (a restart, an idle timeout) is dropped and replaced, so the caller
  never sees it. A request that was sent on a connection that then broke, before any answer to it
  came back, is retried once on a fresh connection (READ and WRITE of a fixed range are
  idempotent); a second break fails it with the reason.
- Up to ``window`` requests are in flight on one connection; the server answers in order and each
  answer's request id must match the oldest outstanding request (else ``ProtocolError`` and the
  connection is dropped).
- READ data is received straight into the local region (``recv_into``); WRITE data is sent straight
  from it (``sendmsg``). COMPLETED for a WRITE is reported only after the server's acknowledgement,
  which it sends once the bytes are in its memory.
- Every socket call makes progress within ``progress_timeout_s`` and ends by the deadline of the
  request it serves; a request whose deadline passes ends TIMEOUT, and the connection it was on is
  closed (its state is unknown).
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from quillcache.transfer import protocol as P
from quillcache.transfer.backends.sockets import TcpConfig, recv_exact, recv_exact_into, send_all
from quillcache.transfer.batch import Item
from quillcache.transfer.types import (
    AuthenticationError,
    Op,
    Outcome,
    ProtocolError,
    RemoteRegion,
    TransferError,
)

__all__ = ["ClientStats", "TcpClient", "parse_address"]

log = logging.getLogger("quillcache.transfer.client")
_REQUEST_IDS = itertools.count(1)


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` → ``(host, port)``; anything else raises ``ValueError`` naming the address."""
    if not isinstance(address, str):
        raise TypeError(f"a peer address must be a str 'host:port', got {type(address).__name__}")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad peer address {address!r}: expected 'host:port' with a port in 1..65535")
    return host.strip("[]"), int(port)


@dataclass
class ClientStats:
    connects: int = 0
    reconnects: int = 0
    stale_dropped: int = 0
    retries: int = 0


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    address: str
    last_used_s: float = field(default_factory=time.monotonic)
    answered: int = 0


class _Pool:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.idle: list[_Conn] = []
        self.open = 0
        self.cond = threading.Condition()
        self.ever_connected = False


class _Broken(Exception):
    """The connection failed; ``reason`` says how. Outstanding requests may be retried."""


class TcpClient:
    def __init__(self, secret: bytes, config: TcpConfig) -> None:
        self.secret, self.config = secret, config
        self.stats = ClientStats()
        self._pools: dict[str, _Pool] = {}
        self._lock = threading.Lock()
        self._closed = False

    # ---- connections ------------------------------------------------------------------------------------------

    def _pool(self, address: str) -> _Pool:
        with self._lock:
            if self._closed:
                raise TransferError("the transfer engine is closed")
            pool = self._pools.get(address)
            if pool is None:
                pool = self._pools[address] = _Pool(self.config.connections_per_peer)
            return pool

    def _connect(self, address: str, deadline: float) -> _Conn:
        cfg = self.config
        host, port = parse_address(address)
        timeout = max(0.001, min(cfg.connect_timeout_s, deadline - time.monotonic()))
        sock = socket.create_connection((host, port), timeout=timeout)  # non-blocking connect with a timeout
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hs_deadline = min(deadline, time.monotonic() + cfg.auth_timeout_s + cfg.connect_timeout_s)
            server_nonce = P.decode_hello(bytes(recv_exact(sock, P.HELLO.size, cfg.progress_timeout_s, hs_deadline)))
            client_nonce = P.new_nonce()
            send_all(sock, P.encode_proof(client_nonce, P.client_proof(self.secret, server_nonce, client_nonce)),
                     None, cfg.progress_timeout_s, hs_deadline)
            try:
                frame = recv_exact(sock, P.ACCEPT.size, cfg.progress_timeout_s, hs_deadline)
            except ConnectionError:
                raise AuthenticationError(f"{address} closed the connection during authentication "
                                          "(wrong shared secret?)") from None
            P.decode_accept(bytes(frame), self.secret, server_nonce, client_nonce)
        except BaseException:
            sock.close()
            raise
        self.stats.connects += 1
        return _Conn(sock, address)

    @staticmethod
    def _alive(conn: _Conn) -> bool:
        """A non-blocking peek: False when the peer closed (or sent something unasked)."""
        try:
            conn.sock.settimeout(0.0)  # with a timeout set, Python would first poll for readability
            conn.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        return False  # b"" is EOF; unasked bytes mean the stream is out of step

    def _checkout(self, address: str, deadline: float) -> _Conn:
        pool = self._pool(address)
        with pool.cond:
            while True:
                while pool.idle:
                    conn = pool.idle.pop()
                    if time.monotonic() - conn.last_used_s < self.config.idle_check_s or self._alive(conn):
                        return conn
                    self.stats.stale_dropped += 1
                    log.info("dropping a pooled connection to %s that the peer closed", address)
                    conn.sock.close()
                    pool.open -= 1
                if pool.open < pool.limit:
                    pool.open += 1
                    reconnect = pool.ever_connected
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout(f"no free connection to {address} before the deadline")
                pool.cond.wait(left)
        try:
            conn = self._connect(address, deadline)
        except BaseException:
            with pool.cond:
                pool.open -= 1
                pool.cond.notify()
            raise
        with pool.cond:
            pool.ever_connected = True
        if reconnect:
            self.stats.reconnects += 1
        return conn

    def _checkin(self, conn: _Conn, healthy: bool) -> None:
        pool = self._pool(conn.address) if not self._closed else self._pools.get(conn.address)
        if pool is None:
            conn.sock.close()
            return
        with pool.cond:
            if healthy and not self._closed:
                conn.last_used_s = time.monotonic()
                pool.idle.append(conn)
            else:
                conn.sock.close()
                pool.open -= 1
            pool.cond.notify()

    # ---- requests ---------------------------------------------------------------------------------------------

    def list_regions(self, address: str, timeout_s: float) -> tuple[RemoteRegion, ...]:
        deadline = time.monotonic() + timeout_s
        conn = self._checkout(address, deadline)
        ok = False
        try:
            rid = next(_REQUEST_IDS)
            send_all(conn.sock, P.encode_request(P.Opcode.LIST, rid, 0, 0, 0), None,
                     self.config.progress_timeout_s, deadline)
            resp = P.decode_response(bytes(recv_exact(conn.sock, P.RESPONSE.size, self.config.progress_timeout_s,
                                                      deadline)))
            if resp.request_id != rid:
                raise ProtocolError(f"answer to request {resp.request_id} while waiting for {rid}")
            if resp.length > P.MAX_LIST_BYTES:
                raise ProtocolError(f"region list of {resp.length} bytes exceeds {P.MAX_LIST_BYTES}")
            body = bytes(recv_exact(conn.sock, resp.length, self.config.progress_timeout_s, deadline))
            if resp.status is not P.Status.OK:
                raise TransferError(f"{address} refused the region list: {body.decode('utf-8', 'replace')}")
            regions = P.decode_regions(body)
            ok = True
            return regions
        finally:
            self._checkin(conn, ok)

    def execute(self, address: str, items: list[Item]) -> None:
        queue: deque[Item] = deque(items)
        while queue:
            head = queue[0]
            if head.remaining_s() <= 0:
                queue.popleft().finish(Outcome.TIMEOUT, "deadline passed before the request was sent")
                continue
            try:
                conn = self._checkout(address, max(it.deadline_s for it in queue))
            except socket.timeout as e:
                for it in queue:
                    it.finish(Outcome.TIMEOUT, f"could not reach {address} before the deadline: {e}")
                return
            except (OSError, TransferError) as e:
                reason = f"cannot connect to {address}: {e}"
                for it in queue:
                    it.finish(Outcome.FAILED, reason)
                return
            healthy = False
            try:
                self._pipeline(conn, queue)
                healthy = True
            except (_Broken, socket.timeout):
                pass  # in-flight requests are finished or requeued; the rest go on a fresh connection
            finally:
                self._checkin(conn, healthy)

    def _pipeline(self, conn: _Conn, queue: deque[Item]) -> None:
        """Run ``queue`` on ``conn``; on a broken connection, requeue (or fail) what was in flight and return."""
        cfg = self.config
        sock = conn.sock
        pending: deque[tuple[Item, int]] = deque()
        hbuf = bytearray(P.RESPONSE.size)
        hview = memoryview(hbuf)
        try:
            while queue or pending:
                while queue and len(pending) < cfg.window:
                    it = queue[0]
                    if it.remaining_s() <= 0:
                        queue.popleft().finish(Outcome.TIMEOUT, "deadline passed before the request was sent")
                        continue
                    req = it.request
                    rid = next(_REQUEST_IDS)
                    head = P.encode_request(P.Opcode(int(req.op)), rid, req.remote_region, req.remote_offset_bytes,
                                            req.length_bytes)
                    body = it.local_view if req.op is Op.WRITE else None
                    queue.popleft()
                    pending.append((it, rid))
                    send_all(sock, head, body, cfg.progress_timeout_s, it.deadline_s)
                if not pending:
                    break
                it, rid = pending[0]
                recv_exact_into(sock, hview, cfg.progress_timeout_s, it.deadline_s)
                resp = P.decode_response(hbuf)
                if resp.request_id != rid:
                    raise ProtocolError(f"answer to request {resp.request_id} while waiting for {rid}")
                if resp.status is not P.Status.OK:
                    reason = bytes(recv_exact(sock, resp.length, cfg.progress_timeout_s, it.deadline_s))
                    pending.popleft()
                    it.finish(Outcome.FAILED, f"peer refused ({resp.status.name}): "
                                              f"{reason.decode('utf-8', 'replace')}")
                    raise _Broken("the peer closes a connection after refusing a request")
                expect = it.request.length_bytes if it.request.op is Op.READ else 0
                if resp.length != expect:
                    raise ProtocolError(f"answer to request {rid} carries {resp.length} bytes, expected {expect}")
                if expect:
                    recv_exact_into(sock, it.local_view, cfg.progress_timeout_s, it.deadline_s)
                pending.popleft()
                conn.answered += 1
                it.finish(Outcome.COMPLETED, transferred_bytes=it.request.length_bytes)
        except socket.timeout:
            now = time.monotonic()
            for it, _ in pending:
                why = ("deadline passed" if it.deadline_s <= now
                       else f"no progress for {cfg.progress_timeout_s} s on the connection")
                it.finish(Outcome.TIMEOUT, f"{why} ({conn.address})")
            raise
        except (_Broken, ProtocolError, OSError) as e:
            reason = str(e) or type(e).__name__
            log.info("connection to %s broke with %d requests in flight: %s", conn.address, len(pending), reason)
            for it, _ in reversed(pending):
                if it.attempts < 1 and it.remaining_s() > 0 and not isinstance(e, ProtocolError):
                    it.attempts += 1
                    self.stats.retries += 1
                    queue.appendleft(it)
                else:
                    it.finish(Outcome.FAILED, f"connection to {conn.address} failed: {reason}")
            raise _Broken(reason) from None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pools = list(self._pools.values())
        for pool in pools:
            with pool.cond:
                for conn in pool.idle:
                    conn.sock.close()
                pool.open -= len(pool.idle)
                pool.idle.clear()
                pool.cond.notify_all()
