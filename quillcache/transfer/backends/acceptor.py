"""Accepting and authenticating connections without a thread each: the listener of the TCP server
(``tcp_server``) and of the RDMA backend's control connections (``rdma``).

A ``PreauthAcceptor`` owns a listening socket and one accepting thread. That thread sends each new
connection the HMAC challenge (``protocol``: HELLO), collects its PROOF and checks it. A connection that
proved the secret goes to the owner: the accepting thread records it in the owner's table of
AUTHENTICATED connections (``conns``) with a thread of its own running the owner's ``serve``, which
sends the ACCEPT frame the acceptor computed, serves the connection, and removes it from the table when
it ends.

Invariants:
- A connection is handed over only once its peer passed the HMAC challenge-response (``protocol``);
  one that fails it, or has not proved the secret within ``auth_timeout_s``, is closed and counted in
  ``stats.auth_failures``.
- Authentication runs on the accepting thread, without blocking (a selector over the listening socket
  and the connections still authenticating): an unauthenticated connection costs a descriptor and a
  few bytes, never a thread. Only an authenticated one gets a thread of its own (the owner's).
- Two separate caps. At most ``max_server_connections`` AUTHENTICATED connections are held; while
  they are all taken a new connection is answered BUSY and closed at accept (and so is one that
  authenticates meanwhile: ``stats.refused_busy``). At most ``max_preauth_connections`` connections
  are AUTHENTICATING at once, on top of those, and they never count against ``max_server_connections``;
  when that is full, a new connection takes the slot of the OLDEST authenticating one, which is
  answered BUSY and closed (``stats.preauth_evicted``). So peers without the secret can never take the
  slots of authenticated peers, and every new connection gets its challenge: a client whose proof
  arrives before the acceptor has accepted ``max_preauth_connections`` newer connections is served
  however many silent ones an attacker keeps opening (and the client tries again on BUSY:
  ``tcp_client.retry_busy``).
  Each turn of the accepting thread reads every authenticating connection that has bytes waiting
  before it accepts at most half of ``max_preauth_connections`` new ones (and at most
  ``ACCEPT_BURST``), so a proof that has arrived is checked before its connection can be dropped.
- When accepting fails for want of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM), the
  listening socket is left out of the selector for ``ACCEPT_PAUSE_S`` (no busy loop on a backlog that
  cannot be drained); the connections already authenticating go on meanwhile.
- Connections dropped before authenticating (failed, timed out, evicted, refused busy, not accepted)
  are logged one by one only for the first ``DROP_LOG_BURST`` of each ``DROP_LOG_WINDOW_S``; the rest
  are counted and summed up in one line per window ("unauthenticated connections dropped in the
  last X s: N (...)"), and in ``stats.drop_logs_suppressed`` (``quillcache._ratelog.BurstLog``). So the
  log grows by a bounded number of lines per window however fast connections are opened and dropped.
  Both constants are read when an acceptor is built.
- Who owns what: the authenticating connections, the selector and the drop log belong to the
  accepting thread alone (other threads only read how many connections are authenticating). The
  owner's table ``conns`` is guarded by the owner's ``lock``: the accepting thread adds a connection
  with it held, after checking the count under the same hold, and ``close`` sets ``closing`` under it.
  So no connection is handed over once ``close`` has returned, and an owner that copies ``conns`` after
  ``close`` has them all. Counters of ``stats`` other than those named here are the owner's; the
  accepting thread touches only these.
- One connection's failure is its own: a connection whose thread cannot start (out of threads or
  memory) gives its slot back and is answered BUSY (``stats.refused_busy``; the client tries again),
  and an unexpected error while admitting or authenticating one closes that connection
  (``stats.auth_failures``); the accepting thread goes on accepting either way.
- ``close`` wakes the accepting thread, which closes every authenticating connection and ends; then
  ``close`` closes the listening socket. Authenticated connections are the owner's to close.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from quillcache._ratelog import BurstLog
from quillcache.transfer import protocol as P
from quillcache.transfer.backends.sockets import TcpConfig
from quillcache.transfer.types import AuthenticationError, ProtocolError

__all__ = ["ACCEPT_BURST", "ACCEPT_PAUSE_S", "DROP_LOG_BURST", "DROP_LOG_WINDOW_S", "LISTEN_BACKLOG", "AcceptorStats",
           "PreauthAcceptor", "answer_busy"]

LISTEN_BACKLOG = 1024  # connections the kernel queues for accept (it caps this at net.core.somaxconn)
ACCEPT_BURST = 64  # most connections accepted per turn (also at most half of max_preauth_connections)
ACCEPT_PAUSE_S = 0.05  # how long accepting stops after accept fails for want of descriptors or memory
DROP_LOG_BURST = 5  # dropped unauthenticated connections logged one by one per window ...
DROP_LOG_WINDOW_S = 10.0  # ... the rest summed up in one line per window of this length

_LISTENER, _WAKE = "listener", "wake"  # selector tags of the listening socket and the wake-up pipe
_NO_RESOURCES = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))


@dataclass
class AcceptorStats:
    """The counters the accepting thread keeps (an owner's stats extend these)."""

    accepted: int = 0
    refused_busy: int = 0    # answered BUSY: every authenticated slot taken
    preauth_evicted: int = 0  # answered BUSY: the oldest authenticating connection, dropped for a newer one
    authenticated: int = 0
    auth_failures: int = 0   # a wrong, malformed or missing proof (also: none within auth_timeout_s)
    drop_logs_suppressed: int = 0  # dropped unauthenticated connections counted in a summary line, not logged


def answer_busy(sock: socket.socket, reason: str) -> None:
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


class _Pending:
    """A connection still authenticating: its challenge, the proof bytes so far, when it must be done."""

    __slots__ = ("sock", "peer", "nonce", "deadline_s", "proof", "got")

    def __init__(self, sock: socket.socket, peer: tuple, nonce: bytes, deadline_s: float) -> None:
        self.sock, self.peer, self.nonce, self.deadline_s = sock, peer, nonce, deadline_s
        self.proof = bytearray(P.PROOF.size)
        self.got = 0


class PreauthAcceptor:
    """Listens on ``host:port`` and authenticates without a thread each (module docstring); ``start`` it.

    ``stats`` gets the counters of ``AcceptorStats``. ``conns`` is the owner's table of authenticated
    connections, each with its thread, guarded by ``lock`` (the owner's); its size is checked against
    ``max_server_connections``. A connection that proved the secret while a slot is free is added to it
    with a daemon thread named ``conn_thread_name:PEER_PORT`` that runs ``serve(sock, peer, accept)``:
    that owns ``sock`` from then on (blocking mode is its to set), sends ``accept``, the ACCEPT frame,
    first, and removes ``sock`` from ``conns`` (under ``lock``) when it ends. ``label`` names the
    connections in log lines and BUSY reasons ("RDMA control": "RDMA control connections"; "": plain
    "connections"), ``listener`` the listener in the line the accepting thread leaves if it fails,
    ``thread_name`` the accepting thread (``:PORT`` appended); lines go to ``log``.
    """

    def __init__(self, host: str, port: int, secret: bytes, config: TcpConfig, stats: AcceptorStats, *,
                 lock: threading.Lock, conns: dict[socket.socket, threading.Thread],
                 serve: Callable[[socket.socket, tuple, bytes], None], log: logging.Logger, label: str = "",
                 listener: str = "transfer server", thread_name: str = "qc-transfer-accept",
                 conn_thread_name: str = "qc-transfer-conn") -> None:
        self.secret, self.config, self.stats = secret, config, stats
        self._lock, self._conns, self._serve, self._log = lock, conns, serve, log
        self._listener, self._thread_name, self._conn_thread_name = listener, thread_name, conn_thread_name
        self._noun = f"{label} connections" if label else "connections"  # wording of log lines and BUSY reasons
        self._who = f"{label} connection from %s" if label else "%s"
        self._kind = f"{label} " if label else ""
        self.closing = False  # set under ``lock`` by ``close``
        self._pending: dict[socket.socket, _Pending] = {}  # authenticating, oldest first (accepting thread's)
        self._drops = BurstLog(log, "unauthenticated connections dropped", window_s=DROP_LOG_WINDOW_S,
                               burst=DROP_LOG_BURST)
        self._thread: threading.Thread | None = None
        self._lsock = socket.create_server((host, port), backlog=LISTEN_BACKLOG)
        try:
            self._lsock.setblocking(False)
            self.host, self.port = self._lsock.getsockname()[:2]
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            self._sel = selectors.DefaultSelector()
            self._sel.register(self._lsock, selectors.EVENT_READ, _LISTENER)
            self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        except BaseException:
            self._lsock.close()
            raise

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def authenticating(self) -> int:
        """Connections still authenticating (at most ``max_preauth_connections``)."""
        return len(self._pending)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"{self._thread_name}:{self.port}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop: no connection is handed over once this returns; every authenticating one and the listener closed."""
        with self._lock:
            self.closing = True
        try:
            self._wake_w.send(b"x")  # the accepting thread closes the authenticating sockets and the selector
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout=5)
        else:
            self._sel.close()  # never started: nothing was accepted
        self._lsock.close()
        self._wake_r.close()
        self._wake_w.close()

    # ---- the accepting thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        sel, pending, lsock = self._sel, self._pending, self._lsock
        burst = max(1, min(ACCEPT_BURST, self.config.max_preauth_connections // 2))
        paused_until: float | None = None
        try:
            while not self.closing:
                now = time.monotonic()
                if paused_until is not None and now >= paused_until:
                    sel.register(lsock, selectors.EVENT_READ, _LISTENER)
                    paused_until = None
                waits = [w for w in (pending[next(iter(pending))].deadline_s - now if pending else None,
                                     self._drops.wait_s(), None if paused_until is None else paused_until - now)
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
                        try:
                            self._on_proof_bytes(tag)
                        except Exception as e:  # that connection fails alone: accepting goes on
                            self._drop_broken(tag.sock, tag.peer, e)
                if self.closing:
                    break
                if accept and not self._accept_some(burst):
                    sel.unregister(lsock)  # out of descriptors or memory: stop accepting for a moment
                    paused_until = time.monotonic() + ACCEPT_PAUSE_S
                now = time.monotonic()
                while pending:  # oldest first, and all share auth_timeout_s: the expired ones lead
                    p = pending[next(iter(pending))]
                    if p.deadline_s > now:
                        break
                    self._fail(p, f"no proof within auth_timeout_s={self.config.auth_timeout_s:g} s "
                                  f"({p.got} of {P.PROOF.size} bytes came)")
                self._drops.tick()
        except Exception:
            self._log.exception(f"{self._listener} %s: the accepting thread failed; no new {self._noun} are accepted",
                                self.address)
        finally:
            for p in list(pending.values()):
                p.sock.close()
            pending.clear()
            sel.close()
            self._drops.tick(final=True)

    def _drop(self, kind: str, fmt: str, *args: object) -> None:
        """One connection dropped before it authenticated, into the drop log (module docstring)."""
        self._drops.note(kind, fmt, *args)
        self.stats.drop_logs_suppressed = self._drops.suppressed_total

    def _accept_some(self, burst: int) -> bool:
        """Accept up to ``burst`` connections; False when accepting failed for want of descriptors or memory."""
        for _ in range(burst):
            try:
                sock, peer = self._lsock.accept()
            except BlockingIOError:
                return True
            except OSError as e:
                if e.errno in _NO_RESOURCES:
                    self._drop(f"{self._kind}not accepted", f"cannot accept {self._noun} for %g s: %s",
                                     ACCEPT_PAUSE_S, e)
                    return False
                continue  # that connection is gone already (ECONNABORTED and the like)
            self.stats.accepted += 1
            try:
                self._admit(sock, peer)
            except Exception as e:  # that connection fails alone (the selector refused it, say): accepting goes on
                self._drop_broken(sock, peer, e)
        return True

    def _drop_broken(self, sock: socket.socket, peer: tuple, error: BaseException) -> None:
        """Close a connection that failed unexpectedly on the accepting thread, wherever it was; count it."""
        self._pending.pop(sock, None)
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass  # not registered (any more)
        self._failed(peer, f"cannot take the connection: {error!r}")
        sock.close()

    def _admit(self, sock: socket.socket, peer: tuple) -> None:
        """Challenge a new connection, making room among the authenticating ones if they are all taken."""
        cfg, pending = self.config, self._pending
        try:
            sock.setblocking(False)
        except OSError:
            sock.close()
            return
        if len(self._conns) >= cfg.max_server_connections:
            self._refuse_busy(sock, peer)
            return
        if len(pending) >= cfg.max_preauth_connections:
            oldest = self._forget(pending[next(iter(pending))])
            self.stats.preauth_evicted += 1
            answer_busy(oldest.sock, f"{len(pending) + 1} {self._noun} are authenticating (max_preauth_connections); "
                                     "this one, the oldest, gave its slot to a newer one")
            self._drop(f"{self._kind}evicted", f"dropping unauthenticated {self._who}: %d {self._noun} are "
                             "authenticating (max_preauth_connections), this one the oldest", oldest.peer,
                             len(pending) + 1)
        nonce = P.new_nonce()
        hello = P.encode_hello(nonce)
        try:
            sent = sock.send(hello)  # a fresh connection's send buffer takes it whole
        except OSError as e:
            sent, why = -1, str(e) or type(e).__name__
        else:
            why = f"sent {sent} of {len(hello)} bytes of the challenge"
        if sent != len(hello):
            self._failed(peer, why)
            sock.close()
            return
        p = _Pending(sock, peer, nonce, time.monotonic() + cfg.auth_timeout_s)
        self._sel.register(sock, selectors.EVENT_READ, p)
        pending[sock] = p

    def _refuse_busy(self, sock: socket.socket, peer: tuple) -> None:
        """Answer BUSY: every authenticated slot is taken."""
        held = len(self._conns)
        self.stats.refused_busy += 1
        answer_busy(sock, f"already serving {held} authenticated {self._noun} (max_server_connections)")
        self._drop(f"{self._kind}refused busy", f"refusing {self._who}: already serving %d {self._noun}",
                         peer, held)

    def _forget(self, p: _Pending) -> _Pending:
        del self._pending[p.sock]
        self._sel.unregister(p.sock)
        return p

    def _failed(self, peer: tuple, why: object) -> None:
        self.stats.auth_failures += 1
        self._drop(f"{self._kind}failed authentication", f"refused {self._who}: authentication failed: %s",
                         peer, str(why) or type(why).__name__)

    def _fail(self, p: _Pending, why: object) -> None:
        self._forget(p)
        self._failed(p.peer, why)
        p.sock.close()

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
            if self.closing:
                p.sock.close()
                return
            full = len(self._conns) >= self.config.max_server_connections
            if not full:
                self.stats.authenticated += 1
                thread = threading.Thread(target=self._serve, args=(p.sock, p.peer, accept), daemon=True,
                                          name=f"{self._conn_thread_name}:{p.peer[1]}")
                self._conns[p.sock] = thread
        if full:
            self._refuse_busy(p.sock, p.peer)
            return
        try:
            thread.start()
        except Exception as e:  # "can't start new thread": out of threads or memory, for now
            with self._lock:
                self._conns.pop(p.sock, None)  # its slot is free again; nothing was served on it
            self._no_thread(p.sock, p.peer, e)

    def _no_thread(self, sock: socket.socket, peer: tuple, error: BaseException) -> None:
        """Answer BUSY (the client tries again later) to an authenticated connection whose thread did not start."""
        self.stats.refused_busy += 1
        answer_busy(sock, f"cannot start a thread for this connection now: {error}")
        self._drop(f"{self._kind}refused busy", f"refusing {self._who}: cannot start its thread: %s", peer,
                         error)
