"""The serving half of the TCP backend: authenticated connections, range-checked one-sided READ/WRITE.

Invariants:
- A connection does nothing until its peer passes the HMAC challenge-response
  (``protocol`` module); a peer that fails it, or has not proved the secret within ``auth_timeout_s``,
  is closed and counted in ``stats.auth_failures``.
- Authentication runs on the accepting thread, without blocking (a selector over the listening socket
  and the connections still authenticating): an unauthenticated connection costs a descriptor and a
  few bytes, never a thread. Only an authenticated one gets a thread of its own.
- Two separate caps. At most ``max_server_connections`` AUTHENTICATED connections are held; while
  they are all taken a new connection is answered BUSY and closed at accept (and so is one that
  authenticates meanwhile). At most ``max_preauth_connections`` connections are AUTHENTICATING at
  once, on top of those; when that is full, a new connection takes the slot of the OLDEST
  authenticating one, which is answered BUSY and closed (``stats.preauth_evicted``). So peers without
  the secret can never take the slots of authenticated peers, and every new connection gets its
  challenge: a client whose proof arrives before the server has accepted ``max_preauth_connections``
  newer connections is served however many silent ones an attacker keeps opening (and the client
  tries again on BUSY).
  Each turn of the accepting thread reads every authenticating connection that has bytes waiting
  before it accepts at most half of ``max_preauth_connections`` new ones, so a proof that has arrived
  is checked before its connection can be dropped.
- Connections dropped before authenticating (failed, timed out, evicted, refused busy) are logged one
  by one only for the first ``DROP_LOG_BURST`` of each ``DROP_LOG_WINDOW_S``; the rest are counted and
  summed up in one line per window ("N unauthenticated connections dropped in the last X s"), and in
  ``stats.drop_logs_suppressed``. So the log grows by a bounded number of lines per window however
  fast connections are opened and dropped.
- Every READ/WRITE range is checked against the registered regions before a byte moves. A READ is
  answered with a status frame, then the bytes straight from the region (``sendmsg`` on a view);
  a WRITE's payload is received straight into the region (``recv_into``) and acknowledged only once
  all of it is there.
- A malformed, truncated, oversized or out-of-range frame, or a peer that stalls past
  ``progress_timeout_s`` mid-frame, ends THAT connection: the reason is logged (and sent back in a
  status frame where the stream still allows it), the region in-use counts are released, and the
  server goes on serving every other connection.
- One thread per authenticated connection; ``close`` shuts every connection (authenticating ones
  included) and joins every thread.
- With the compiled ``FastChannel`` (``TcpConfig.fast_path``), request headers, READ data and WRITE
  payloads move through it with the same waits and bounds; its outcomes become the exceptions of
  the plain ``Channel`` (``_fast_raise``), so every rule above holds on either path. The ACCEPT frame,
  control frames (LIST, PING) and refusals always go through ``Channel``.
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass

from quillcache.transfer import protocol as P
from quillcache.transfer.backends.sockets import Channel, TcpConfig, fast_channel, tune_socket
from quillcache.transfer.regions import RegionTable
from quillcache.transfer.types import AuthenticationError, ProtocolError, RegionError

__all__ = ["ServerStats", "TcpServer"]

log = logging.getLogger("quillcache.transfer.server")

LISTEN_BACKLOG = 1024  # connections the kernel queues for accept (it caps this at net.core.somaxconn)
ACCEPT_BURST = 64  # most connections accepted per turn (also at most half of max_preauth_connections)
ACCEPT_PAUSE_S = 0.05  # how long accepting stops after accept fails for want of descriptors or memory
DROP_LOG_BURST = 5  # dropped unauthenticated connections logged one by one per window ...
DROP_LOG_WINDOW_S = 10.0  # ... the rest summed up in one line per window of this length


@dataclass
class ServerStats:
    accepted: int = 0
    refused_busy: int = 0    # answered BUSY: every authenticated slot taken
    preauth_evicted: int = 0  # answered BUSY: the oldest authenticating connection, dropped for a newer one
    authenticated: int = 0
    auth_failures: int = 0   # a wrong, malformed or missing proof (also: none within auth_timeout_s)
    drop_logs_suppressed: int = 0  # dropped unauthenticated connections counted in a summary line, not logged
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


class _DropLog:
    """Rate-limited warnings for connections dropped before they authenticated (module docstring).

    Used by the accepting thread only. A window of ``window_s`` opens at the first drop after the previous
    window ended; its first ``burst`` drops are logged as they happen, the rest only counted, and when the
    window ends (``tick``) or the server closes (``flush``) one line sums up every drop of the window.
    """

    def __init__(self, stats: ServerStats, window_s: float, burst: int) -> None:
        self.stats, self.window_s, self.burst = stats, window_s, burst
        self.started_s = self.ends_s = -_INF  # the current window (monotonic); none open once it ended
        self.counts: dict[str, int] = {}
        self.logged = self.suppressed = 0

    def drop(self, kind: str, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now >= self.ends_s:
            self.flush(now)
            self.started_s, self.ends_s = now, now + self.window_s
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if self.logged < self.burst:
            self.logged += 1
            log.warning(fmt, *args)
        else:
            self.suppressed += 1
            self.stats.drop_logs_suppressed += 1

    def wait_s(self, now: float) -> float | None:
        """Seconds until a summary is due, or None when there is nothing to sum up."""
        return max(0.0, self.ends_s - now) if self.suppressed else None

    def tick(self, now: float) -> None:
        if self.suppressed and now >= self.ends_s:
            self.flush(now)

    def flush(self, now: float) -> None:
        """Log the summary of the window so far (if any drop went unlogged) and start afresh."""
        if self.suppressed:
            total = sum(self.counts.values())
            detail = ", ".join(f"{n} {kind}" for kind, n in sorted(self.counts.items()))
            log.warning("%d unauthenticated connections dropped in the last %.1f s (%s); %d of them not logged "
                        "one by one", total, min(now, self.ends_s) - self.started_s, detail, self.suppressed)
        self.counts.clear()
        self.logged = self.suppressed = 0
        self.ends_s = min(self.ends_s, now)


class _Pending:
    """A connection still authenticating: its challenge, the proof bytes so far, when it must be done."""

    __slots__ = ("sock", "peer", "nonce", "deadline_s", "proof", "got")

    def __init__(self, sock: socket.socket, peer: tuple, nonce: bytes, deadline_s: float) -> None:
        self.sock, self.peer, self.nonce, self.deadline_s = sock, peer, nonce, deadline_s
        self.proof = bytearray(P.PROOF.size)
        self.got = 0


_LISTENER, _WAKE = "listener", "wake"  # selector tags of the listening socket and the wake-up pipe
_NO_RESOURCES = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))


class TcpServer:
    def __init__(self, regions: RegionTable, secret: bytes, config: TcpConfig, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.regions, self.secret, self.config = regions, secret, config
        self.stats = ServerStats()
        self._lsock = socket.create_server((host, port), backlog=LISTEN_BACKLOG)
        try:
            self._lsock.setblocking(False)
            self.host, self.port = self._lsock.getsockname()[:2]
            self._conns: dict[socket.socket, threading.Thread] = {}  # authenticated, each with its thread
            self._fast: dict[socket.socket, object] = {}  # the FastChannel of each connection that has one
            self._pending: dict[socket.socket, _Pending] = {}  # authenticating, oldest first (accepting thread's)
            self._lock = threading.Lock()
            self._closing = False
            self._drops = _DropLog(self.stats, DROP_LOG_WINDOW_S, DROP_LOG_BURST)
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            self._sel = selectors.DefaultSelector()
            self._sel.register(self._lsock, selectors.EVENT_READ, _LISTENER)
            self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        except BaseException:
            self._lsock.close()
            raise
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"qc-transfer-accept:{self.port}",
                                          daemon=True)
        self._acceptor.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # ---- the accepting thread: accept, challenge, check proofs, hand authenticated connections to threads ----

    def _accept_loop(self) -> None:
        sel, pending = self._sel, self._pending
        burst = max(1, min(ACCEPT_BURST, self.config.max_preauth_connections // 2))
        paused_until: float | None = None
        try:
            while not self._closing:
                now = time.monotonic()
                if paused_until is not None and now >= paused_until:
                    sel.register(self._lsock, selectors.EVENT_READ, _LISTENER)
                    paused_until = None
                waits = [w for w in (pending[next(iter(pending))].deadline_s - now if pending else None,
                                     self._drops.wait_s(now), None if paused_until is None else paused_until - now)
                         if w is not None]
                events = sel.select(max(0.0, min(waits)) if waits else None)
                accept = False
                for key, _ in events:  # proofs first: one that has arrived is checked before any eviction
                    tag = key.data
                    if tag is _LISTENER:
                        accept = True
                    elif tag is _WAKE:
                        try:
                            self._wake_r.recv(64)
                        except OSError:
                            pass
                    else:
                        self._on_proof_bytes(tag)
                if self._closing:
                    break
                if accept and not self._accept_some(burst):
                    sel.unregister(self._lsock)  # out of descriptors or memory: stop accepting for a moment
                    paused_until = time.monotonic() + ACCEPT_PAUSE_S
                now = time.monotonic()
                while pending:  # oldest first, and all share auth_timeout_s: the expired ones lead
                    p = pending[next(iter(pending))]
                    if p.deadline_s > now:
                        break
                    self._fail(p, f"no proof within auth_timeout_s={self.config.auth_timeout_s:g} s "
                                  f"({p.got} of {P.PROOF.size} bytes came)")
                self._drops.tick(now)
        except Exception:
            log.exception("transfer server %s: the accepting thread failed; no new connections are accepted",
                          self.address)
        finally:
            for p in list(pending.values()):
                p.sock.close()
            pending.clear()
            sel.close()
            self._drops.flush(time.monotonic())

    def _accept_some(self, burst: int) -> bool:
        """Accept up to ``burst`` connections; False when accepting failed for want of descriptors or memory."""
        for _ in range(burst):
            try:
                sock, peer = self._lsock.accept()
            except BlockingIOError:
                return True
            except OSError as e:
                if e.errno in _NO_RESOURCES:
                    self._drops.drop("not accepted", "cannot accept connections for %g s: %s", ACCEPT_PAUSE_S, e)
                    return False
                continue  # that connection is gone already (ECONNABORTED and the like)
            self.stats.accepted += 1
            self._admit(sock, peer)
        return True

    def _admit(self, sock: socket.socket, peer: tuple) -> None:
        """Challenge a new connection, making room among the authenticating ones if they are all taken."""
        cfg, pending = self.config, self._pending
        try:
            sock.setblocking(False)
        except OSError:
            sock.close()
            return
        if len(self._conns) >= cfg.max_server_connections:
            self.stats.refused_busy += 1
            self._busy(sock, f"already serving {len(self._conns)} authenticated connections (max_server_connections)")
            self._drops.drop("refused busy", "refusing %s: already serving %d connections", peer, len(self._conns))
            return
        if len(pending) >= cfg.max_preauth_connections:
            oldest = self._forget(pending[next(iter(pending))])
            self.stats.preauth_evicted += 1
            self._busy(oldest.sock, f"{len(pending) + 1} connections are authenticating (max_preauth_connections); "
                                    "this one, the oldest, gave its slot to a newer one")
            self._drops.drop("evicted", "dropping unauthenticated %s: %d connections are authenticating "
                             "(max_preauth_connections), this one the oldest", oldest.peer, len(pending) + 1)
        nonce = P.new_nonce()
        hello = P.encode_hello(nonce)
        try:
            sent = sock.send(hello)  # a fresh connection's send buffer takes it whole
        except OSError as e:
            sent, why = -1, str(e) or type(e).__name__
        else:
            why = f"sent {sent} of {len(hello)} bytes of the challenge"
        if sent != len(hello):
            self.stats.auth_failures += 1
            self._drops.drop("failed authentication", "refused %s: authentication failed: %s", peer, why)
            sock.close()
            return
        p = _Pending(sock, peer, nonce, time.monotonic() + cfg.auth_timeout_s)
        self._sel.register(sock, selectors.EVENT_READ, p)
        pending[sock] = p

    def _forget(self, p: _Pending) -> _Pending:
        del self._pending[p.sock]
        self._sel.unregister(p.sock)
        return p

    def _fail(self, p: _Pending, why: object) -> None:
        self._forget(p)
        self.stats.auth_failures += 1
        self._drops.drop("failed authentication", "refused %s: authentication failed: %s", p.peer,
                         str(why) or type(why).__name__)
        p.sock.close()

    @staticmethod
    def _busy(sock: socket.socket, reason: str) -> None:
        """Answer an unauthenticated connection BUSY with ``reason`` (in place of HELLO or ACCEPT), then close it."""
        body = reason.encode("utf-8", "replace")[:P.MAX_REASON_BYTES]
        try:
            # Bytes of the peer's left unread at close turn the close into a reset, which may destroy the answer
            # before the peer reads it (a proof that came just now): take them first.
            for _ in range(4):
                if not sock.recv(1 << 16):
                    break
        except OSError:
            pass
        try:
            sock.send(P.encode_response(P.Status.BUSY, 0, len(body)) + body)
        except OSError:
            pass
        sock.close()

    def _on_proof_bytes(self, p: _Pending) -> None:
        try:
            k = p.sock.recv_into(memoryview(p.proof)[p.got:])  # never past the proof: the peer waits for ACCEPT
        except BlockingIOError:
            return
        except OSError as e:
            self._fail(p, e)
            return
        if not k:
            self._fail(p, f"peer closed the connection after {p.got} of {P.PROOF.size} bytes")
            return
        p.got += k
        if p.got < P.PROOF.size:
            return
        try:
            client_nonce = P.decode_proof(bytes(p.proof), self.secret, p.nonce)
        except (AuthenticationError, ProtocolError) as e:
            self._fail(p, e)
            return
        self._forget(p)
        accept = P.encode_accept(P.server_proof(self.secret, p.nonce, client_nonce))
        with self._lock:
            if self._closing:
                p.sock.close()
                return
            full = len(self._conns) >= self.config.max_server_connections
            if not full:
                self.stats.authenticated += 1
                t = threading.Thread(target=self._serve, args=(p.sock, p.peer, accept), daemon=True,
                                     name=f"qc-transfer-conn:{p.peer[1]}")
                self._conns[p.sock] = t
        if full:
            self.stats.refused_busy += 1
            self._busy(p.sock, f"already serving {len(self._conns)} authenticated connections "
                               "(max_server_connections)")
            self._drops.drop("refused busy", "refusing %s: already serving %d connections", p.peer, len(self._conns))
            return
        t.start()

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
                        or not 0 < length <= max_len):
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
            ch.send(P.encode_response(P.Status.OK, req.request_id, len(body)) + body)
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
            return len(self._conns) + len(self._pending)

    def preauth_connections(self) -> int:
        """Connections still authenticating (at most ``max_preauth_connections``)."""
        return len(self._pending)

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            conns = dict(self._conns)
        try:
            self._wake_w.send(b"x")  # the accepting thread closes the listening and authenticating sockets
        except OSError:
            pass
        self._acceptor.join(timeout=5)
        self._lsock.close()
        self._wake_r.close()
        self._wake_w.close()
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in conns.values():
            t.join(timeout=5)
