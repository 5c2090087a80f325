"""Limits on what one HTTP client may hold of a server: the uvicorn protocol both HTTP servers run.

uvicorn's httptools protocol bounds a request body only through the application and never times
out a request that stalls: a connection that sends nothing, stops half-way through its headers or
its body, or sends headers without end keeps a connection slot (and, for a huge head, costs parse
time that grows with its size) for as long as the client likes. ``guarded_protocol(guard)`` is
that protocol with three limits (``HttpGuard``):

- **head size**: the request line and headers of one request may span at most ``max_head_bytes``
  (bytes received while a head is incomplete, so at most one read past it is parsed); above it the
  server answers ``431`` naming the limit and closes the connection;
- **head time**: a head must be complete within ``head_timeout_s`` of its first byte; a new
  connection must complete its first head within ``head_timeout_s`` of connecting. Otherwise
  ``408`` and close. Between requests on a kept-alive connection uvicorn's own keep-alive timeout
  applies (no head started: nothing is owed);
- **body time**: a body must arrive with no silence longer than ``body_timeout_s``. Otherwise the
  connection is closed, with ``408`` if no response was started (the application sees a
  disconnect).

Invariants: a request that stays within the limits is served exactly as by uvicorn's protocol
(this class only adds checks around ``data_received`` and the parser's head/body callbacks). A
refused connection gets its answer, is half-closed, and is closed ``LINGER_S`` later (what the
client still sends meanwhile is dropped, so the answer is not lost to a reset): it holds no slot.
The timers are cancelled when the connection closes. A streaming response is never cut: no timer
runs while the server is the one sending.
"""

from __future__ import annotations

from dataclasses import dataclass

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from quillcache._checks import check_float, check_int

__all__ = ["DEFAULT_GUARD", "HttpGuard", "guarded_protocol"]

MAX_HEAD_BYTES = 64 << 10  # request line + headers of one request (nginx's large buffers: 4 x 8 KiB)
HEAD_TIMEOUT_S = 15.0  # first byte of a head (or the connection) -> the end of the head
BODY_TIMEOUT_S = 60.0  # longest silence while a request body is arriving
LINGER_S = 1.0  # after a refusal: input is read and dropped this long before the connection closes


@dataclass(frozen=True, kw_only=True)
class HttpGuard:
    """The limits of ``guarded_protocol`` (module doc); ``ValueError`` names a bad one."""

    max_head_bytes: int = MAX_HEAD_BYTES
    head_timeout_s: float = HEAD_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S

    def __post_init__(self) -> None:
        check_int("max_head_bytes", self.max_head_bytes, 256)
        check_float("head_timeout_s", self.head_timeout_s, 0.0, lo_open=True)
        check_float("body_timeout_s", self.body_timeout_s, 0.0, lo_open=True)


DEFAULT_GUARD = HttpGuard()


def _plain_response(status: int, reason: str, message: str) -> bytes:
    body = message.encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class _HeadTooLarge(Exception):
    """Raised from the parser's head callback: httptools stops and re-raises it wrapped."""


class _GuardedProtocol(HttpToolsProtocol):
    """uvicorn's ``HttpToolsProtocol`` with ``guard``'s limits (module doc)."""

    guard: HttpGuard = DEFAULT_GUARD

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._awaiting_head = True  # no head in progress, or one incomplete: head bytes count
        self._head_bytes = 0
        self._awaiting_body = False  # headers complete, body not yet
        self._timer = None  # the one running deadline (head or body, or the lingering close), if any
        self._discarding = False  # refused and half-closed: input is dropped

    # -- timers ----------------------------------------------------------------------------------
    def _arm(self, delay_s: float, handler) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay_s, handler)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _refuse(self, status: int, reason: str, message: str) -> None:
        self._disarm()
        if self.transport.is_closing():
            return
        self.logger.info("%s: %s", self.client and "%s:%d" % self.client, message)  # per client: not a warning
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.response_started:
            self.transport.write(_plain_response(status, reason, message))
        if cycle is not None and not cycle.response_complete:  # the application sees a disconnect, writes nothing
            cycle.disconnected = True
            cycle.message_event.set()
        # lingering close: closing with unread input would reset the connection and could destroy the answer
        # before the client reads it, so send FIN, drop what still arrives, and close after LINGER_S
        self._discarding = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._timer = self.loop.call_later(LINGER_S, self.transport.close)

    def _head_timed_out(self) -> None:
        self._timer = None
        if self._awaiting_head:
            self._refuse(408, "Request Timeout",
                         f"request head not complete within {self.guard.head_timeout_s:g} s")

    def _body_timed_out(self) -> None:
        self._timer = None
        if self._awaiting_body:
            self._refuse(408, "Request Timeout",
                         f"request body silent for {self.guard.body_timeout_s:g} s before it was complete")

    # -- protocol --------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.guard.head_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._discarding:  # refused: what still arrives is dropped until the lingering close
            return
        if self._awaiting_head:
            if self._head_bytes == 0 and self._timer is None:  # the first byte of a new head
                self._arm(self.guard.head_timeout_s, self._head_timed_out)
            self._head_bytes += len(data)
        elif self._awaiting_body:
            self._arm(self.guard.body_timeout_s, self._body_timed_out)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if isinstance(exc.__cause__ or exc.__context__, _HeadTooLarge):
                self._refuse(431, "Request Header Fields Too Large",
                             f"request line and headers over {self.guard.max_head_bytes} bytes")
                return
            msg = f"Invalid HTTP request received: {exc}".encode("ascii", "replace").decode()[:200]
            self._refuse(400, "Bad Request", msg)
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        if self._awaiting_head and self._head_bytes > self.guard.max_head_bytes:
            self._refuse(431, "Request Header Fields Too Large",
                         f"request line and headers over {self.guard.max_head_bytes} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._awaiting_head = True

    def on_headers_complete(self) -> None:
        # a head that arrived whole in one read is measured here (request line + header lines)
        size = len(self.url) + 16 + sum(len(k) + len(v) + 4 for k, v in self.headers)
        if size > self.guard.max_head_bytes:
            raise _HeadTooLarge(size)  # stops the parser; data_received answers 431
        self._awaiting_head = False
        self._head_bytes = 0
        self._awaiting_body = True
        self._arm(self.guard.body_timeout_s, self._body_timed_out)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._awaiting_body = False
        self._awaiting_head = True  # the next request's head (if any) counts from its first byte
        self._disarm()
        super().on_message_complete()


def guarded_protocol(guard: HttpGuard = DEFAULT_GUARD) -> type[HttpToolsProtocol]:
    """A uvicorn ``http=`` protocol class enforcing ``guard`` (module doc)."""
    if not isinstance(guard, HttpGuard):
        raise TypeError(f"guard must be an HttpGuard, got {type(guard).__name__}")
    return type("GuardedHttpToolsProtocol", (_GuardedProtocol,), {"guard": guard})
