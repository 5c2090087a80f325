"""The plain-TCP transport: length-prefixed frames on one TCP connection, beside the ZeroMQ one.

Why: a ZeroMQ round trip passes through libzmq's I/O thread on both sides (four thread hand-offs per call);
here the client's thread writes to and reads from its own socket and the server's connection thread reads,
calls and writes, so a single-key round trip costs two ``send``/``recv`` pairs and nothing else.

Contract:
- Addresses are ``qtcp://HOST:PORT`` (:data:`SCHEME`); :class:`~quillcache.rpc.RpcClient` speaks this transport
  for such an address and ZeroMQ for ``tcp://`` (and bare ``host:port``).
- Framing: each request and each reply is ``u32 big-endian length`` + that many bytes of the codec's request /
  reply frame (:mod:`quillcache.rpc.wire`), exactly what the ZeroMQ transport carries as one message. A
  connection carries requests in order and gets the replies in the same order (a client may pipeline).
- ``StreamServer(target, methods, host, port)`` has ``RpcServer``'s contract (whitelist, typed refusals, one
  reply per request, nothing a peer sends stops serving): one accept thread and one thread per connection that
  reads a frame, calls the method and writes the reply itself (no hand-off to another thread). Calls reach
  ``target`` one at a time (a server-wide lock), in arrival order per connection.
- Limits: at most ``max_connections`` connections are served at once (one thread each); a connection past that gets
  one ``TOO_MANY_CONNECTIONS`` refusal and is closed at accept (``num_turned_away``; the first of each
  ``_TURN_AWAY_LOG_S`` window logged, the rest summed up in one line: ``quillcache._ratelog``). A frame past
  ``max_frame_bytes`` (up to ``drop_frame_bytes``) is read, discarded and answered ``FRAME_TOO_LARGE``; a length
  past ``drop_frame_bytes`` is answered ``FRAME_TOO_LARGE`` and the connection is closed (its bytes are never
  buffered: the server stops sending, then reads and discards the rest of the frame for at most
  ``min(idle_timeout_s, _DROP_DRAIN_S)``, so no reset overtakes the refusal; a client whose send fails still takes a
  reply that arrived whole); a malformed body (the length prefix intact) gets its typed refusal and the connection
  goes on. Decoding is bounded by the dispatcher (:mod:`quillcache.rpc.dispatch`): a frame of at least
  ``codec.BUDGET_FRAME_BYTES`` decodes under the request limits, and at most ``max_large_decodes`` such frames are
  decoded or held at once, whatever the number of connections; a connection lets go of its frame once the reply is
  made. Frames still being read are buffered by their connections: up to ``max_connections`` of them, each within
  ``max_frame_bytes``.
- A failed accept (out of file descriptors, ``EMFILE``/``ENFILE``; out of memory; a peer gone before accept) or a
  connection thread that cannot be started (the connection is then closed, its slot freed) never ends the accept
  thread: it is counted (``num_accept_errors``), logged as turned-away connections are, and the thread
  pauses ``_ACCEPT_RETRY_S`` (``close()`` cuts the pause short) before accepting again; only ``close()`` ends it.
- Idle timeout (``idle_timeout_s``, default :data:`DEFAULT_IDLE_TIMEOUT_S`): a connection that sends no byte of a
  request for ``idle_timeout_s``, that does not complete a request within ``idle_timeout_s`` of its first byte
  (stalled or trickling mid-frame), or that reads none of its reply for ``idle_timeout_s``, is closed
  (``num_timed_out``), so a connection slot is never held longer than that by a peer that does nothing. Before
  closing for want of a request the server sends one ``IDLE_TIMEOUT`` refusal with no request id (a goodbye) and
  never reads what arrives after it: a request that crossed the goodbye on the way was not run.
- Goodbyes (``IDLE_TIMEOUT``, ``TOO_MANY_CONNECTIONS``) are replies with request id None, sent only when the
  server closes the connection without reading further; a client sees one as the reply to the request it sent
  (which did not run) or, between calls, as bytes waiting on an idle connection.
- Polling before sleeping (``spin_s``, both sides, default :data:`DEFAULT_SPIN_S`): a connection's server thread
  polls its socket without blocking for up to ``spin_s`` for the next request, and a client for up to ``spin_s``
  for its reply, before sleeping in ``recv``. On a virtual machine most of a loopback round trip is the wake-up of
  a sleeping thread; polling a little first removes it when the peer answers within the window. Adaptive: a window
  that passed in vain turns polling off for the next ``frames.SPIN_BACKOFF`` waits (a peer that is slow, idle,
  or shares this core), so an idle connection costs at most ``spin_s`` of CPU per 16 requests. ``spin_s=0``
  never polls; the results are the same either way (only the speed differs).
- ``after_reply`` (optional): called by a connection's thread after each reply is written, outside the call
  lock (e.g. work the target deferred until its caller has the answer); an exception there is logged.
- ``close()`` stops accepting, shuts every connection down, joins the threads (idempotent); the port can be bound
  again at once (``SO_REUSEADDR``).
- :class:`StreamConnection` is the client side: one blocking socket (``TCP_NODELAY``), connected lazily; on a
  connection refused it keeps trying until the call's deadline (a restarting server is reached as ZeroMQ's
  reconnect would), or with ``reconnect=False`` gives up at once; a connection that could not be made raises
  ``RpcTimeoutError`` with ``sent = False`` (the request never left); a connection the server closed between
  calls, or on which it left a goodbye, is noticed before sending (a non-blocking peek) and replaced, nothing
  sent; a lost connection or no reply in time closes the socket and raises ``RpcTimeoutError`` (the request may
  or may not have run). ``RpcClient`` sends a request again, once, on a fresh connection when the reply is an
  ``IDLE_TIMEOUT`` goodbye (the server closed the idle connection as the request crossed it).
- Frames, their reader and the hang-up without a reset are :mod:`quillcache.rpc.frames`.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections.abc import Callable

from quillcache._checks import check_float, check_int
from quillcache._ratelog import BurstLog
from quillcache.rpc.codec import DEFAULT_CODEC, Codec
from quillcache.rpc.dispatch import Dispatcher
from quillcache.rpc.errors import RpcErrorCode, RpcRejectedError, RpcTimeoutError
from quillcache.rpc.frames import DONTWAIT as _DONTWAIT
from quillcache.rpc.frames import HEADER, Reader, Stalled, hang_up, set_wait
from quillcache.rpc.frames import RECV_BYTES as _RECV_BYTES
from quillcache.rpc.frames import clock as _now
from quillcache.rpc.wire import encode_error_reply

__all__ = ["DEFAULT_IDLE_TIMEOUT_S", "DEFAULT_SPIN_S", "GOODBYE_CODES", "HEADER", "SCHEME", "StreamConnection",
           "StreamServer", "is_stream_address", "split_address"]

log = logging.getLogger(__name__)

SCHEME = "qtcp://"
_RECONNECT_S = 0.02
DEFAULT_SPIN_S = 100e-6  # see the module docstring: chosen by experiments/master_study.py's transport rows
# A connection that sends nothing (or stalls mid-frame) this long is closed. Far above any pause of a client in
# use (a pool node heartbeats within the master's client_ttl_s); a client idle longer reconnects transparently.
DEFAULT_IDLE_TIMEOUT_S = 60.0
GOODBYE_CODES = frozenset({RpcErrorCode.IDLE_TIMEOUT, RpcErrorCode.TOO_MANY_CONNECTIONS})
_TURN_AWAY_LOG_S = 10.0  # one warning, then a summary, per window this long of turned-away (or not accepted) ones
_ACCEPT_RETRY_S = 0.05  # pause of the accept thread after accept() failed (EMFILE...), so it does not spin
_PEER_GONE_ERRNOS = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EINTR})  # accept() again at once
_DRAIN_RECVS = 16  # non-blocking reads that empty a closing connection's receive queue (so close sends FIN, not RST)
_DROP_DRAIN_S = 1.0  # longest the server reads (and discards) the rest of a frame past its drop limit before closing


def is_stream_address(address: str) -> bool:
    return isinstance(address, str) and address.startswith(SCHEME)


def split_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``qtcp://HOST:PORT`` (IPv6 hosts in brackets); ``ValueError`` naming a bad one."""
    rest = address[len(SCHEME):] if is_stream_address(address) else address
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a stream address is '{SCHEME}HOST:PORT' with a port in [1, 65535], got {address!r}")
    return host.strip("[]"), int(port)


class StreamServer:
    """Serves ``target``'s whitelisted ``methods`` over length-prefixed TCP; see the module docstring."""

    def __init__(self, target: object, methods: list[str], host: str = "127.0.0.1", port: int = 0, *,
                 codec: Codec | None = None, max_frame_bytes: int = 64 << 20, drop_frame_bytes: int | None = None,
                 spin_s: float = DEFAULT_SPIN_S, max_connections: int = 1024,
                 idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S, name: str = "rpc",
                 after_reply: Callable[[], None] | None = None) -> None:
        self.spin_s = check_float("spin_s", spin_s, 0.0)
        self.after_reply = after_reply  # called after each reply is sent (errors logged), e.g. deferred work
        self.max_connections = check_int("max_connections", max_connections, 1)
        self.idle_timeout_s = check_float("idle_timeout_s", idle_timeout_s, 0.0, lo_open=True)
        self.num_turned_away = 0  # connections closed at accept because max_connections were open
        self.num_timed_out = 0  # connections closed by the idle timeout
        self.max_frame_bytes = check_int("max_frame_bytes", max_frame_bytes, 64)
        self.drop_frame_bytes = check_int("drop_frame_bytes", 4 * self.max_frame_bytes if drop_frame_bytes is None
                                          else drop_frame_bytes, self.max_frame_bytes)
        self.port = check_int("port", port, 0, 65535)
        if not isinstance(host, str) or not host:
            raise ValueError(f"host must be a non-empty str, got {host!r}")
        self.host = host
        self.name = name
        self.codec = DEFAULT_CODEC if codec is None else codec
        self.dispatcher = Dispatcher(target, methods, self.codec, self.max_frame_bytes, name)
        self._busy_frame = self._goodbye_frame(RpcErrorCode.TOO_MANY_CONNECTIONS, (
            f"{self.max_connections} connections are open (max_connections): this one is closed unread"))
        self._turn_away_log = BurstLog(log, "new connections turned away (max_connections)",
                                       window_s=_TURN_AWAY_LOG_S, burst=1, prefix=f"{name}: ")
        self._call_lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._conns_lock = threading.Lock()
        self._closing = False
        self._stopping = threading.Event()  # set by close(): cuts short the accept thread's pause after a failure
        self.num_accept_errors = 0  # connections not accepted or not served (EMFILE, no thread...): see _accept
        self._accept_error_log = BurstLog(log, "connections not accepted or not served",
                                          window_s=_TURN_AWAY_LOG_S, burst=1, prefix=f"{name}: ")

    @property
    def num_requests(self) -> int:
        return self.dispatcher.num_requests

    @property
    def num_refused(self) -> int:
        return self.dispatcher.num_refused

    @property
    def num_connections(self) -> int:
        """Connections open now."""
        with self._conns_lock:
            return len(self._conns)

    @property
    def address(self) -> str:
        if self._accept_thread is None:
            raise RuntimeError("the server is not started; call start() (or use it as a context manager)")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{SCHEME}{host}:{self.port}"

    # --- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> StreamServer:
        if self._accept_thread is not None:
            raise RuntimeError(f"server {self.name!r} is already started at {self.address}")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        lsock = socket.socket(family, socket.SOCK_STREAM)
        try:
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind((self.host, self.port))
            lsock.listen(128)
        except BaseException:
            lsock.close()
            raise
        self.port = lsock.getsockname()[1]
        self._listener = lsock
        self._accept_thread = threading.Thread(target=self._accept, daemon=True,
                                               name=f"{self.name}-stream-accept:{self.port}")
        self._accept_thread.start()
        return self

    def close(self) -> None:
        """Stop accepting, shut every connection, join the threads (idempotent)."""
        with self._conns_lock:
            if self._closing or self._listener is None:
                return
            self._closing = True
            conns = list(self._conns.items())
        self._stopping.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        assert self._accept_thread is not None
        self._accept_thread.join()
        for sock, thread in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for sock, thread in conns:
            thread.join()
        self._turn_away_log.tick(final=True)
        self._accept_error_log.tick(final=True)

    def __enter__(self) -> StreamServer:
        if self._accept_thread is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = self.address if self._accept_thread is not None else "not started"
        return f"StreamServer({self.name!r}, {where}, methods={self.dispatcher.served})"

    # --- threads ------------------------------------------------------------------------------------

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None
        while True:
            waits = [w for w in (self._turn_away_log.wait_s(), self._accept_error_log.wait_s()) if w is not None]
            try:
                listener.settimeout(max(min(waits), 0.001) if waits else None)  # wake for a due log summary
                sock, peer = listener.accept()
            except TimeoutError:  # no connection, but a summary of turned-away ones is due
                self._turn_away_log.tick()
                self._accept_error_log.tick()
                continue
            except OSError as e:
                if self._closing:
                    return  # close() shut the listener
                self._accept_failed(e)  # EMFILE, ENOBUFS, a connection reset before accept...: serving goes on
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                sock.close()  # the peer is gone already
                continue
            with self._conns_lock:
                if self._closing:
                    sock.close()
                    return
                if len(self._conns) >= self.max_connections:
                    self._turn_away(sock, peer)
                    continue
                thread = threading.Thread(target=self._serve_connection, args=(sock,), daemon=True,
                                          name=f"{self.name}-stream:{self.port}")
                self._conns[sock] = thread
            try:
                thread.start()
            except Exception as e:  # no thread to be had ("can't start new thread"): this connection is closed
                with self._conns_lock:
                    self._conns.pop(sock, None)
                self._count_accept_error(e)  # before the close, so a peer that sees it closed sees it counted
                sock.close()
                self._pause_after(e)

    def _accept_failed(self, err: Exception) -> None:
        """A connection that could not be accepted or served (out of descriptors, memory or threads; the peer gone
        before accept): counted, logged rate-limited (the first of each ``_TURN_AWAY_LOG_S`` window, then a summary),
        and, unless the peer merely left first, a pause of ``_ACCEPT_RETRY_S`` (cut short by ``close()``) so a
        lasting shortage is not retried in a busy loop. The accept thread then goes on."""
        self._count_accept_error(err)
        self._pause_after(err)

    def _count_accept_error(self, err: Exception) -> None:
        """Count one connection not accepted or not served, and log it (rate-limited: see ``_accept_failed``)."""
        self.num_accept_errors += 1
        self._accept_error_log.note(type(err).__name__, "a connection not accepted or not served: %s: %s",
                                    type(err).__name__, err)

    def _pause_after(self, err: Exception) -> None:
        """Unless the peer merely left first, wait ``_ACCEPT_RETRY_S`` (cut short by ``close()``)."""
        if getattr(err, "errno", None) not in _PEER_GONE_ERRNOS:
            self._stopping.wait(_ACCEPT_RETRY_S)

    def _turn_away(self, sock: socket.socket, peer: object) -> None:
        """(Under ``_conns_lock``) one TOO_MANY_CONNECTIONS goodbye, then close; logged rate-limited (the first of
        each ``_TURN_AWAY_LOG_S`` window, then a summary)."""
        self.num_turned_away += 1
        self._turn_away_log.note("turned away", "%d connections open (max_connections): turned away a new one "
                                 "from %s", len(self._conns), peer)
        _say_goodbye(sock, self._busy_frame)

    def _goodbye_frame(self, code: RpcErrorCode, message: str) -> bytes:
        """A length-prefixed refusal with no request id (module docstring: goodbyes)."""
        reply = encode_error_reply(self.codec, None, RpcRejectedError(code, message))
        return HEADER.pack(len(reply)) + reply

    def _serve_connection(self, sock: socket.socket) -> None:
        idle_s = self.idle_timeout_s
        set_wait(sock, socket.SO_RCVTIMEO, idle_s)  # no byte of a request for idle_s: BlockingIOError
        set_wait(sock, socket.SO_SNDTIMEO, idle_s)  # a reply the peer does not read for idle_s: the same
        reader = Reader(sock, idle_s)
        dispatcher, lock, pack, unpack_from = self.dispatcher, self._call_lock, HEADER.pack, HEADER.unpack_from
        max_frame, drop_frame, spin_s = self.max_frame_bytes, self.drop_frame_bytes, self.spin_s
        after = self.after_reply
        goodbye = None
        drain = 0
        try:
            while True:
                if spin_s and reader.spin(4, spin_s) is False:  # the next request of a busy client: no sleep
                    return
                started = False
                try:
                    if not reader.fill(1):  # idle: each wait is cut at idle_s by SO_RCVTIMEO
                        return
                    started = True
                    deadline = _now() + idle_s  # the request has begun: all of it within idle_s
                    if not reader.fill(4, deadline):
                        return
                    (n,) = unpack_from(reader.buf)
                    body = None
                    if n > drop_frame:
                        pass  # refused below, then closed: its bytes are never read
                    elif n > max_frame:
                        del reader.buf[:4]
                        if not reader.discard(n, deadline):
                            return
                    else:
                        if not reader.fill(4 + n, deadline):
                            return
                        body = bytes(reader.buf[4:4 + n])
                        del reader.buf[:4 + n]
                except (BlockingIOError, Stalled):
                    goodbye = (f"a request begun but not completed within the server's idle_timeout_s={idle_s:g} s"
                               if started else f"no request for the server's idle_timeout_s={idle_s:g} s")
                    return
                if n > drop_frame:
                    with lock:
                        reply = dispatcher.refuse(RpcErrorCode.FRAME_TOO_LARGE, (
                            f"frame of {n} bytes is past the server's drop limit of {drop_frame} bytes; "
                            f"closing the connection"))
                    sock.sendall(pack(len(reply)) + reply)
                    drain = 4 + n - len(reader.buf)  # the rest of the frame: read, discarded, then the close
                    return
                if body is None:
                    with lock:
                        reply = dispatcher.refuse(RpcErrorCode.FRAME_TOO_LARGE, (
                            f"frame of {n} bytes is past the server's max_frame_bytes={max_frame}"))
                else:
                    try:
                        reply = dispatcher.handle(body, lock)  # decoded before taking the lock
                    except Exception:  # never let one request end the connection's thread
                        log.exception("%s: failed handling a request", self.name)
                        continue
                    finally:
                        body = None  # not held while the connection waits for its next request
                sock.sendall(pack(len(reply)) + reply)  # a peer not reading for idle_s: BlockingIOError
                if after is not None:
                    try:
                        after()
                    except Exception:
                        log.exception("%s: the after-reply hook failed", self.name)
        except BlockingIOError:  # a reply not read for idle_s
            with self._conns_lock:
                self.num_timed_out += 1
            log.info("%s: closing a connection that read none of its reply for %g s", self.name, idle_s)
        except OSError:
            pass  # the peer went away (or close() shut the socket)
        finally:
            with self._conns_lock:
                self._conns.pop(sock, None)
                if goodbye is not None:
                    self.num_timed_out += 1
            if goodbye is not None:
                log.debug("%s: %s", self.name, goodbye)
                _say_goodbye(sock, self._goodbye_frame(RpcErrorCode.IDLE_TIMEOUT, (
                    f"{goodbye}: closing the connection; nothing sent on it after the last reply is run")))
            elif drain > 0:
                hang_up(sock, drain, min(idle_s, _DROP_DRAIN_S))
            else:
                sock.close()


def _say_goodbye(sock: socket.socket, frame: bytes) -> None:
    """Send ``frame`` (never blocking), then ``hang_up`` without waiting: what was waiting or arrives later is
    never read, and the goodbye goes out before the FIN."""
    try:
        sock.send(frame, _DONTWAIT)
    except OSError:
        pass  # the peer is gone (or its receive window is full: it was not reading)
    hang_up(sock, _DRAIN_RECVS * _RECV_BYTES, 0.0)


def _not_sent(message: str) -> RpcTimeoutError:
    """A timeout whose request never left this process (``sent`` False: resending it cannot run it twice)."""
    err = RpcTimeoutError(message)
    err.sent = False  # type: ignore[attr-defined]
    return err


class StreamConnection:
    """The client side of one ``qtcp://`` address: one blocking socket (module docstring). Not thread-safe:
    ``RpcClient`` calls it under its lock."""

    def __init__(self, address: str, max_reply_bytes: int, spin_s: float = DEFAULT_SPIN_S, *,
                 reconnect: bool = True) -> None:
        self.address = address
        self.reconnect = bool(reconnect)
        self.spin_s = check_float("spin_s", spin_s, 0.0)
        self.host, self.port = split_address(address)
        self.max_reply_bytes = max_reply_bytes
        self._sock: socket.socket | None = None
        self._reader: Reader | None = None

    def _connect(self, deadline: float, method: str) -> socket.socket:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _not_sent(f"{method} to {self.address}: cannot connect (nobody accepts there)")
            try:
                sock = socket.create_connection((self.host, self.port), timeout=remaining)
            except (ConnectionRefusedError, socket.timeout, OSError) as e:
                if not self.reconnect or isinstance(e, socket.timeout) or deadline - time.monotonic() <= 0:
                    raise _not_sent(f"{method} to {self.address}: cannot connect ({e})") from None
                time.sleep(min(_RECONNECT_S, max(0.0, deadline - time.monotonic())))
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock, self._reader = sock, Reader(sock)
            return sock

    def round_trip(self, frame: bytes, method: str, timeout_s: float) -> bytes:
        """Send ``frame``, return the next reply frame; ``RpcTimeoutError`` (socket closed) on any failure.
        ``timeout_s`` is a deadline for the whole round trip: ``sendall`` runs under a socket timeout (a total) and
        each wait for reply bytes is cut to what is left of it (``SO_RCVTIMEO``, as the server reads), so a reply
        that trickles in cannot hold the caller past it. A send that fails still returns a reply the server sent
        before closing, when it arrived whole (``_reply_waiting``)."""
        deadline = time.monotonic() + timeout_s
        if self._sock is not None and self._peer_done():
            self.close()  # the server closed this connection while we were not calling: a fresh one, nothing sent
        sock = self._sock if self._sock is not None else self._connect(deadline, method)
        reader = self._reader
        assert reader is not None
        try:
            sock.settimeout(max(1e-3, deadline - time.monotonic()))
            try:
                sock.sendall(HEADER.pack(len(frame)) + frame)
            except OSError:
                body = self._reply_waiting()
                if body is None:
                    raise
                self.close()  # the server closed the connection after its reply: a fresh one next time
                return body
            sock.settimeout(None)  # blocking: SO_RCVTIMEO cuts each wait below; MSG_DONTWAIT polls stay cheap
            read_by = _now() + (deadline - time.monotonic())  # the deadline on the reader's clock
            if self.spin_s and len(reader.buf) < 4 and not reader.skip:
                if reader.spin(4, self.spin_s) is False:
                    raise ConnectionResetError("the server closed the connection")
            elif reader.skip:
                reader.skip -= 1
            if not reader.fill(4, read_by):
                raise ConnectionResetError("the server closed the connection")
            (n,) = HEADER.unpack_from(reader.buf)
            if n > self.max_reply_bytes:
                raise ConnectionResetError(f"a reply of {n} bytes is past the client's limit")
            if not reader.fill(4 + n, read_by):
                raise ConnectionResetError("the server closed the connection mid-reply")
            body = bytes(reader.buf[4:4 + n])
            del reader.buf[:4 + n]
            return body
        except (socket.timeout, BlockingIOError, Stalled):  # sendall's timeout, a wait cut at the deadline
            self.close()
            raise RpcTimeoutError(f"{method} to {self.address}: no reply within {timeout_s} s "
                                  f"(the request may or may not have run)") from None
        except OSError as e:
            self.close()
            raise RpcTimeoutError(f"{method} to {self.address}: connection lost ({e}); "
                                  f"the request may or may not have run") from None

    def _reply_waiting(self) -> bytes | None:
        """After a send failed: the reply frame already received whole, read without blocking, or None. A server
        answers a frame past its drop limit at the length prefix and closes without reading the rest, so its
        ``FRAME_TOO_LARGE`` refusal can be here while the rest of the request could not be sent. No reply was
        waiting when the send began (``_peer_done``), so one here answers this request."""
        sock, reader = self._sock, self._reader
        assert sock is not None and reader is not None
        buf = reader.buf
        sock.settimeout(0.0)
        try:
            while len(buf) < 4 or len(buf) < 4 + min(HEADER.unpack_from(buf)[0], self.max_reply_bytes + 1):
                chunk = sock.recv(_RECV_BYTES)
                if not chunk:
                    break
                buf += chunk
        except OSError:
            pass  # nothing more waiting, or the connection was reset after what was read
        if len(buf) < 4:
            return None
        (n,) = HEADER.unpack_from(buf)
        if n > self.max_reply_bytes or len(buf) < 4 + n:
            return None
        return bytes(buf[4:4 + n])

    def _peer_done(self) -> bool:
        """True when the server is done with the connection: end of stream, a reset, or bytes waiting (peeked
        without blocking). Replies are read whole, so bytes waiting between calls can only be a goodbye (module
        docstring)."""
        sock = self._sock
        assert sock is not None
        sock.settimeout(0.0)
        try:
            sock.recv(1, socket.MSG_PEEK | _DONTWAIT)
        except BlockingIOError:
            return False  # nothing waiting: the connection is open
        except OSError:
            pass
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._reader = None
