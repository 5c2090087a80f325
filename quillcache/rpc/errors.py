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
"""

from __future__ import annotations

import enum

__all__ = ["RpcConnectionError", "RpcEncodeError", "RpcError", "RpcErrorCode", "RpcProtocolError",
           "RpcRejectedError", "RpcRemoteError", "RpcTimeoutError"]


class RpcErrorCode(enum.Enum):
    """Why a server refused a request before (or instead of) running it."""

    BAD_FRAME = "BAD_FRAME"  # not a msgpack array of the request's fields, or a field of the wrong type
    BAD_VERSION = "BAD_VERSION"  # a protocol version this server does not speak
    MISSING_FIELD = "MISSING_FIELD"  # fewer fields than a request has
    FRAME_TOO_LARGE = "FRAME_TOO_LARGE"  # past the server's max_frame_bytes
    UNKNOWN_METHOD = "UNKNOWN_METHOD"  # not in the server's whitelist
    BAD_ARGUMENTS = "BAD_ARGUMENTS"  # the arguments do not bind to the method's signature
    UNENCODABLE_RESULT = "UNENCODABLE_RESULT"  # the method returned a value the codec cannot encode


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
