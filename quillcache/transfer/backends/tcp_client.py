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
  closed (its state is unknown) with a reset (``SO_LINGER`` 0, ``Channel.abort``), as is every
  connection given up after a failure: what we had not sent yet is discarded, not delivered.
- A WRITE that ended TIMEOUT or FAILED leaves the remote range undefined: the payload bytes the peer
  had already received are still written into the range when its serving thread gets to them, which
  may be after a later WRITE to that range (on another connection) was acknowledged; nothing orders
  the two until the peer has read or dropped the abandoned connection. Callers that must know verify
  the range (the pool verifies values by key); a server-side fence would close this window.
- With the compiled ``FastChannel`` (``TcpConfig.fast_path``), a request's bytes move through it and
  every outcome is turned into the exception the plain ``Channel`` raises for it (``_fast_failed``);
  an answer whose header is not the expected OK one goes through the same Python checks either way
  (``_checked``), so both paths give the same bytes, outcomes and reasons.
- A server that answers the handshake BUSY (its slots are full, or it dropped this connection, still
  authenticating, to make room for a newer one) is tried again on a fresh connection after a jittered
  backoff that doubles from ``BUSY_RETRY_FIRST_S`` up to ``BUSY_RETRY_MAX_S``, until the deadline of
  the requests that need the connection (then they end TIMEOUT naming the server's reason). Nothing
  was requested on a connection that was not accepted, so nothing is sent twice. (``retry_busy``, which
  the RDMA backend's control connections use too.)
- READ requests of a batch are sent in bursts: the window is refilled once half of it has been
  answered, with one send for all the new headers. A WRITE carries its payload (one send each) and
  is sent as soon as the window has room, so the peer always has payload to take -- unless the
  answers still owed ahead of it (READ data and answer headers) exceed a quarter of this
  connection's receive buffer (``_Conn.owed_max``): then those answers are received first. The
  server answers in order on one thread, so it takes a WRITE's payload only after it has sent
  every answer before it; answers that fit in our receive buffer never block it, while more would
  leave both sides blocked sending (a READ-then-WRITE deadlock until ``progress_timeout_s``).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import random
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from quillcache.transfer import protocol as P
from quillcache.transfer.backends.sockets import Channel, TcpConfig, fast_channel, tune_socket
from quillcache.transfer.batch import Item
from quillcache.transfer.types import (
    AuthenticationError,
    Op,
    Outcome,
    ProtocolError,
    RemoteRegion,
    TransferError,
    TransferTimeoutError,
)

__all__ = ["ClientStats", "TcpClient", "parse_address", "retry_busy"]

log = logging.getLogger("quillcache.transfer.client")
_TIMEOUT, _DEADLINE, _CLOSED, _MISMATCH = 1, 2, 3, 5  # FastChannel outcome codes (0: OK, 4: OSError)
_REQUEST_IDS = itertools.count(1)
BUSY_RETRY_FIRST_S = 0.002  # the first wait before connecting again to a server that answered BUSY ...
BUSY_RETRY_MAX_S = 0.1  # ... doubled per BUSY answer in a row up to this (each wait jittered down to half)
T = TypeVar("T")


def retry_busy(connect: Callable[[], T], busy: type[Exception], deadline: float, stats: Any,
               logger: logging.Logger) -> T:
    """``connect()``, tried again on a fresh connection while it raises ``busy`` (the server answered the
    handshake BUSY; nothing was requested yet): each time counted in ``stats.busy_retries`` and after a
    jittered backoff that doubles from ``BUSY_RETRY_FIRST_S`` up to ``BUSY_RETRY_MAX_S`` (logged at debug
    level on ``logger``); once the next wait would pass ``deadline``, or ``deadline`` passes during a try
    after a BUSY answer, ``socket.timeout`` naming the server's reason. Other exceptions of ``connect`` pass
    through."""
    wait_s, busy_answer = BUSY_RETRY_FIRST_S, None
    while True:
        try:
            return connect()
        except socket.timeout:
            if busy_answer is None or time.monotonic() < deadline:
                raise
            raise socket.timeout(f"{busy_answer} (tried again until the deadline)") from None
        except busy as e:
            busy_answer = e
            stats.busy_retries += 1
            pause_s = wait_s * random.uniform(0.5, 1.0)
            if deadline - time.monotonic() <= pause_s:
                raise socket.timeout(f"{e} (tried again until the deadline)") from None
            logger.debug("%s; connecting again in %.3f s", e, pause_s)
            time.sleep(pause_s)
            wait_s = min(wait_s * 2, BUSY_RETRY_MAX_S)


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` → ``(host, port)``; anything else raises ``ValueError`` naming the address."""
    if not isinstance(address, str):
        raise TypeError(f"a peer address must be a str 'host:port', got {type(address).__name__}")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"bad peer address {address!r}: expected 'host:port' with a port in 1..65535")
    return host.strip("[]"), int(port)


@dataclass
class ClientStats:
    connects: int = 0
    reconnects: int = 0
    stale_dropped: int = 0
    retries: int = 0
    busy_retries: int = 0  # connections the server answered BUSY during the handshake, tried again


_RESPONSE_FIELDS = P.RESPONSE.size - P.PADDING_BYTES[P.RESPONSE]  # the padding after them must be zero
_RESPONSE_PADDING = bytes(P.PADDING_BYTES[P.RESPONSE])


class _Conn:
    """One authenticated connection. ``owed_max``: the most answer bytes that may be owed to us when a WRITE's
    payload is sent: a quarter of this socket's receive buffer as the kernel reports it, well within what
    its receive window admits while we are not reading, whatever the server's own buffers (module docstring)."""

    __slots__ = ("ch", "address", "last_used_s", "hbuf", "hview", "fast", "owed_max")

    def __init__(self, ch: Channel, address: str, fast: object = None) -> None:
        self.ch, self.address, self.fast = ch, address, fast
        self.hbuf = bytearray(P.RESPONSE.size)
        self.hview = memoryview(self.hbuf)
        self.last_used_s = time.monotonic()
        self.owed_max = ch.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 4


class _Pool:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.idle: list[_Conn] = []
        self.open = 0
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)  # waited on only when every connection is busy
        self.waiting = 0
        self.ever_connected = False


class _Refusal(Exception):
    """The peer answered a request with a non-OK status (and closes the connection)."""


class _Unsendable(Exception):
    """A request whose fields do not fit the wire header; it fails alone, nothing is sent."""


class _Busy(Exception):
    """The server answered the handshake BUSY: no slot for this connection now; try a fresh one later."""


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
        pool = self._pools.get(address)
        if pool is not None and not self._closed:
            return pool
        with self._lock:
            if self._closed:
                raise TransferError("the transfer engine is closed")
            pool = self._pools.get(address)
            if pool is None:
                pool = self._pools[address] = _Pool(self.config.connections_per_peer)
            return pool

    def _connect(self, address: str, deadline: float) -> _Conn:
        """A fresh authenticated connection; a BUSY server is tried again with backoff until ``deadline``
        (then ``socket.timeout`` naming its reason)."""
        return retry_busy(lambda: self._connect_once(address, deadline), _Busy, deadline, self.stats, log)

    @staticmethod
    def _handshake_frame(ch: Channel, kind: str, fmt: struct.Struct, magic: bytes, deadline: float,
                         address: str) -> bytes:
        """The server's next handshake frame (``protocol.read_handshake_frame`` on this channel: another
        protocol version or an OK in its place is a ``ProtocolError``). A refusal in its place: BUSY raises
        ``_Busy``, any other status ``TransferError``, each with the server's reason."""
        try:
            return P.read_handshake_frame(lambda n: ch.recv(n, deadline), kind, fmt, magic, address)
        except P.HandshakeRefused as r:
            if r.status is P.Status.BUSY:
                raise _Busy(f"{address} is busy: {r.reason}") from None
            raise TransferError(f"{address} refused the connection ({r.status.name}): {r.reason}") from None

    def _connect_once(self, address: str, deadline: float) -> _Conn:
        cfg = self.config
        host, port = parse_address(address)
        timeout = max(0.001, min(cfg.connect_timeout_s, deadline - time.monotonic()))
        sock = socket.create_connection((host, port), timeout=timeout)  # non-blocking connect with a timeout
        try:
            tune_socket(sock, cfg)
            ch = Channel(sock, cfg.progress_timeout_s, cfg.spin_us)
            hs_deadline = min(deadline, time.monotonic() + cfg.auth_timeout_s + cfg.connect_timeout_s)
            hello = self._handshake_frame(ch, "hello", P.HELLO, P.HELLO_MAGIC, hs_deadline, address)
            server_nonce = P.decode_hello(hello)
            client_nonce = P.new_nonce()
            ch.send(P.encode_proof(client_nonce, P.client_proof(self.secret, server_nonce, client_nonce)), None,
                    hs_deadline)
            try:
                frame = self._handshake_frame(ch, "accept", P.ACCEPT, P.ACCEPT_MAGIC, hs_deadline, address)
            except ConnectionError:
                raise AuthenticationError(f"{address} closed the connection during authentication "
                                          "(wrong shared secret?)") from None
            P.decode_accept(frame, self.secret, server_nonce, client_nonce)
        except BaseException:
            sock.close()
            raise
        self.stats.connects += 1
        return _Conn(ch, address, fast_channel(ch, cfg))

    def _checkout(self, address: str, deadline: float) -> _Conn:
        pool = self._pool(address)
        with pool.lock:
            while True:
                while pool.idle:
                    conn = pool.idle.pop()
                    if time.monotonic() - conn.last_used_s < self.config.idle_check_s or conn.ch.alive():
                        return conn
                    self.stats.stale_dropped += 1
                    log.info("dropping a pooled connection to %s that the peer closed", address)
                    conn.ch.close()
                    pool.open -= 1
                if pool.open < pool.limit:
                    pool.open += 1
                    reconnect = pool.ever_connected
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout(f"no free connection to {address} before the deadline")
                pool.waiting += 1
                try:
                    pool.cond.wait(left)
                finally:
                    pool.waiting -= 1
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
        """Pool ``conn`` again, or close it; one that is not ``healthy`` (a request on it timed out or failed,
        its state is unknown) is closed with a reset, so its unsent WRITE payload is dropped, not delivered."""
        pool = self._pool(conn.address) if not self._closed else self._pools.get(conn.address)
        if pool is None:
            conn.ch.close() if healthy else conn.ch.abort()
            return
        with pool.lock:
            if healthy and not self._closed:
                conn.last_used_s = time.monotonic()
                pool.idle.append(conn)
            else:
                conn.ch.close() if healthy else conn.ch.abort()
                pool.open -= 1
                for idle in pool.idle:  # a broken one often means a peer restart: probe the rest before reuse
                    idle.last_used_s = -math.inf
            if pool.waiting:
                pool.cond.notify()

    # ---- requests ---------------------------------------------------------------------------------------------

    def list_regions(self, address: str, timeout_s: float) -> tuple[RemoteRegion, ...]:
        """The peer's regions (LIST). Like a transfer, a LIST sent on a connection that then broke (a pooled
        one the peer closed: a restart) is tried once more on a fresh connection."""
        deadline = time.monotonic() + timeout_s
        try:
            return self._list_once(address, deadline)
        except socket.timeout:
            raise
        except OSError:
            if deadline <= time.monotonic():
                raise
            self.stats.retries += 1
        return self._list_once(address, deadline)

    def _list_once(self, address: str, deadline: float) -> tuple[RemoteRegion, ...]:
        conn = self._checkout(address, deadline)
        ok = False
        try:
            rid = next(_REQUEST_IDS)
            conn.ch.send(P.encode_request(P.Opcode.LIST, rid, 0, 0, 0), None, deadline)
            resp = P.decode_response(bytes(conn.ch.recv(P.RESPONSE.size, deadline)))
            if resp.request_id != rid:
                raise ProtocolError(f"answer to request {resp.request_id} while waiting for {rid}")
            if resp.length > P.MAX_LIST_BYTES:
                raise ProtocolError(f"region list of {resp.length} bytes exceeds {P.MAX_LIST_BYTES}")
            if resp.status is not P.Status.OK:  # a refusal's reason is not padded (the connection closes)
                body = bytes(conn.ch.recv(resp.length, deadline))
                raise TransferError(f"{address} refused the region list: {body.decode('utf-8', 'replace')}")
            # the body, then its padding to the next 64-byte stream offset (protocol.py: alignment)
            pad = P.padding_bytes(resp.length)
            body = bytes(conn.ch.recv(resp.length + pad, deadline))
            if any(body[resp.length:]):
                raise ProtocolError(f"region list padding (the {pad} bytes after its {resp.length}-byte body) "
                                    "must be zero")
            regions = P.decode_regions(body[:resp.length])
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

    @staticmethod
    def _head(op: Op, rid: int, region: int, offset: int, length: int) -> bytes:
        """The packed request header; fields that do not fit raise ``_Unsendable`` (the request fails alone)."""
        try:
            return P.REQUEST.pack(P.REQUEST_MAGIC, P.PROTOCOL_VERSION, int(op), 0, rid, region, 0, offset, length)
        except struct.error as e:
            raise _Unsendable(f"request fields do not fit the header: {e}") from None

    @staticmethod
    def _answer(conn: _Conn, rid: int, view: memoryview, is_read: bool, length: int, deadline: float) -> None:
        """Read the answer to request ``rid`` (for a READ, its data straight into ``view``). A refusal raises
        ``_Refusal`` with the peer's reason (it may have landed in ``view``: a failed READ's bytes are undefined);
        an answer out of step raises ``ProtocolError``."""
        ch = conn.ch
        if is_read:
            got = ch.recv_two(conn.hview, view, deadline)
        else:
            got = 0
            ch.recv_into(conn.hview, deadline)
        TcpClient._checked(conn, rid, view, is_read, length, got, deadline)

    @staticmethod
    def _checked(conn: _Conn, rid: int, view: memoryview, is_read: bool, length: int, got: int,
                 deadline: float) -> None:
        """Check the answer header in ``conn.hbuf`` (``got`` bytes of ``view`` already filled after it) and
        receive the rest of a READ's data; raises as ``_answer`` says."""
        ch, hbuf = conn.ch, conn.hbuf
        magic, ver, status, reserved, resp_id, resp_len = P.RESPONSE.unpack(hbuf)  # (unpack skips the padding)
        if (magic != P.RESPONSE_MAGIC or ver != P.PROTOCOL_VERSION or reserved or status
                or hbuf[_RESPONSE_FIELDS:] != _RESPONSE_PADDING):
            resp = P.decode_response(hbuf)  # ProtocolError naming a bad field, or a refusal with its reason
            reason = bytes(view[:min(got, resp.length)]) if got else b""
            if len(reason) < resp.length:
                reason += bytes(ch.recv(resp.length - len(reason), deadline))
            raise _Refusal(f"peer refused ({resp.status.name}): {reason.decode('utf-8', 'replace')}")
        expect = length if is_read else 0
        if resp_id != rid or resp_len != expect:
            raise ProtocolError(f"answer to request {resp_id} with {resp_len} bytes while waiting for {rid} "
                                f"with {expect}")
        if got < expect:
            ch.recv_into(view[got:], deadline)

    def transfer_one(self, address: str, op: Op, view: memoryview, region: int, offset: int, length: int,
                     deadline: float) -> None:
        """One synchronous request on the calling thread, with no batch bookkeeping (the engine's ``read``
        and ``write``). Same protocol, checks, retry and deadline rules as ``execute``; raises
        ``TransferTimeoutError`` or ``TransferError`` with the reason instead of reporting an outcome."""
        is_read = op is Op.READ
        for attempt in (0, 1):
            try:
                conn = self._checkout(address, deadline)
            except socket.timeout as e:
                raise TransferTimeoutError(f"could not reach {address} before the deadline: {e}") from None
            except OSError as e:
                raise TransferError(f"cannot connect to {address}: {e}") from None
            ok = False
            try:
                rid = next(_REQUEST_IDS)
                fast = conn.fast
                if fast is not None:
                    if is_read:
                        code = fast.round_trip(self._head(op, rid, region, offset, length), None, conn.hbuf, view,
                                               rid, deadline)
                    else:
                        code = fast.round_trip(self._head(op, rid, region, offset, length), view, conn.hbuf, None,
                                               rid, deadline)
                    if code:
                        self._fast_failed(conn, code, rid, view, is_read, length, deadline)
                else:
                    conn.ch.send(self._head(op, rid, region, offset, length), None if is_read else view, deadline)
                    self._answer(conn, rid, view, is_read, length, deadline)
                ok = True
                return
            except socket.timeout:
                why = "deadline passed" if deadline <= time.monotonic() else \
                    f"no progress for {self.config.progress_timeout_s} s on the connection"
                raise TransferTimeoutError(f"{op.name} of {length} bytes timed out: {why} ({address})") from None
            except (_Refusal, _Unsendable) as e:
                raise TransferError(str(e)) from None
            except ProtocolError as e:
                raise TransferError(f"connection to {address} failed: {e}") from None
            except OSError as e:
                if attempt == 0 and deadline > time.monotonic():
                    self.stats.retries += 1
                    continue  # a connection that broke under us: once more on a fresh one
                raise TransferError(f"connection to {address} failed: {e or type(e).__name__}") from None
            finally:
                self._checkin(conn, ok)

    @staticmethod
    def _send(conn: _Conn, head: bytes, body: memoryview | None, deadline: float) -> None:
        """``head`` then ``body`` on ``conn`` (the compiled path where there is one)."""
        fast = conn.fast
        if fast is None:
            conn.ch.send(head, body, deadline)
            return
        code = fast.send(head, body, deadline)
        if code:
            TcpClient._fast_failed(conn, code, 0, memoryview(b""), False, 0, deadline)

    @staticmethod
    def _fast_failed(conn: _Conn, code: int, rid: int, view: memoryview, is_read: bool, length: int,
                     deadline: float) -> None:
        """Raise what the plain ``Channel`` raises for a ``FastChannel`` outcome ``code``; for a ``MISMATCH``
        run the Python checks of the answer header (which raise, naming the fault or the peer's reason)."""
        fast = conn.fast
        if code == _MISMATCH:
            TcpClient._checked(conn, rid, view, is_read, length, max(0, fast.got - P.RESPONSE.size), deadline)
            return
        if code == _DEADLINE:
            raise socket.timeout("deadline passed")
        if code == _TIMEOUT:
            raise socket.timeout("no progress sending" if fast.phase == 0 else f"no progress after {fast.got} bytes")
        if code == _CLOSED:
            raise ConnectionError(f"peer closed the connection after {fast.got} bytes of the answer")
        err = fast.errno
        raise OSError(err, os.strerror(err))

    def _pipeline(self, conn: _Conn, queue: deque[Item]) -> None:
        """Run ``queue`` on ``conn``; on a broken connection, requeue (or fail) what was in flight and return.
        A WRITE's payload is sent only while at most ``conn.owed_max`` answer bytes are owed ahead of it (else
        the answers are received first: no READ-then-WRITE deadlock; module docstring)."""
        cfg = self.config
        fast, hbuf = conn.fast, conn.hbuf
        window = cfg.window
        refill_at = window // 2  # refill once half the window is answered: one send for many READ headers
        pending: deque[tuple[Item, int]] = deque()
        READ, COMPLETED = Op.READ, Outcome.COMPLETED
        monotonic = time.monotonic
        hsize, owed, owed_max = P.RESPONSE.size, 0, conn.owed_max  # answer bytes the server still has to send
        try:
            while queue or pending:
                if queue and (len(pending) <= refill_at or (len(pending) < window and queue[0].request.op is not READ)):
                    heads: list[bytes] = []  # READ headers not sent yet
                    deadline = math.inf
                    while queue and len(pending) < window:
                        it = queue[0]
                        if it.deadline_s <= monotonic():
                            queue.popleft().finish(Outcome.TIMEOUT, "deadline passed before the request was sent")
                            continue
                        req = it.request
                        if owed > owed_max and req.op is not READ:
                            break  # receive answers first: the server takes this payload only after sending them
                        rid = next(_REQUEST_IDS)
                        try:
                            head = self._head(req.op, rid, req.remote_region, req.remote_offset_bytes,
                                              req.length_bytes)
                        except _Unsendable as e:
                            queue.popleft().finish(Outcome.FAILED, str(e))
                            continue
                        queue.popleft()
                        pending.append((it, rid))
                        if it.deadline_s < deadline:
                            deadline = it.deadline_s
                        if req.op is READ:
                            owed += hsize + req.length_bytes
                            heads.append(head)
                            continue
                        owed += hsize
                        if heads:  # keep the order: the READ headers before this WRITE go first
                            self._send(conn, b"".join(heads), None, deadline)
                            heads = []
                        self._send(conn, head, it.local_view, deadline)
                    if heads:
                        self._send(conn, heads[0] if len(heads) == 1 else b"".join(heads), None, deadline)
                if not pending:
                    break
                it, rid = pending[0]
                req = it.request
                is_read = req.op is READ
                try:
                    if fast is not None:
                        code = fast.answer(hbuf, it.local_view if is_read else None, rid, it.deadline_s)
                        if code:
                            self._fast_failed(conn, code, rid, it.local_view, is_read, req.length_bytes,
                                              it.deadline_s)
                    else:
                        self._answer(conn, rid, it.local_view, is_read, req.length_bytes, it.deadline_s)
                except _Refusal as e:
                    pending.popleft()
                    it.finish(Outcome.FAILED, str(e))
                    raise _Broken("the peer closes a connection after refusing a request") from None
                pending.popleft()
                owed -= hsize + req.length_bytes if is_read else hsize
                it.batch.finish(it.index, COMPLETED, "", req.length_bytes)
        except socket.timeout:
            now = monotonic()
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
                    conn.ch.close()
                pool.open -= len(pool.idle)
                pool.idle.clear()
                pool.cond.notify_all()
