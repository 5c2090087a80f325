"""``RpcServer``: serve a whitelist of one object's methods over TCP (a ZeroMQ ROUTER socket).

Contract:
- ``RpcServer(target, methods)`` serves exactly ``methods`` of ``target``: each must be a public (no leading
  ``_``) callable attribute, checked at construction (``ValueError`` naming the offenders). A request for any other
  name is refused with ``UNKNOWN_METHOD`` listing the served ones.
- ``start()`` binds ``tcp://host:port`` (``port=0``: a free port; see ``address`` / ``port``) and starts ONE serving
  thread that decodes, calls and replies. Calls therefore reach ``target`` one at a time, in arrival order: the
  target needs no lock for calls that come through one server (in-process callers are its own business).
  ``close()`` stops the thread and unbinds, so a new server can bind the same port at once; the context manager
  starts on enter and closes on exit.
- Every request gets exactly one reply unless no reply is possible: a refused frame (``RpcErrorCode``: bad frame,
  wrong version, missing field, frame past ``max_frame_bytes``, unknown method, arguments that do not bind) gets an
  error reply naming the problem; an exception from the method gets an error reply (``wire.error_to_wire``); a
  result the codec cannot encode gets ``UNENCODABLE_RESULT``. A message with no identity frame is dropped with a
  log line. Nothing a peer sends stops the serving thread.
- ``drop_frame_bytes`` bounds each FRAME, not each message: a frame past it is cut by libzmq (``ZMQ_MAXMSGSIZE``,
  a per-frame limit: the peer is disconnected, the frame never buffered), but ZeroMQ delivers a multipart message
  whole, so a message of many frames, each under the limit, is buffered by libzmq (up to its whole size) before it
  is refused ``BAD_FRAME`` (a request is one frame); reading its frames one at a time here would not bound that.
  Serve peers that are not trusted over ``qtcp://`` (:class:`~quillcache.rpc.stream.StreamServer`), where a
  request is one length-prefixed frame and ``drop_frame_bytes`` bounds the bytes it makes the server buffer.
- What a request's decoded value holds is not bounded by those byte limits: msgpack builds one Python object per
  value, each many times its bytes on the wire. Both servers decode under the dispatcher's bounds
  (:mod:`quillcache.rpc.dispatch`): a frame of at least ``codec.BUDGET_FRAME_BYTES`` builds at most a fixed
  number of containers and extension payload bytes per frame byte (past them it is refused ``BAD_FRAME`` while
  it decodes; see :mod:`quillcache.rpc.codec`), so its value is at most one object per byte of frame; and at most
  ``max_large_decodes`` such frames per server are decoded or held at once. Lower ``max_frame_bytes`` where peers
  are not trusted and send small requests.
- ``after_reply`` (optional): called on the serving thread after each reply is sent (e.g. work the target
  deferred until its caller has the answer); an exception there is logged.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import zmq

from quillcache._checks import check_int
from quillcache.rpc.codec import DEFAULT_CODEC, Codec
from quillcache.rpc.dispatch import Dispatcher, check_methods
from quillcache.rpc.errors import RpcErrorCode

__all__ = ["DEFAULT_MAX_FRAME_BYTES", "RpcServer"]

log = logging.getLogger(__name__)

DEFAULT_MAX_FRAME_BYTES = 64 << 20


class RpcServer:
    """Serves ``target``'s whitelisted ``methods``; see the module docstring for the contract."""

    def __init__(self, target: object, methods: list[str], host: str = "127.0.0.1", port: int = 0, *,
                 codec: Codec | None = None, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 drop_frame_bytes: int | None = None, name: str = "rpc",
                 after_reply: Callable[[], None] | None = None) -> None:
        """``drop_frame_bytes`` (default ``4 * max_frame_bytes``) is per ZeroMQ frame, not per message (module
        docstring)."""
        check_methods(target, methods)
        self.after_reply = after_reply  # called after each reply is sent (errors logged), e.g. deferred work
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
        self._ctx: zmq.Context | None = None
        self._thread: threading.Thread | None = None
        self._wake: zmq.Socket | None = None
        self._stop_id = b""
        self._close_lock = threading.Lock()

    @property
    def num_requests(self) -> int:
        """Frames received (served, refused or failed)."""
        return self.dispatcher.num_requests

    @property
    def num_refused(self) -> int:
        """Frames answered with an ``RpcErrorCode``."""
        return self.dispatcher.num_refused

    # --- lifecycle ----------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        if self._thread is None:
            raise RuntimeError("the server is not started; call start() (or use it as a context manager)")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    def start(self) -> RpcServer:
        if self._thread is not None:
            raise RuntimeError(f"server {self.name!r} is already started at {self.address}")
        ctx = zmq.Context()
        try:
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.MAXMSGSIZE, self.drop_frame_bytes)
            if ":" in self.host:
                router.setsockopt(zmq.IPV6, 1)
            host = f"[{self.host}]" if ":" in self.host else self.host
            router.bind(f"tcp://{host}:{self.port or '*'}")
            self.port = int(router.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
            # close() stops the serving thread with a message on an inproc endpoint of the same socket, from a
            # routing id no TCP peer can guess, so the thread can block in recv with no poller in the hot path.
            stop_addr = f"inproc://rpc-stop-{id(self)}-{self.port}"
            router.bind(stop_addr)
            self._stop_id = b"stop-" + os.urandom(16)
            self._wake = ctx.socket(zmq.DEALER)
            self._wake.setsockopt(zmq.LINGER, 0)
            self._wake.setsockopt(zmq.ROUTING_ID, self._stop_id)
            self._wake.connect(stop_addr)
        except BaseException:
            ctx.destroy(linger=0)
            raise
        self._ctx = ctx
        self._thread = threading.Thread(target=self._serve, args=(router,), daemon=True,
                                        name=f"{self.name}-server:{self.port}")
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and unbind (idempotent)."""
        with self._close_lock:
            if self._ctx is None:
                return
            assert self._wake is not None and self._thread is not None
            self._wake.send(b"")
            self._thread.join()
            self._wake.close()
            self._ctx.term()
            self._ctx = None

    def __enter__(self) -> RpcServer:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = self.address if self._thread is not None else "not started"
        return f"RpcServer({self.name!r}, {where}, methods={self.dispatcher.served})"

    # --- serving thread -----------------------------------------------------------------------------

    def _serve(self, router: zmq.Socket) -> None:
        stop_id = self._stop_id
        try:
            while True:
                frames = router.recv_multipart()
                if frames[0] == stop_id:
                    return
                try:
                    self._handle(router, frames)
                except Exception:  # never let one request end the serving thread
                    log.exception("%s: failed handling a request", self.name)
        finally:
            router.close(linger=0)

    def _handle(self, router: zmq.Socket, frames: list) -> None:
        if len(frames) < 2:
            self.dispatcher.num_requests += 1
            log.warning("%s: dropped a message of %d frame(s) with no identity and body", self.name, len(frames))
            return
        if len(frames) != 2:
            reply = self.dispatcher.refuse(RpcErrorCode.BAD_FRAME, f"a request is one frame, got {len(frames) - 1}")
        else:
            reply = self.dispatcher.handle(frames[1])
        router.send_multipart([frames[0], reply])
        if self.after_reply is not None:
            self.after_reply()  # (an exception is logged by _serve; the thread goes on)
