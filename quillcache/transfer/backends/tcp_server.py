"""The serving half of the TCP backend: authenticated connections, range-checked one-sided READ/WRITE.

Invariants:
- Connections are accepted and authenticated by ``acceptor.PreauthAcceptor`` (its docstring states the
  rules: the HMAC challenge-response on the accepting thread without a thread per connection, the two
  caps ``max_server_connections`` and ``max_preauth_connections`` with BUSY answers and oldest-eviction,
  ``auth_timeout_s``, the rate-limited log of dropped connections). It counts in ``stats``
  (``accepted``, ``refused_busy``, ``preauth_evicted``, ``authenticated``, ``auth_failures``,
  ``drop_logs_suppressed``) and logs on this module's logger. It records each connection that proved
  the secret in ``_conns`` (under ``_lock``) with a thread of its own, ``qc-transfer-conn:PEER_PORT``,
  which runs ``_serve``: it sends ACCEPT, serves the connection, and removes it from ``_conns`` when it
  ends.
- Every READ/WRITE range is checked against the registered regions before a byte moves. A READ is
  answered with a status frame, then the bytes straight from the region (``sendmsg`` on a view);
  a WRITE's payload is received straight into the region (``recv_into``) and acknowledged only once
  all of it is there.
- A malformed, truncated, oversized or out-of-range frame, or a peer that stalls past
  ``progress_timeout_s`` mid-frame, ends THAT connection: the reason is logged (and sent back in a
  status frame where the stream still allows it), the region in-use counts are released, and the
  server goes on serving every other connection.
- One thread per authenticated connection; ``close`` closes the acceptor (its authenticating connections
  too), then shuts every authenticated connection and joins every thread.
- With the compiled ``FastChannel`` (``TcpConfig.fast_path``), request headers, READ data and WRITE
  payloads move through it with the same waits and bounds; its outcomes become the exceptions of
  the plain ``Channel`` (``_fast_raise``), so every rule above holds on either path. The ACCEPT frame,
  control frames (LIST, PING) and refusals always go through ``Channel``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

from quillcache.transfer import protocol as P
from quillcache.transfer.backends.acceptor import AcceptorStats, PreauthAcceptor
from quillcache.transfer.backends.sockets import Channel, TcpConfig, fast_channel, tune_socket
from quillcache.transfer.regions import RegionTable
from quillcache.transfer.types import ProtocolError, RegionError

__all__ = ["ServerStats", "TcpServer"]

log = logging.getLogger("quillcache.transfer.server")


@dataclass
class ServerStats(AcceptorStats):
    """The acceptor's counters (``accepted`` ... ``drop_logs_suppressed``), then those of the serving threads."""

    protocol_errors: int = 0
    range_errors: int = 0
    timeouts: int = 0
    bytes_read: int = 0      # served to READ requests
    bytes_written: int = 0   # received by WRITE requests
    requests: int = 0


class _Refused(Exception):
    """A request the server answers with a non-OK status, then closes the connection."""

    def __init__(self, status: P.Status, reason: str, request_id: int = 0) -> None:
        super().__init__(reason)
        self.status, self.request_id = status, request_id


_TIMEOUT, _DEADLINE, _CLOSED = 1, 2, 3  # FastChannel outcome codes (0: OK, 4: OSError)
_INF = float("inf")



def _fast_raise(fast, code: int, n: int, idle_s: float | None = None) -> None:
    """Raise what the plain ``Channel`` raises for the ``FastChannel`` outcome ``code`` of a frame of ``n`` bytes."""
    if code == _TIMEOUT or code == _DEADLINE:
        if idle_s is not None and not fast.got:
            raise socket.timeout(f"idle for {idle_s} s")
        raise socket.timeout("no progress sending" if fast.phase == 0 else f"no progress after {fast.got} of {n} bytes")
    if code == _CLOSED:
        raise ConnectionError(f"peer closed the connection after {fast.got} of {n} bytes")
    raise OSError(fast.errno, os.strerror(fast.errno))


_REGION_STATUS = {"no_region": P.Status.NO_REGION, "out_of_range": P.Status.OUT_OF_RANGE,
                  "read_only": P.Status.READ_ONLY}


class TcpServer:
    def __init__(self, regions: RegionTable, secret: bytes, config: TcpConfig, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.regions, self.secret, self.config = regions, secret, config
        self.stats = ServerStats()
        self._conns: dict[socket.socket, threading.Thread] = {}  # authenticated, each with its thread (_lock)
        self._fast: dict[socket.socket, object] = {}  # the FastChannel of each connection that has one (_lock)
        self._lock = threading.Lock()
        self._closing = False
        self._acceptor = PreauthAcceptor(host, port, secret, config, self.stats, lock=self._lock, conns=self._conns,
                                         serve=self._serve, log=log)
        self.host, self.port = self._acceptor.host, self._acceptor.port
        self._acceptor.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # ---- one thread per authenticated connection --------------------------------------------------------------

    def _serve(self, sock: socket.socket, peer: tuple, accept: bytes) -> None:
        cfg = self.config
        try:
            tune_socket(sock, cfg)
            ch = Channel(sock, cfg.progress_timeout_s, cfg.spin_us)  # blocking from here on
            ch.send(accept, None, time.monotonic() + cfg.auth_timeout_s)
            hbuf = bytearray(P.REQUEST.size)
            hview = memoryview(hbuf)
            unpack, max_len = P.REQUEST.unpack, cfg.max_request_bytes
            fast, idle_s, hsize = fast_channel(ch, cfg), cfg.server_idle_timeout_s, P.REQUEST.size
            fields, padding = hsize - P.PADDING_BYTES[P.REQUEST], bytes(P.PADDING_BYTES[P.REQUEST])
            if fast is not None:
                with self._lock:
                    self._fast[sock] = fast
            while True:
                if fast is not None:
                    code = fast.recv_into(hbuf, _INF, idle_s)
                    if code:
                        _fast_raise(fast, code, hsize, idle_s)
                else:
                    ch.recv_idle_into(hview, idle_s)
                magic, version, opcode, flags, rid, region, reserved, offset, length = unpack(hbuf)
                if (magic != P.REQUEST_MAGIC or version != P.PROTOCOL_VERSION or flags or reserved or opcode > 1
                        or not 0 < length <= max_len or hbuf[fields:] != padding):  # (unpack skips the padding)
                    req = P.decode_request(hbuf, max_len)  # raises ProtocolError naming the fault, or a LIST/PING
                    self.stats.requests += 1
                    self._control(ch, req)
                    continue
                self.stats.requests += 1
                if opcode == 0:
                    self._read(ch, rid, region, offset, length)
                else:
                    self._write(ch, rid, region, offset, length)
        except _Refused as e:
            self.stats.range_errors += 1
            log.warning("closing %s: %s", peer, e)
            self._try_refuse(sock, e.status, e.request_id, str(e))
        except ProtocolError as e:
            self.stats.protocol_errors += 1
            log.warning("closing %s: protocol error: %s", peer, e)
            self._try_refuse(sock, P.Status.BAD_FRAME, 0, str(e))
        except socket.timeout as e:
            self.stats.timeouts += 1
            log.warning("closing %s: timed out (%s; progress timeout %.3g s)", peer, e, cfg.progress_timeout_s)
        except ConnectionError as e:
            log.debug("connection from %s ended: %s", peer, e)
        except OSError as e:
            if not self._closing:
                log.debug("connection from %s failed: %s", peer, e)
        finally:
            try:
                sock.close()
            finally:
                with self._lock:
                    self._conns.pop(sock, None)
                    self._fast.pop(sock, None)

    def _try_refuse(self, sock: socket.socket, status: P.Status, request_id: int, reason: str) -> None:
        body = reason.encode("utf-8", "replace")[:P.MAX_REASON_BYTES]
        try:
            Channel(sock, 1.0).send(P.encode_response(status, request_id, len(body)) + body)
            # A lingering close: closing with the peer's bytes unread (a WRITE's payload, pipelined requests)
            # resets the connection, which destroys the answers and the reason the peer has yet to read. So
            # stop sending, then discard what still comes until the peer closes, for a second at most.
            sock.shutdown(socket.SHUT_WR)
            scratch, deadline = bytearray(1 << 16), time.monotonic() + 1.0
            while time.monotonic() < deadline and sock.recv_into(scratch):
                pass
        except OSError:
            pass

    def _checkout(self, rid: int, region: int, offset: int, length: int, write: bool) -> memoryview:
        try:
            return self.regions.checkout(region, offset, length, write=write)
        except RegionError as e:
            raise _Refused(_REGION_STATUS.get(e.code, P.Status.NO_REGION), f"request {rid}: {e}", rid) from None

    def _read(self, ch: Channel, rid: int, region: int, offset: int, length: int) -> None:
        view = self._checkout(rid, region, offset, length, False)
        try:
            fast = ch.fast
            if fast is None:
                ch.send(P.RESPONSE.pack(P.RESPONSE_MAGIC, P.PROTOCOL_VERSION, 0, 0, rid, length), view)
            else:
                code = fast.send(P.RESPONSE.pack(P.RESPONSE_MAGIC, P.PROTOCOL_VERSION, 0, 0, rid, length), view)
                if code:
                    _fast_raise(fast, code, P.RESPONSE.size + length)
        finally:
            view.release()
            self.regions.release(region)
        self.stats.bytes_read += length

    def _write(self, ch: Channel, rid: int, region: int, offset: int, length: int) -> None:
        view = self._checkout(rid, region, offset, length, True)
        fast = ch.fast
        try:
            if fast is None:
                ch.recv_into(view)
            else:
                code = fast.recv_into(view)
                if code:
                    _fast_raise(fast, code, length)
        finally:
            view.release()
            self.regions.release(region)
        self.stats.bytes_written += length
        if fast is None:
            ch.send(P.RESPONSE.pack(P.RESPONSE_MAGIC, P.PROTOCOL_VERSION, 0, 0, rid, 0))
        else:
            code = fast.send(P.RESPONSE.pack(P.RESPONSE_MAGIC, P.PROTOCOL_VERSION, 0, 0, rid, 0))
            if code:
                _fast_raise(fast, code, P.RESPONSE.size)

    def _control(self, ch: Channel, req: P.RequestHeader) -> None:
        if req.opcode is P.Opcode.LIST:
            body = P.encode_regions(self.regions.describe())
            ch.send(P.encode_response(P.Status.OK, req.request_id, len(body)) + body
                    + bytes(P.padding_bytes(len(body))))  # payloads after it stay on 64-byte offsets
        elif req.opcode is P.Opcode.PING:
            ch.send(P.encode_response(P.Status.OK, req.request_id, 0))
        elif req.opcode is P.Opcode.READ:
            self._read(ch, req.request_id, req.region_id, req.offset, req.length)
        else:
            self._write(ch, req.request_id, req.region_id, req.offset, req.length)

    def wait_counters(self) -> dict[str, int]:
        """The receive-wait counters (``FastChannel.counters``) summed over the open connections."""
        with self._lock:
            fasts = list(self._fast.values())
        out: dict[str, int] = {}
        for f in fasts:
            for k, v in f.counters().items():
                out[k] = out.get(k, 0) + v
        return out

    def connections(self) -> int:
        """Connections held: authenticated ones plus those still authenticating."""
        with self._lock:
            return len(self._conns) + self._acceptor.authenticating()

    def preauth_connections(self) -> int:
        """Connections still authenticating (at most ``max_preauth_connections``)."""
        return self._acceptor.authenticating()

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._acceptor.close()  # no connection is handed over from here on: _conns is complete
        with self._lock:
            conns = dict(self._conns)
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in conns.values():
            if t.ident is not None:  # started (one whose start failed is not in the table; never join it)
                t.join(timeout=5)
