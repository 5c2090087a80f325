"""``Dispatcher``: one request frame in, one reply frame out — the part of serving that every transport shares.

Contract:
- ``Dispatcher(target, methods)`` serves exactly ``methods`` of ``target`` (public callable attributes, checked at
  construction: ``ValueError`` naming the offenders).
- ``handle(data)`` returns the reply frame for request frame ``data``, never raises for anything a peer sends:
  a refused frame (``RpcErrorCode``: bad frame, wrong version, missing field, past ``max_frame_bytes``, unknown
  method, arguments that do not bind) gets an error reply naming the problem; an exception from the method gets
  an error reply (``wire.error_to_wire``; one whose message cannot be encoded still gets one,
  ``wire.encode_error_reply``); a result the codec cannot encode gets ``UNENCODABLE_RESULT``.
- ``handler(method)`` is the served callable (None when not served: ``unknown_method(method)`` is the refusal)
  and ``bind_error(method, args, kwargs)`` the ``BAD_ARGUMENTS`` refusal of arguments that do not bind to it:
  ``InProcessClient`` calls through these, so it serves and refuses exactly as a server does.
- ``refuse(code, message)`` is the reply for a frame a transport refused before decoding (no request id).
- ``num_requests`` counts frames handled or refused; ``num_refused`` those answered with an ``RpcErrorCode``.
- It holds no lock of its own: the transport decides how calls reach ``target`` (both servers of this package make
  them reach it one at a time). ``handle(data, lock)`` decodes the frame before taking ``lock`` and holds it for
  the counters, the call and the encoding of the reply, so decoding a large frame never holds up other callers.
- What a request makes the server hold: a frame of at least ``codec.BUDGET_FRAME_BYTES`` is decoded under the
  codec's request limits (:meth:`~quillcache.rpc.codec.Codec.request_limits`: its containers and nested extension
  payloads are bounded by a multiple of its size, a frame past them is refused ``BAD_FRAME`` naming the limit),
  and at most ``max_large_decodes`` such frames are handled at once (a semaphore taken before decoding and given
  back once the reply is encoded; others wait for it before decoding), so however many connections send large
  frames, only that many decoded values are held. A refused frame's decoded value is let go before the refusal
  waits for ``lock``.
- A refusal quotes what it refuses with :func:`~quillcache.rpc.errors.quote` (a method name, an argument name),
  so the reply and its log line stay small whatever the frame held.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import ContextManager

from quillcache._checks import check_int
from quillcache.rpc.codec import BUDGET_FRAME_BYTES, Codec
from quillcache.rpc.errors import (MAX_QUOTE_CHARS, RpcEncodeError, RpcErrorCode, RpcRejectedError, clip, quote,
                                   quote_each)
from quillcache.rpc.wire import Request, encode_error_reply, encode_ok_reply, parse_request

__all__ = ["DEFAULT_MAX_LARGE_DECODES", "Dispatcher", "check_methods"]

log = logging.getLogger(__name__)

_MAX_BIND_ERROR_CHARS = 2 * MAX_QUOTE_CHARS  # Python's "cannot bind" text, which quotes a keyword the peer sent
# Frames of at least BUDGET_FRAME_BYTES handled at once: one can decode while another is being called (the servers
# call one at a time), and no more decoded values are held whatever the number of connections.
DEFAULT_MAX_LARGE_DECODES = 2


def check_methods(target: object, methods: list[str]) -> None:
    """``ValueError`` unless ``methods`` is a non-empty list of ``target``'s public callable attributes."""
    if isinstance(methods, str) or not methods:
        raise ValueError(f"methods must be a non-empty list of method names, got {methods!r}")
    bad = sorted(m for m in methods if not isinstance(m, str) or not m or m.startswith("_")
                 or not callable(getattr(target, m, None)))
    if bad:
        raise ValueError(f"cannot serve {bad} of {type(target).__name__}: each method must be a public callable "
                         f"attribute")


class Dispatcher:
    """Decode, call, encode; see the module docstring."""

    def __init__(self, target: object, methods: list[str], codec: Codec, max_frame_bytes: int,
                 name: str = "rpc", max_large_decodes: int = DEFAULT_MAX_LARGE_DECODES) -> None:
        check_methods(target, methods)
        self.codec = codec
        self.max_frame_bytes = max_frame_bytes
        self.name = name
        self.max_large_decodes = check_int("max_large_decodes", max_large_decodes, 1)
        self._large = threading.BoundedSemaphore(self.max_large_decodes)
        self._handlers = {m: getattr(target, m) for m in methods}
        self._signatures: dict[str, inspect.Signature | None] = {}
        for m, fn in self._handlers.items():
            try:
                self._signatures[m] = inspect.signature(fn)
            except (TypeError, ValueError):
                self._signatures[m] = None
        self.served = sorted(self._handlers)
        self.num_requests = 0
        self.num_refused = 0

    def refuse(self, code: RpcErrorCode, message: str) -> bytes:
        """The reply to a frame refused before it could be read (no request id)."""
        self.num_requests += 1
        self.num_refused += 1
        log.warning("%s: refused a frame: %s: %s", self.name, code.value, message)
        return encode_error_reply(self.codec, None, RpcRejectedError(code, message))

    def handler(self, method: str) -> Callable[..., object] | None:
        """The served callable named ``method``; None when it is not served."""
        return self._handlers.get(method)

    def unknown_method(self, method: object) -> RpcRejectedError:
        """The ``UNKNOWN_METHOD`` refusal of ``method``, naming the served ones."""
        return RpcRejectedError(RpcErrorCode.UNKNOWN_METHOD,
                                f"method {quote(method)} is not served here; served: {self.served}")

    def bind_error(self, method: str, args: Sequence[object], kwargs: dict) -> RpcRejectedError | None:
        """``BAD_ARGUMENTS`` when ``args``/``kwargs`` do not bind to served ``method`` (checked only after a
        TypeError, so the hot path pays nothing); None when they bind, i.e. the TypeError was the method's own."""
        sig = self._signatures[method]
        if sig is None:
            return None
        params = sig.parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):  # Python's message would quote them whole
            unknown = [k for k in kwargs if k not in params or params[k].kind is params[k].POSITIONAL_ONLY]
            if unknown:
                return RpcRejectedError(RpcErrorCode.BAD_ARGUMENTS,
                                        f"{method}: got an unexpected keyword argument {quote_each(unknown)}")
        try:
            sig.bind(*args, **kwargs)
        except TypeError as e:
            return RpcRejectedError(RpcErrorCode.BAD_ARGUMENTS, f"{method}: {clip(str(e), _MAX_BIND_ERROR_CHARS)}")
        return None

    def handle(self, data: bytes | memoryview, lock: ContextManager[object] | None = None) -> bytes:
        """The reply frame to request frame ``data`` (module docstring); ``lock`` held for everything after
        decoding. A frame of at least ``BUDGET_FRAME_BYTES`` waits for one of ``max_large_decodes`` slots first."""
        if len(data) < BUDGET_FRAME_BYTES:
            return self._handle(data, lock)
        with self._large:
            return self._handle(data, lock)

    def _handle(self, data: bytes | memoryview, lock: ContextManager[object] | None) -> bytes:
        parsed = self._parse(data)
        with nullcontext() if lock is None else lock:
            self.num_requests += 1
            if isinstance(parsed, RpcRejectedError):
                self.num_refused += 1
                log.warning("%s: refused a request: %s", self.name, parsed)
                return encode_error_reply(self.codec, getattr(parsed, "request_id", None), parsed)
            return self._call(*parsed)

    def _parse(self, data: bytes | memoryview) -> tuple[Request, object] | RpcRejectedError:
        """``(request, handler)``, or the refusal (its ``request_id`` attribute set when one was read). Touches no
        state of this object, so it may run outside the transport's lock."""
        try:
            if len(data) < BUDGET_FRAME_BYTES:
                req = parse_request(self.codec, data, self.max_frame_bytes)
            else:
                with self.codec.request_limits():
                    req = parse_request(self.codec, data, self.max_frame_bytes)
        except RpcRejectedError as e:
            e.__context__ = None  # a decoding error's frames hold what it had decoded (an extension's payload)
            return e.with_traceback(None)  # and this one's hold parse_request's, i.e. the decoded value
        fn = self._handlers.get(req.method)
        if fn is None:
            e = self.unknown_method(req.method)
            e.request_id = req.request_id  # type: ignore[attr-defined]
            return e
        return req, fn

    def _call(self, req: Request, fn) -> bytes:
        codec = self.codec
        try:
            value = fn(*req.args, **req.kwargs)
        except TypeError as e:  # arguments that do not bind, or a TypeError of the method's own
            refusal = self.bind_error(req.method, req.args, req.kwargs)
            if refusal is not None:
                self.num_refused += 1
            return encode_error_reply(codec, req.request_id, refusal or e)
        except Exception as e:
            return encode_error_reply(codec, req.request_id, e)
        try:
            return encode_ok_reply(codec, req.request_id, value)
        except RpcEncodeError as e:
            return encode_error_reply(codec, req.request_id, RpcRejectedError(
                RpcErrorCode.UNENCODABLE_RESULT, f"{req.method} returned a value the codec cannot encode: {e}"))
