"""``RpcClient`` (over TCP: a ZeroMQ DEALER socket, or for a ``qtcp://`` address the plain-TCP transport of
:mod:`quillcache.rpc.stream`) and ``InProcessClient`` (the same calls, no sockets).

Contract:
- ``client.call("put_start", key, size)`` and ``client.put_start(key, size)`` are the same call; it returns the
  method's value or raises: the server's exception (a registered class as itself, others as ``RpcRemoteError``),
  ``RpcRejectedError`` for a refused request, ``RpcTimeoutError`` when no reply comes within ``timeout_s`` (per
  attempt), ``RpcEncodeError`` for an argument the codec cannot encode.
- One request is in flight per client at a time (a lock: a client may be shared by threads, which take turns).
  Each request carries a fresh id; a reply with another id (one that came back after its caller timed out) is
  dropped. After a timeout the socket is closed and re-opened, so a request still queued for a dead server is
  discarded instead of being delivered to it when it comes back, and no lost reply can wedge the client. ZeroMQ
  reconnects a live socket to a restarted server by itself.
- Transport by address: ``qtcp://HOST:PORT`` is the plain-TCP transport (one blocking socket, length-prefixed
  frames); ``tcp://HOST:PORT`` and ``HOST:PORT`` are ZeroMQ. A list may mix them; retries, timeouts and leader
  moves behave the same on both. On the plain-TCP transport a lost connection is an ``RpcTimeoutError`` at once
  (not at the end of the timeout), and a refused connection is retried until the call's timeout. A connection
  the server closed for being idle is replaced without the caller noticing: before sending when the server's
  goodbye is already there, else by sending the request again, once, on a fresh connection when the reply is
  that ``IDLE_TIMEOUT`` goodbye (the server never read the request). A ``TOO_MANY_CONNECTIONS`` goodbye is raised
  as that ``RpcRejectedError`` (the request did not run).
- High availability: ``address`` may be several addresses. A reply whose error ``code`` is in ``retry_codes``
  (enum members, or their names: default ``{"NOT_LEADER"}``) makes the client move to another server and send the
  request again, up to ``max_retries`` times with exponential backoff (``backoff_s`` doubling up to
  ``max_backoff_s``): the next server is the one ``leader_finder()`` names (an address, or None when it does not
  know) or else the next address in the list. A timeout also moves the NEXT call on when there is anywhere to
  move (the timed-out request itself is not resent: it may have run).
- ``InProcessClient(target, methods)`` is the embedded mode: the same whitelist, attribute access and errors, and
  with ``roundtrip=True`` (default) every argument, value and exception goes through the codec, so whatever works
  embedded also works over the wire.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence

import zmq

from quillcache._checks import check_float, check_int
from quillcache.rpc.codec import DEFAULT_CODEC, Codec
from quillcache.rpc.dispatch import Dispatcher
from quillcache.rpc.errors import RpcConnectionError, RpcErrorCode, RpcRejectedError, RpcTimeoutError
from quillcache.rpc.server import DEFAULT_MAX_FRAME_BYTES
from quillcache.rpc.stream import DEFAULT_SPIN_S, GOODBYE_CODES, StreamConnection, is_stream_address, split_address
from quillcache.rpc.wire import encode_request, error_from_wire, error_to_wire, parse_reply

__all__ = ["InProcessClient", "RpcClient"]

log = logging.getLogger(__name__)

DEFAULT_RETRY_CODES = frozenset({"NOT_LEADER"})


def _normalize(address: str) -> str:
    if not isinstance(address, str) or not address:
        raise ValueError(f"an address is 'tcp://host:port' or 'host:port', got {address!r}")
    if is_stream_address(address):
        split_address(address)  # a ValueError naming a bad one now, not at the first call
        return address
    return address if "://" in address else f"tcp://{address}"


class RpcClient:
    """Calls an ``RpcServer``; see the module docstring for the contract."""

    def __init__(self, address: str | Sequence[str], timeout_s: float = 5.0, *, codec: Codec | None = None,
                 leader_finder: Callable[[], str | None] | None = None,
                 retry_codes: Collection[object] = DEFAULT_RETRY_CODES, max_retries: int = 8,
                 backoff_s: float = 0.05, max_backoff_s: float = 1.0,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, spin_s: float = DEFAULT_SPIN_S,
                 stream_reconnect: bool = True, sleep: Callable[[float], None] = time.sleep) -> None:
        addresses = [address] if isinstance(address, str) else list(address)
        if not addresses:
            raise ValueError("RpcClient needs at least one address")
        self._addresses = [_normalize(a) for a in addresses]
        self._current = self._addresses[0]
        self.timeout_s = check_float("timeout_s", timeout_s, 0.0, lo_open=True)
        self.codec = DEFAULT_CODEC if codec is None else codec
        self.leader_finder = leader_finder
        self.retry_codes = frozenset(retry_codes)
        self.max_retries = check_int("max_retries", max_retries, 0)
        self.backoff_s = check_float("backoff_s", backoff_s, 0.0)
        self.max_backoff_s = check_float("max_backoff_s", max_backoff_s, self.backoff_s)
        self.max_frame_bytes = check_int("max_frame_bytes", max_frame_bytes, 64)
        self.spin_s = check_float("spin_s", spin_s, 0.0)  # the plain-TCP transport's poll before sleeping
        self.stream_reconnect = bool(stream_reconnect)  # False: a refused qtcp:// connection fails at once
        self._sleep = sleep
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._sock: zmq.Socket | None = None
        self._stream: StreamConnection | None = None
        self._move_before_next = False
        self._closed = False

    @property
    def address(self) -> str:
        """The server the next request goes to."""
        return self._current

    # --- calls --------------------------------------------------------------------------------------

    def call(self, method: str, *args: object, **kwargs: object) -> object:
        return self.invoke(method, args, kwargs)

    def invoke(self, method: str, args: Sequence[object] = (), kwargs: dict | None = None, *,
               timeout_s: float | None = None) -> object:
        """``call`` with the arguments as a sequence and a map, and an optional per-call timeout."""
        timeout = self.timeout_s if timeout_s is None else check_float("timeout_s", timeout_s, 0.0, lo_open=True)
        kwargs = {} if kwargs is None else kwargs
        with self._lock:
            if self._closed:
                raise RpcConnectionError(f"client for {self._current} is closed")
            if self._move_before_next:
                self._move()
            for attempt in itertools.count():
                rid = next(self._ids)
                frame = encode_request(self.codec, rid, method, args, kwargs)
                if len(frame) > self.max_frame_bytes:
                    raise RpcRejectedError(RpcErrorCode.FRAME_TOO_LARGE, f"{method}: request of {len(frame)} bytes "
                                           f"is past the client's max_frame_bytes={self.max_frame_bytes}")
                ok, payload = self._round_trip(frame, rid, method, timeout)
                if ok:
                    return payload
                exc = error_from_wire(self.codec, payload)  # type: ignore[arg-type]
                if attempt >= self.max_retries or not self._retryable(getattr(exc, "code", None)):
                    raise exc
                delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
                log.info("%s on %s: %s; retry %d/%d in %.3f s", method, self._current, exc, attempt + 1,
                         self.max_retries, delay)
                self._move()
                self._sleep(delay)
        raise AssertionError("unreachable")

    def _retryable(self, code: object) -> bool:
        if code is None:
            return False
        return code in self.retry_codes or getattr(code, "name", None) in self.retry_codes

    def _round_trip(self, frame: bytes, rid: int, method: str, timeout_s: float) -> tuple[bool, object]:
        if is_stream_address(self._current):
            return self._stream_round_trip(frame, rid, method, timeout_s)
        sock = self._socket()
        deadline = time.monotonic() + timeout_s
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:  # past the high-water mark: the peer is not draining
            self._timed_out()
            raise RpcTimeoutError(f"{method} to {self._current}: cannot queue the request (peer not reading)") \
                from None
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000.0 + 0.5)
            try:
                if remaining_ms <= 0:
                    raise zmq.Again()
                sock.setsockopt(zmq.RCVTIMEO, remaining_ms)
                data = sock.recv()
            except zmq.Again:
                self._timed_out()
                raise RpcTimeoutError(f"{method} to {self._current}: no reply within {timeout_s} s "
                                      f"(the request may or may not have run)") from None
            try:
                reply_id, ok, payload = parse_reply(self.codec, data)
            except Exception as e:  # not a reply of ours: keep waiting for one
                log.warning("%s: dropped a reply that does not parse: %s", self._current, e)
                continue
            # A refusal of a frame too damaged (or too large) to be read carries no id: it can only be ours,
            # the one request in flight on this socket.
            if reply_id == rid or (reply_id is None and not ok):
                return ok, payload
            log.debug("%s: dropped a stale reply %s (waiting for %d)", self._current, reply_id, rid)

    def _stream_round_trip(self, frame: bytes, rid: int, method: str, timeout_s: float) -> tuple[bool, object]:
        for fresh in (False, True):
            if self._stream is None:
                self._stream = StreamConnection(self._current, 4 * self.max_frame_bytes, self.spin_s,
                                                reconnect=self.stream_reconnect)
            try:
                data = self._stream.round_trip(frame, method, timeout_s)
            except RpcTimeoutError:
                self._timed_out()
                raise
            try:
                reply_id, ok, payload = parse_reply(self.codec, data)
            except Exception as e:  # the stream is out of step with us: start a fresh connection next time
                self._timed_out()
                raise RpcTimeoutError(f"{method} to {self._current}: a reply that does not parse ({e}); "
                                      f"the request may or may not have run") from None
            if reply_id is None and not ok and payload.get("code") in GOODBYE_CODES:  # type: ignore[union-attr]
                self._stream.close()  # the server closed the connection without reading the request
                self._stream = None
                if payload.get("code") is RpcErrorCode.IDLE_TIMEOUT and not fresh:  # type: ignore[union-attr]
                    log.debug("%s: %s crossed the server's idle-timeout goodbye; sending it again on a fresh "
                              "connection", self._current, method)
                    continue
                return ok, payload
            break
        if reply_id == rid or (reply_id is None and not ok):
            return ok, payload
        self._timed_out()  # replies on one connection come in order: another id means the stream is broken
        raise RpcTimeoutError(f"{method} to {self._current}: a reply to request {reply_id}, not {rid}; "
                              f"the request may or may not have run")

    # --- connection ---------------------------------------------------------------------------------

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, 20)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
            sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.max_frame_bytes)
            if "[" in self._current:
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(self._current)
            self._sock = sock
        return self._sock

    def _drop_socket(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _timed_out(self) -> None:
        self._drop_socket()
        self._move_before_next = len(self._addresses) > 1 or self.leader_finder is not None

    def _move(self) -> None:
        """Point at the leader ``leader_finder`` names, else at the next address in the list."""
        self._move_before_next = False
        target = None
        if self.leader_finder is not None:
            try:
                found = self.leader_finder()
                target = None if found is None else _normalize(found)
            except Exception as e:  # a registry that is down must not break the client: rotate instead
                log.warning("leader_finder failed (%s: %s); trying the next address", type(e).__name__, e)
        if target is None:
            i = self._addresses.index(self._current) if self._current in self._addresses else -1
            target = self._addresses[(i + 1) % len(self._addresses)]
        if target != self._current:
            self._drop_socket()
            self._current = target

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop_socket()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Callable[..., object]:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    def __repr__(self) -> str:
        return f"RpcClient({self._current!r}, addresses={self._addresses}, timeout_s={self.timeout_s})"


class _Method:
    """``client.name``: calls ``client.call(name, ...)``."""

    __slots__ = ("_client", "__name__")

    def __init__(self, client: RpcClient | InProcessClient, name: str) -> None:
        self._client = client
        self.__name__ = name

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self._client.call(self.__name__, *args, **kwargs)


class InProcessClient:
    """The embedded default: ``target``'s whitelisted ``methods`` called in-process, with the RPC client's API. The
    whitelist, the ``UNKNOWN_METHOD`` and ``BAD_ARGUMENTS`` refusals are a server's own (its ``Dispatcher``)."""

    def __init__(self, target: object, methods: list[str], *, codec: Codec | None = None,
                 roundtrip: bool = True) -> None:
        self.codec = DEFAULT_CODEC if codec is None else codec
        self._dispatcher = Dispatcher(target, methods, self.codec, DEFAULT_MAX_FRAME_BYTES, "in-process")
        self.roundtrip = roundtrip

    def call(self, method: str, *args: object, **kwargs: object) -> object:
        dispatcher = self._dispatcher
        fn = dispatcher.handler(method)
        if fn is None:
            raise dispatcher.unknown_method(method)
        codec = self.codec
        if self.roundtrip:
            args, kwargs = codec.decode(codec.encode([list(args), kwargs]))  # type: ignore[misc]
        try:
            value = fn(*args, **kwargs)
        except TypeError as e:  # arguments that do not bind (refused as a server refuses them), or the method's own
            refusal = dispatcher.bind_error(method, args, kwargs)
            if refusal is not None:
                raise refusal from None
            self._raise(e)
        except Exception as e:
            self._raise(e)
        return codec.decode(codec.encode(value)) if self.roundtrip else value

    def _raise(self, exc: Exception) -> None:
        """Raise the method's exception: as the client of a server would get it (through the codec) when
        ``roundtrip``, else itself."""
        if not self.roundtrip:
            raise exc
        codec = self.codec
        raise error_from_wire(codec, codec.decode(codec.encode(error_to_wire(codec, exc)))) from exc  # type: ignore

    def invoke(self, method: str, args: Sequence[object] = (), kwargs: dict | None = None, *,
               timeout_s: float | None = None) -> object:
        return self.call(method, *args, **(kwargs or {}))

    def close(self) -> None:
        pass

    def __enter__(self) -> InProcessClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Callable[..., object]:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)
