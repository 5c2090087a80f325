"""The RPC layer's own errors and the codes its server puts in a refusal.

Contract:
- Every error this package raises is an :class:`RpcError`. :class:`RpcProtocolError` is the ONLY error that
  decoding bytes raises (garbage, a truncated frame, an unknown type tag, a dataclass whose fields do not fit);
  :class:`RpcEncodeError` (also a ``TypeError``) is raised for a value the codec cannot encode.
- A server that refuses a request (bad frame, wrong version, missing field, frame too large, a method it does
  not serve, arguments that do not bind) replies with an :class:`RpcRejectedError` whose ``code`` is an
  :class:`RpcErrorCode`; the client raises it as such.
- A server-side exception whose class (or an ancestor) is registered (``register_error``) is raised client-side as
  that class, ``code`` included; any other is raised as :class:`RpcRemoteError` naming its type and message.
- :class:`RpcTimeoutError` means "no reply in time": the request may or may not have been executed.
- Untrusted values in messages are bounded: every message this package builds quotes a value a peer sent with
  :func:`quote` (its ``repr``, cut to :data:`MAX_QUOTE_CHARS` characters plus its type and length), so a refusal
  and its log line stay small whatever the peer sent; :func:`clip` cuts a whole message to
  :data:`MAX_MESSAGE_CHARS` (an :class:`RpcRejectedError`'s message, and every error message a server sends,
  ``wire.error_to_wire``). Both do work bounded by their limit, not by the value's size.
"""

from __future__ import annotations

import enum
import reprlib
from collections.abc import Iterable

__all__ = ["MAX_MESSAGE_CHARS", "MAX_QUOTE_CHARS", "RpcConnectionError", "RpcEncodeError", "RpcError",
           "RpcErrorCode", "RpcProtocolError", "RpcRejectedError", "RpcRemoteError", "RpcTimeoutError", "clip",
           "quote", "quote_each"]

MAX_QUOTE_CHARS = 80  # characters of one untrusted value's repr quoted in a message or a log line
MAX_MESSAGE_CHARS = 8192  # characters of one error message on the wire; above the master's messages for printable
#                           keys (at most 4096 characters), so those are never cut
_MAX_ITEMS = 8  # items of a container shown by quote()

_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = MAX_QUOTE_CHARS
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = _REPR.maxdeque = _MAX_ITEMS


def quote(value: object, max_chars: int = MAX_QUOTE_CHARS) -> str:
    """``repr(value)`` when it is short; else at most ``max_chars`` characters of it, ``...`` and the value's size
    (``'\\x00\\x00\\x00...' (a str of 4194304 characters)``). A str or bytes is sliced before its repr is taken and a
    container shows its first items only, so the work is bounded by ``max_chars``, not by the value."""
    sized = isinstance(value, (str, bytes, bytearray, list, tuple, dict, set, frozenset))
    if isinstance(value, (str, bytes, bytearray)):
        text = repr(value[:max_chars])
        long = len(value) > max_chars
    else:
        text = _REPR.repr(value)
        long = sized and len(value) > _MAX_ITEMS  # type: ignore[arg-type]
    if len(text) > max_chars:
        text, long = f"{text[:max_chars]}...", True
    if not (long and sized):
        return text
    n = len(value)  # type: ignore[arg-type]
    if isinstance(value, str):
        what = f"a str of {n} characters"
    elif isinstance(value, (bytes, bytearray)):
        what = f"{n} bytes"
    else:
        what = f"a {type(value).__name__} of {n} item{'' if n == 1 else 's'}"
    return f"{text} ({what})"


def quote_each(values: Iterable[object], max_items: int = _MAX_ITEMS) -> str:
    """The first ``max_items`` of ``values``, each by :func:`quote`, comma-separated, and how many more there are."""
    values = list(values)
    shown = ", ".join(quote(v) for v in values[:max_items])
    return shown if len(values) <= max_items else f"{shown} and {len(values) - max_items} more"


def clip(text: str, max_chars: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` when it has at most ``max_chars`` characters; else its first ``max_chars`` and how many were cut."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}... ({len(text) - max_chars} more characters)"


class RpcErrorCode(enum.Enum):
    """Why a server refused a request before (or instead of) running it."""

    BAD_FRAME = "BAD_FRAME"  # not a msgpack array of the request's fields, or a field of the wrong type
    BAD_VERSION = "BAD_VERSION"  # a protocol version this server does not speak
    MISSING_FIELD = "MISSING_FIELD"  # fewer fields than a request has
    FRAME_TOO_LARGE = "FRAME_TOO_LARGE"  # past the server's max_frame_bytes
    UNKNOWN_METHOD = "UNKNOWN_METHOD"  # not in the server's whitelist
    BAD_ARGUMENTS = "BAD_ARGUMENTS"  # the arguments do not bind to the method's signature
    UNENCODABLE_RESULT = "UNENCODABLE_RESULT"  # the method returned a value the codec cannot encode
    # The plain-TCP transport's goodbyes (request id None): the server closes the connection after sending one
    # and never reads what follows it, so a request that crossed it on the way was NOT run.
    IDLE_TIMEOUT = "IDLE_TIMEOUT"  # no complete request within the server's idle_timeout_s
    TOO_MANY_CONNECTIONS = "TOO_MANY_CONNECTIONS"  # the server holds max_connections already


class RpcError(Exception):
    """Base of every error of the RPC layer."""


class RpcProtocolError(RpcError):
    """Bytes that are not a valid frame or value (the only error decoding raises)."""


class RpcEncodeError(RpcError, TypeError):
    """A value the codec cannot encode (an unregistered dataclass or enum, an int past 64 bits, ...)."""


class RpcTimeoutError(RpcError, TimeoutError):
    """No reply within the timeout; the request may or may not have run on the server."""


class RpcConnectionError(RpcError, ConnectionError):
    """The client is closed or has no address to send to."""


class RpcRejectedError(RpcError):
    """The server refused the request; ``code`` (an :class:`RpcErrorCode`) says why."""

    def __init__(self, code: RpcErrorCode, message: str) -> None:
        message = clip(message) if isinstance(message, str) else message
        super().__init__(code, message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


class RpcRemoteError(RpcError):
    """A server-side exception of a class the client has not registered: its type name, message and code."""

    def __init__(self, remote_type: str, message: str, code: object = None) -> None:
        super().__init__(remote_type, message, code)
        self.remote_type = remote_type
        self.message = message
        self.code = code

    def __str__(self) -> str:
        code = "" if self.code is None else f" [{self.code}]"
        return f"remote {self.remote_type}{code}: {self.message}"
