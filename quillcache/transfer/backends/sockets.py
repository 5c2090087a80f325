"""The TCP backend's configuration and its ``Channel``: exact reads into views, progress-bounded sends.

Every call moves bytes with ``recv_into``/``recvmsg_into``/``send``/``sendmsg`` on memoryviews, which
release the GIL and copy nothing in Python; each must make progress within ``progress_s`` seconds and
the whole operation must end by ``deadline`` (``time.monotonic()``), else ``socket.timeout``.

Spin, then block: before any receive would block, a ``Channel`` polls the socket without blocking
(``MSG_DONTWAIT``) for up to ``spin_us`` microseconds. On a virtual machine a blocked thread's
wake-up (an inter-processor interrupt through the hypervisor) costs tens of microseconds, most of a
64 KiB round trip, and a receiver that wakes once per arriving segment pays it many times per
large block; a spinning receiver pays none while the peer keeps up. The price is CPU: each wait
burns up to ``spin_us`` of one core before it sleeps (reported as CPU seconds per GB by the
transfer study). Spinning never delays noticing a closed or reset connection (the non-blocking
call reports it at once) nor a deadline (a spin ends at the deadline, and the blocking call that
follows is bounded by the kernel timeout as before); a wait for progress may last ``spin_us`` longer
than ``progress_s``. Adaptive: after two spins in a row that found nothing (a peer that shares this
core, where spinning only takes the CPU from it, or an idle one), the next waits do not spin, for
16 waits, doubling per further fruitless spin up to 1024; a spin that pays resets this. So an idle
connection costs one ``spin_us`` per up to 1024 waits. A peer on the same core is not always
recognised (the scheduler may run it while we spin, so the spin "pays"): there a spin costs up to
``spin_us`` of the shared CPU per wait. ``spin_us=0`` restores plain blocking calls; the bytes are
the same either way.

Compiled fast path: ``fast_channel`` wraps a connection in ``_fastio.FastChannel`` (Cython), which
does the same sends, spin-then-block receives and, for a client, the whole request/answer round
trip with the GIL released and without a Python call per system call. ``Channel`` stays the
reference (and the path of authentication, control frames and every error's reason);
``TcpConfig.fast_path=False``, or a build without the compiled module, uses it everywhere.
"""


from __future__ import annotations

import socket
import struct
import time

from quillcache.transfer import protocol as _protocol

try:
    from quillcache.transfer.backends import _fastio
except ImportError:  # not built: the plain-Python Channel does everything
    FastChannel = None
else:
    if (getattr(_fastio, "RESPONSE_HEADER_BYTES", None) == _protocol.RESPONSE.size
            and getattr(_fastio, "PROTOCOL_VERSION", None) == _protocol.PROTOCOL_VERSION):
        FastChannel = _fastio.FastChannel
    else:  # a stale build for another protocol version would misread (or refuse) every answer: use the reference
        import warnings

        warnings.warn("quillcache.transfer.backends._fastio was built for another protocol version; "
                      "rebuild it (pip install -e . or python setup.py build_ext --inplace): using the "
                      "plain-Python Channel", RuntimeWarning, stacklevel=1)
        FastChannel = None

__all__ = ["MAX_TIMEOUT_S", "Channel", "FastChannel", "TcpConfig", "fast_channel", "tune_socket"]

from dataclasses import dataclass

MAX_TIMEOUT_S = 1e6  # the longest timeout of a TcpConfig (11.6 days): finite, and within every OS wait (epoll
# takes at most 2**31 - 1 ms, about 24.8 days; a kernel socket timeout is a timeval)


@dataclass(frozen=True)
class TcpConfig:
    """Knobs of the TCP backend (both sides). Times in seconds (each positive and at most ``MAX_TIMEOUT_S``;
    no infinite timeout), sizes in bytes.

    ``connections_per_peer`` bounds the client's persistent connections to one peer;
    ``window`` the requests in flight on one connection; ``progress_timeout_s`` how long any one
    socket call may go without moving a byte; ``idle_check_s`` after how long idle a pooled
    connection is probed for liveness before reuse; ``max_request_bytes`` the largest READ/WRITE a
    server accepts; ``max_server_connections`` the authenticated connections a server holds at once;
    ``max_preauth_connections`` the connections still authenticating that it holds besides them (when
    full, the oldest is dropped for a new one: peers without the secret can never take the slots of
    authenticated ones, and a client that answers its challenge promptly gets through; see
    ``tcp_server``); ``auth_timeout_s`` how long an unauthenticated peer may take;
    ``server_idle_timeout_s`` when a server drops a connection that sends nothing; ``lane_min_bytes``
    the least bytes worth a connection of their own when a batch is spread over connections;
    ``spin_us`` how long a receive polls without blocking before it sleeps (0: never spin; see the
    module docstring);
    ``socket_buffer_bytes`` the send and receive buffer asked of the kernel for every connection
    (0: the kernel's autotuning; the kernel caps it at ``net.core.[rw]mem_max`` and doubles it);
    ``fast_path`` moves the bytes of READ/WRITE requests with the compiled ``FastChannel`` when it is
    built (False: always the plain-Python ``Channel``; same bytes and outcomes either way);
    ``congestion_control`` the TCP congestion control of every connection, the first of these names
    the kernel accepts ("": the system's default). Not BBR: it paces every send from its estimate of
    the path's bandwidth, which bursts of requests over loopback or a datacenter link mislead (a
    connection then settles at about half the rate, at twice the CPU per GB).
    """

    connections_per_peer: int = 4
    window: int = 16
    connect_timeout_s: float = 5.0
    progress_timeout_s: float = 10.0
    idle_check_s: float = 1.0
    max_request_bytes: int = 1 << 30
    max_server_connections: int = 256
    max_preauth_connections: int = 128
    auth_timeout_s: float = 2.0
    server_idle_timeout_s: float = 600.0
    lane_min_bytes: int = 16 << 20
    spin_us: int = 50
    socket_buffer_bytes: int = 4 << 20
    fast_path: bool = True
    congestion_control: str = "cubic,reno"

    def __post_init__(self) -> None:
        if not isinstance(self.congestion_control, str):
            raise ValueError("TcpConfig.congestion_control must be a str of comma-separated algorithm names, "
                             f"got {self.congestion_control!r}")
        for name in ("fast_path",):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"TcpConfig.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("connections_per_peer", "window", "max_request_bytes", "max_server_connections",
                     "max_preauth_connections", "lane_min_bytes"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"TcpConfig.{name} must be a positive int, got {v!r}")
        if type(self.socket_buffer_bytes) is not int or not 0 <= self.socket_buffer_bytes <= 1 << 30:
            raise ValueError("TcpConfig.socket_buffer_bytes must be an int in 0..2**30 (0: kernel autotuning), "
                             f"got {self.socket_buffer_bytes!r}")
        if type(self.spin_us) is not int or not 0 <= self.spin_us <= 1_000_000:
            raise ValueError(f"TcpConfig.spin_us must be an int of microseconds in 0..1000000, got {self.spin_us!r}")
        for name in ("connect_timeout_s", "progress_timeout_s", "idle_check_s", "auth_timeout_s",
                     "server_idle_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= MAX_TIMEOUT_S:
                raise ValueError(f"TcpConfig.{name} must be a positive number of seconds up to {MAX_TIMEOUT_S:g} "
                                 f"(finite: it becomes a kernel socket timeout), got {v!r}")


def tune_socket(sock: socket.socket, config: TcpConfig) -> None:
    """Every connection: no Nagle delay; fixed buffers of ``config.socket_buffer_bytes`` unless 0; the first
    congestion control of ``config.congestion_control`` the kernel lets this process set (none: its default)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if config.socket_buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.socket_buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, config.socket_buffer_bytes)
    for name in config.congestion_control.split(","):
        if not name:
            continue
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
            return
        except OSError:  # not built into this kernel, or not allowed to unprivileged processes: try the next
            continue


def fast_channel(ch: "Channel", config: TcpConfig):
    """The compiled ``FastChannel`` on ``ch``'s socket (also kept as ``ch.fast``, so the two agree on the
    kernel timeout armed), or None (``config.fast_path`` off, or the module not built)."""
    if not config.fast_path or FastChannel is None:
        return None
    fast = FastChannel(ch.sock, ch.progress_s, config.spin_us)
    fast.armed_s = ch._armed_s
    ch.fast = fast
    return fast


_DONTWAIT = socket.MSG_DONTWAIT
_clock = time.monotonic  # the clock of every deadline
_BACKOFF_MIN, _BACKOFF_MAX = 16, 1024  # waits without a spin after fruitless spins in a row
_ABORT_LINGER = struct.pack("ii", 1, 0)  # struct linger {l_onoff=1, l_linger=0}: close() sends a reset


class Channel:
    """A blocking socket whose every call must make progress within a per-call timeout.

    The timeouts are the kernel's (``SO_RCVTIMEO``/``SO_SNDTIMEO``), not Python's: a Python socket
    timeout makes every call ``poll`` first and every ``settimeout`` switch the descriptor's mode,
    two extra system calls per call on the hot path. The kernel timeout is changed only when a
    deadline comes nearer than ``progress_s``. A call that times out raises ``socket.timeout``; a
    peer that closes mid-frame raises ``ConnectionError`` saying how many bytes of how many came.
    Every receive first polls without blocking for up to ``spin_us`` (module docstring), then blocks.
    """

    __slots__ = ("sock", "progress_s", "spin_s", "_armed_s", "_skip", "_fails", "_backoff", "fast")

    def __init__(self, sock: socket.socket, progress_s: float, spin_us: int = 0) -> None:
        sock.settimeout(None)
        self.sock = sock
        self.fast = None  # a FastChannel on the same socket, where its owner uses one
        self.progress_s = progress_s
        self.spin_s = spin_us * 1e-6
        self._skip = 0  # waits left that do not spin (adaptive back-off)
        self._fails = 0  # spins in a row that found nothing
        self._backoff = _BACKOFF_MIN  # the next back-off, doubled by every fruitless spin past the first
        self._armed_s = -1.0
        self._set(progress_s)

    def _set(self, seconds: float) -> None:
        seconds = max(seconds, 1e-6)
        tv = struct.pack("ll", int(seconds), int((seconds % 1.0) * 1e6))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self._armed_s = seconds
        if self.fast is not None:
            self.fast.armed_s = seconds

    def _sync(self) -> None:
        """Learn the kernel timeout a ``FastChannel`` on the same socket may have set since."""
        if self.fast is not None:
            self._armed_s = self.fast.armed_s

    def arm(self, deadline: float | None, wait_s: float | None = None) -> None:
        """Bound the next calls by ``wait_s`` (default ``progress_s``) and by ``deadline``."""
        t = self.progress_s if wait_s is None else wait_s
        if self.fast is not None:
            self._sync()
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("deadline passed")
            if left < t:
                t = left
        if t != self._armed_s:
            self._set(t)

    def _spin_end(self, deadline: float | None) -> float:
        end = _clock() + self.spin_s
        return end if deadline is None or deadline > end else deadline

    def _spun_in_vain(self) -> None:
        """A spin found nothing. From the second in a row, skip spinning for the next ``_backoff`` waits and
        double ``_backoff`` (up to ``_BACKOFF_MAX``): a peer that shares this core, or is idle, is not
        made to wait for our spins. One spin that pays resets both."""
        self._fails += 1
        if self._fails >= 2:
            self._skip = self._backoff
            self._backoff = min(self._backoff * 2, _BACKOFF_MAX)

    def _spin_into(self, view: memoryview, deadline: float | None = None) -> int:
        """Poll ``recv_into(view)`` without blocking for up to ``spin_s`` (never past ``deadline``): the bytes
        it returned (0: the peer closed), or -1 when none came in time. A reset connection raises at once.
        Callers skip it while ``_skip`` counts down (the back-off)."""
        recv_into = self.sock.recv_into
        try:
            return recv_into(view, 0, _DONTWAIT)
        except BlockingIOError:
            pass
        end = self._spin_end(deadline)
        while True:
            try:
                k = recv_into(view, 0, _DONTWAIT)
            except BlockingIOError:
                if _clock() < end:
                    continue
                self._spun_in_vain()
                return -1
            self._fails, self._backoff = 0, _BACKOFF_MIN  # the spin paid: keep spinning
            return k

    def _spin_two(self, head: memoryview, body: memoryview, deadline: float | None) -> int:
        """``_spin_into`` for a scatter read into ``head`` then ``body`` (one ``recvmsg_into``)."""
        recvmsg_into = self.sock.recvmsg_into
        bufs = [head, body]
        try:
            return recvmsg_into(bufs, 0, _DONTWAIT)[0]
        except BlockingIOError:
            pass
        end = self._spin_end(deadline)
        while True:
            try:
                k = recvmsg_into(bufs, 0, _DONTWAIT)[0]
            except BlockingIOError:
                if _clock() < end:
                    continue
                self._spun_in_vain()
                return -1
            self._fails, self._backoff = 0, _BACKOFF_MIN  # the spin paid: keep spinning
            return k

    def recv_into(self, view: memoryview, deadline: float | None = None, first_wait_s: float | None = None) -> None:
        """Fill ``view``; ``first_wait_s`` bounds the wait for its first byte instead of ``progress_s``."""
        got, n, sock, spin = 0, len(view), self.sock, self.spin_s
        self.arm(deadline, first_wait_s)
        try:
            while got < n:
                part = view[got:] if got else view
                k = -1
                if spin:
                    if self._skip:
                        self._skip -= 1
                    else:
                        k = self._spin_into(part, deadline)
                        if k < 0 and deadline is not None:
                            self.arm(deadline)  # the spin took time: what is left of the deadline bounds the wait
                if k < 0:
                    k = sock.recv_into(part)  # BlockingIOError here: the kernel timeout expired
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
        if self._skip:
            self._skip -= 1
        elif self.spin_s:
            k = self._spin_into(view)
            if k == 0:
                raise ConnectionError(f"peer closed the connection after 0 of {len(view)} bytes")
            if k > 0:
                if k < len(view):
                    self.recv_into(view[k:])
                return
        start = time.monotonic()
        self._sync()
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
            k = -1
            if self._skip:
                self._skip -= 1
            elif self.spin_s:
                k = self._spin_two(head, body, deadline)
                if k < 0 and deadline is not None:
                    self.arm(deadline)
            if k < 0:
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

    def abort(self) -> None:
        """Close with a reset (``SO_LINGER`` on, 0 s) instead of a FIN: what this side has not sent yet is
        discarded, not flushed to the peer. For a connection abandoned mid-request (a timeout, a failure),
        whose unsent WRITE payload must not land later; bytes the peer has already received may still."""
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _ABORT_LINGER)
        except OSError:  # already reset or shut down: a plain close does the same
            pass
        self.sock.close()
