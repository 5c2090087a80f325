"""The frames on the wire: one request, one reply, both msgpack arrays that start with the protocol version.

Contract:
- Request: ``[PROTOCOL_VERSION, request_id, method, args, kwargs]`` (``request_id`` an int in ``[0, 2**64)``,
  ``method`` a str, ``args`` an array, ``kwargs`` a map with str keys). The version comes first so any later
  version can be recognised, and refused, by this one.
- Reply: ``[PROTOCOL_VERSION, request_id, ok, payload]``; ``ok`` true: ``payload`` is the method's value; false:
  ``payload`` is ``{"code", "type", "message"}`` plus, when the codec can encode them, the exception's ``args``
  and its instance ``attrs``. ``request_id`` is ``None`` when the request was too damaged to carry one.
- ``parse_request`` refuses a bad frame with :class:`RpcRejectedError` (code ``BAD_FRAME``, ``BAD_VERSION``,
  ``MISSING_FIELD`` or ``FRAME_TOO_LARGE``) carrying the request id when one could be read; ``parse_reply``
  raises :class:`RpcProtocolError` for a reply that is not a reply.
- ``parse_request`` quotes a field it refuses with :func:`~quillcache.rpc.errors.quote` (at most
  ``MAX_QUOTE_CHARS`` of it), and ``error_to_wire`` cuts the message and every str among the exception's ``args``
  and ``attrs`` to ``MAX_MESSAGE_CHARS`` (:func:`~quillcache.rpc.errors.clip`), so an error reply stays small
  whatever the request carried or the method put in its message.
- Every error gets its reply: ``error_to_wire`` writes a str that UTF-8 cannot carry (a lone surrogate, e.g. from
  a non-UTF-8 file name) with backslash escapes, and when the error map still cannot be built or encoded (an
  exception whose ``__str__`` raises) ``encode_error_reply`` sends the exception's type alone, with a message
  saying so (a warning is logged), which the client raises as :class:`RpcRemoteError`.
- ``error_to_wire`` / ``error_from_wire``: a registered exception class (nearest registered ancestor in the MRO)
  comes back as that class, rebuilt the way ``pickle`` rebuilds exceptions (``cls(*args)``, then its instance
  attributes), falling back to ``cls.__new__`` with the message when its constructor refuses the args; its
  ``code`` is always restored. Any other exception comes back as :class:`RpcRemoteError`. A ``code`` that the
  codec cannot encode (an unregistered enum) travels as the string ``"EnumName.MEMBER"``.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from quillcache.rpc.codec import Codec
from quillcache.rpc.errors import (RpcEncodeError, RpcErrorCode, RpcProtocolError, RpcRejectedError,
                                   RpcRemoteError, clip, quote)

__all__ = ["PROTOCOL_VERSION", "REQUEST_FIELDS", "Request", "encode_error_reply", "encode_ok_reply",
           "encode_request", "error_from_wire", "error_to_wire", "parse_reply", "parse_request"]

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
REQUEST_FIELDS = ("version", "request_id", "method", "args", "kwargs")
_MAX_REQUEST_ID = 2**64 - 1


@dataclass(slots=True)
class Request:
    request_id: int
    method: str
    args: list
    kwargs: dict


def encode_request(codec: Codec, request_id: int, method: str, args: tuple | list, kwargs: dict) -> bytes:
    return codec.encode([PROTOCOL_VERSION, request_id, method, list(args), kwargs])


def parse_request(codec: Codec, data: bytes | memoryview, max_frame_bytes: int) -> Request:
    """The request in ``data``, or :class:`RpcRejectedError` naming what is wrong with it."""
    if len(data) > max_frame_bytes:
        raise _refuse(RpcErrorCode.FRAME_TOO_LARGE, f"frame of {len(data)} bytes is past the server's "
                                                    f"max_frame_bytes={max_frame_bytes}")
    try:
        frame = codec.decode(data)
    except RpcProtocolError as e:
        raise _refuse(RpcErrorCode.BAD_FRAME, str(e)) from None
    if not isinstance(frame, list):
        raise _refuse(RpcErrorCode.BAD_FRAME, f"a request is an array {list(REQUEST_FIELDS)}, "
                                              f"got a {type(frame).__name__}")
    rid = frame[1] if len(frame) > 1 and type(frame[1]) is int and 0 <= frame[1] <= _MAX_REQUEST_ID else None
    if not frame:
        raise _refuse(RpcErrorCode.MISSING_FIELD, f"empty request; fields are {list(REQUEST_FIELDS)}")
    if frame[0] != PROTOCOL_VERSION or type(frame[0]) is not int:
        raise _refuse(RpcErrorCode.BAD_VERSION, f"protocol version {quote(frame[0])} is not spoken here "
                                                f"(this server speaks {PROTOCOL_VERSION})", rid)
    if len(frame) != len(REQUEST_FIELDS):
        if len(frame) < len(REQUEST_FIELDS):
            raise _refuse(RpcErrorCode.MISSING_FIELD, f"request lacks field(s) {list(REQUEST_FIELDS[len(frame):])}",
                          rid)
        raise _refuse(RpcErrorCode.BAD_FRAME, f"request has {len(frame)} fields, not {len(REQUEST_FIELDS)}", rid)
    _, raw_rid, method, args, kwargs = frame
    if rid is None:
        raise _refuse(RpcErrorCode.BAD_FRAME, f"request_id must be an int in [0, 2**64), got {quote(raw_rid)}")
    if not isinstance(method, str):
        raise _refuse(RpcErrorCode.BAD_FRAME, f"method must be a str, got {type(method).__name__}", rid)
    if not isinstance(args, list):
        raise _refuse(RpcErrorCode.BAD_FRAME, f"args must be an array, got {type(args).__name__}", rid)
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise _refuse(RpcErrorCode.BAD_FRAME, "kwargs must be a map with str keys", rid)
    return Request(rid, method, args, kwargs)


def _refuse(code: RpcErrorCode, message: str, request_id: int | None = None) -> RpcRejectedError:
    err = RpcRejectedError(code, message)
    err.request_id = request_id  # type: ignore[attr-defined]
    return err


def encode_ok_reply(codec: Codec, request_id: int | None, value: object) -> bytes:
    return codec.encode([PROTOCOL_VERSION, request_id, True, value])


def encode_error_reply(codec: Codec, request_id: int | None, exc: BaseException) -> bytes:
    """The error reply for ``exc`` (``error_to_wire``); never raises for what ``exc`` holds: when its map cannot be
    built or encoded (a ``__str__`` that raises...), the reply names only its type (module docstring)."""
    try:
        return codec.encode([PROTOCOL_VERSION, request_id, False, error_to_wire(codec, exc)])
    except Exception as e:
        log.warning("an error reply for %s could not be encoded (%s: %s); sending its type only",
                    type(exc).__qualname__, type(e).__name__, e)
        return codec.encode([PROTOCOL_VERSION, request_id, False, {
            "code": None, "type": _wire_str(_type_name(type(exc))),
            "message": f"(its message could not be sent: {type(e).__name__})"}])


def parse_reply(codec: Codec, data: bytes | memoryview) -> tuple[int | None, bool, object]:
    """``(request_id, ok, payload)``; :class:`RpcProtocolError` for anything that is not a reply."""
    frame = codec.decode(data)
    if not (isinstance(frame, list) and len(frame) == 4 and frame[0] == PROTOCOL_VERSION
            and (frame[1] is None or type(frame[1]) is int) and isinstance(frame[2], bool)):
        raise RpcProtocolError(f"not a version-{PROTOCOL_VERSION} reply [version, request_id, ok, payload]: "
                               f"{quote(frame)}")
    if not frame[2] and not (isinstance(frame[3], dict) and isinstance(frame[3].get("type"), str)
                             and isinstance(frame[3].get("message"), str)):
        raise RpcProtocolError(f"error reply without type and message: {quote(frame[3])}")
    return frame[1], frame[2], frame[3]


def error_to_wire(codec: Codec, exc: BaseException) -> dict:
    """The error map for ``exc``: ``code``, ``type``, ``message``, and ``args``/``attrs`` when they encode; the
    message and each str among ``args`` and ``attrs`` cut to ``MAX_MESSAGE_CHARS`` (module docstring)."""
    tag = codec.error_tag(type(exc))
    code = getattr(exc, "code", None)
    if code is not None and not _encodes(codec, code):
        code = _wire_str(f"{type(code).__name__}.{code.name}" if isinstance(code, enum.Enum) else str(code))
    out: dict = {"code": code, "message": _wire_str(clip(str(exc)))}
    if tag is None:
        out["type"] = _wire_str(_type_name(type(exc)))
        return out
    out["type"] = tag
    args = [_wire_str(clip(a)) if type(a) is str else a for a in exc.args]
    if _encodes(codec, args):
        out["args"] = args
    attrs = {k: _wire_str(clip(v)) if type(v) is str else v for k, v in getattr(exc, "__dict__", {}).items()
             if not k.startswith("_")}
    if attrs and _encodes(codec, attrs):
        out["attrs"] = attrs
    return out


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _wire_str(text: str) -> str:
    """``text`` when UTF-8 can carry it; else with each character it cannot (a lone surrogate: a non-UTF-8 file
    name decoded with ``surrogateescape``) as its backslash escape."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _encodes(codec: Codec, value: object) -> bool:
    try:
        codec.encode(value)
    except RpcEncodeError:
        return False
    return True


def error_from_wire(codec: Codec, payload: dict) -> BaseException:
    """The exception an error map stands for (see the module docstring)."""
    message, code = payload["message"], payload.get("code")
    cls = codec.error_class(payload["type"])
    if cls is None:
        return RpcRemoteError(payload["type"], message, code)
    args = payload.get("args")
    exc = None
    if isinstance(args, list):
        try:
            exc = cls(*args)
        except Exception:
            exc = None
    if exc is None:
        exc = cls.__new__(cls)
        exc.args = (message,)
    attrs = payload.get("attrs")
    for key, value in (attrs.items() if isinstance(attrs, dict) else ()):
        try:
            setattr(exc, key, value)
        except (AttributeError, TypeError):
            pass
    if code is not None and getattr(exc, "code", None) != code:
        try:
            exc.code = code
        except AttributeError:
            pass
    return exc
