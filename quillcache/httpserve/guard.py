"""Limits on what one HTTP client may hold of a server: the uvicorn protocol both HTTP servers run.

uvicorn's httptools protocol bounds a request body only through the application and never times
out a request that stalls: a connection that sends nothing, stops half-way through its headers or
its body, or sends headers without end keeps a connection slot (and, for a huge head, costs parse
time that grows with its size) for as long as the client likes. ``guarded_protocol(guard)`` is
that protocol with three limits (``HttpGuard``):

- **head size**: the request line and headers of one request may span at most ``max_head_bytes``,
  counted as the bytes received from the head's start up to and including the blank line that ends
  it (whitespace included; empty lines before a request line count too; a head that follows a
  chunked request body within the same read is charged that whole read, so it is never
  under-counted). A head still incomplete is checked after every read, so at most one read past
  the limit is parsed. Above it the server answers ``431`` naming the limit and closes the
  connection;
- **head time**: a head must be complete within ``head_timeout_s`` of its first byte; a new
  connection must complete its first head within ``head_timeout_s`` of connecting. Otherwise
  ``408`` and close. Between requests on a kept-alive connection uvicorn's own keep-alive timeout
  applies (no head started: nothing is owed);
- **body time**: a body must arrive with no silence longer than ``body_timeout_s``. Otherwise the
  connection is closed, with ``408`` if no response was started (the application sees a
  disconnect).

A response in flight is never cut by a later request: while the server still sends the response to
an earlier request, no head or body timer runs. What the client sends meanwhile (a stray CRLF, which
RFC 9112 2.2 lets a server ignore; a pipelined request, which uvicorn queues) is parsed and counted
as usual, and its deadlines start when that response is complete (the next request is dequeued).
A refusal decided meanwhile (a pipelined head over the size limit, malformed framing) is not written
into that response: input is dropped from then on, and the answer follows the response once it is
complete (a pipelined request the refusal concerns is never run).

Invariants: a request that stays within the limits is served exactly as by uvicorn's protocol
(this class only adds checks around ``data_received``, the parser's head/body callbacks and the
response-complete hook). A refused connection gets its answer, is half-closed, and is closed
``LINGER_S`` later (what the client still sends meanwhile is dropped, so the answer is not lost to a
reset): it holds no slot. The timers are cancelled when the connection closes. ``_refuse`` never
writes while another request's response is unfinished.
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
_HEAD_END = b"\r\n\r\n"  # llhttp requires CRLF line ends: a head ends at its first empty line


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
        self._head_bytes = 0  # bytes of the awaited head received in earlier reads
        self._head_begun = False  # the parser saw the awaited head's first byte (not just empty lines)
        self._head_tail = b""  # the last bytes of a begun head from earlier reads (an end split across reads)
        self._awaiting_body = False  # headers complete, body not yet
        self._body_contiguous = True  # the body is Content-Length framed: its bytes are exactly what on_body gets
        self._data = b""  # the read being parsed
        self._mark: int | None = 0  # where in _data the current head (or body) continues; None: unknown
        self._timer = None  # the one running deadline (head or body, or the lingering close), if any
        self._discarding = False  # refused and half-closed (or about to be): input is dropped
        self._running = None  # the cycle whose application uvicorn started last (its response may be in flight)
        self._deferred: tuple[int, str, str] | None = None  # a refusal waiting for the response in flight

    # -- timers ----------------------------------------------------------------------------------
    def _arm(self, delay_s: float, handler) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay_s, handler)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _response_in_flight(self) -> bool:
        running = self._running
        return running is not None and not running.response_complete

    def _earlier_response_in_flight(self) -> bool:
        """Whether a response to an earlier request than the one being read is still being sent."""
        return self._response_in_flight() and (self._awaiting_head or self._running is not self.cycle)

    def _refuse(self, status: int, reason: str, message: str) -> None:
        self._disarm()
        if self.transport.is_closing():
            return
        self.logger.info("%s: %s", self.client and "%s:%d" % self.client, message)  # per client: not a warning
        self._discarding = True
        cycle = self.cycle if self._awaiting_body else None  # the refused request's own cycle, if its head was whole
        if cycle is not None and not cycle.response_complete:  # the application sees a disconnect, writes nothing
            cycle.disconnected = True
            cycle.message_event.set()
            if self.pipeline and self.pipeline[0][0] is cycle:  # queued behind a response in flight: never run
                self.pipeline.popleft()
        if self._earlier_response_in_flight():
            self._deferred = (status, reason, message)  # answered once that response is complete
            return
        self._answer(status, reason, message, write=cycle is None or cycle.response_complete
                     or not cycle.response_started)

    def _answer(self, status: int, reason: str, message: str, *, write: bool = True) -> None:
        if write:
            self.transport.write(_plain_response(status, reason, message))
        # lingering close: closing with unread input would reset the connection and could destroy the answer
        # before the client reads it, so send FIN, drop what still arrives, and close after LINGER_S
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._arm(LINGER_S, self.transport.close)

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

    def _head_too_large(self) -> None:
        self._refuse(431, "Request Header Fields Too Large",
                     f"request line and headers over {self.guard.max_head_bytes} bytes")

    # -- head measurement ------------------------------------------------------------------------
    def _head_size(self) -> int:
        """Bytes of the head that just completed (module doc); moves ``_mark`` to its end."""
        data, mark = self._data, self._mark
        if mark is None:  # it follows a chunked body that ended in this read: charge the whole read
            return self._head_bytes + len(data)
        start = mark
        if self._head_tail:  # it began in an earlier read: its end may be split across the two
            i = (self._head_tail + data[:3]).find(_HEAD_END)
            if i >= 0:  # the blank line straddles the reads: the head ends 1 to 3 bytes into this one
                self._mark = i + 4 - len(self._head_tail)
                return self._head_bytes + self._mark - mark
        else:
            while start < len(data) and data[start] in b"\r\n":  # empty lines before the request line
                start += 1
        i = data.find(_HEAD_END, start)
        end = i + 4 if i >= 0 else len(data)  # not found: the parser completed a head this read does not end
        self._mark = end
        return self._head_bytes + end - mark

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
        self._unset_keepalive_if_required()
        self._data = data
        self._mark = 0 if self._awaiting_head or self._body_contiguous else None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if isinstance(exc.__cause__ or exc.__context__, _HeadTooLarge):
                self._head_too_large()
                return
            msg = f"Invalid HTTP request received: {exc}".encode("ascii", "replace").decode()[:200]
            self._refuse(400, "Bad Request", msg)
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self._disarm()  # the connection is a websocket's now: no HTTP deadline applies
                self.handle_websocket_upgrade()
                return
            self._unsupported_upgrade_warning()
        finally:
            self._data = b""
        if self._awaiting_head:  # a head is incomplete at the end of this read
            self._head_bytes += len(data) - (self._mark or 0)
            if self._head_begun:
                self._head_tail = (self._head_tail + data[-3:])[-3:]
            if self._head_bytes > self.guard.max_head_bytes:
                self._head_too_large()
            elif self._head_bytes and self._timer is None and not self._response_in_flight():
                self._arm(self.guard.head_timeout_s, self._head_timed_out)  # the first bytes of a new head
        elif self._awaiting_body and not self._earlier_response_in_flight():
            self._arm(self.guard.body_timeout_s, self._body_timed_out)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._awaiting_head = True
        self._head_begun = True

    def on_headers_complete(self) -> None:
        size = self._head_size()
        if size > self.guard.max_head_bytes:
            raise _HeadTooLarge(size)  # stops the parser; data_received answers 431
        queued = self.cycle is not None and not self.cycle.response_complete  # uvicorn's test: queued behind it
        self._awaiting_head, self._head_begun = False, False
        self._head_bytes, self._head_tail = 0, b""
        self._awaiting_body = True
        self._body_contiguous = not any(name == b"transfer-encoding" for name, _ in self.headers)
        if not self._body_contiguous:
            self._mark = None  # chunk framing is not reported: where the body ends in this read is unknown
        if queued:
            self._disarm()  # its body deadline starts when the response in flight is complete
        else:
            self._arm(self.guard.body_timeout_s, self._body_timed_out)
        super().on_headers_complete()
        if not queued:
            self._running = self.cycle

    def on_body(self, body: bytes) -> None:
        if self._mark is not None:
            self._mark += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._awaiting_body = False
        self._awaiting_head = True  # the next request's head (if any) counts from its first byte
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        queued = self.pipeline[-1][0] if self.pipeline else None  # the next request uvicorn will start
        super().on_response_complete()
        if queued is not None and not (self.pipeline and self.pipeline[-1][0] is queued):
            self._running = queued  # uvicorn started it
        if self.transport.is_closing():
            return
        if self._response_in_flight():  # a queued request runs now
            if not self._discarding and self._awaiting_body and self._running is self.cycle:
                self._arm(self.guard.body_timeout_s, self._body_timed_out)  # its body is still arriving
            return
        # nothing is being sent any more: what the client sent meanwhile gets its answer or its deadline now
        if self._deferred is not None:
            self._unset_keepalive_if_required()
            self._answer(*self._deferred)
            self._deferred = None
        elif self._discarding:
            return
        elif self._awaiting_body:
            if self._timer is None:
                self._arm(self.guard.body_timeout_s, self._body_timed_out)
        elif self._head_bytes and self._timer is None:
            self._unset_keepalive_if_required()  # a head has begun: the head deadline, not keep-alive, applies
            self._arm(self.guard.head_timeout_s, self._head_timed_out)


def guarded_protocol(guard: HttpGuard = DEFAULT_GUARD) -> type[HttpToolsProtocol]:
    """A uvicorn ``http=`` protocol class enforcing ``guard`` (module doc)."""
    if not isinstance(guard, HttpGuard):
        raise TypeError(f"guard must be an HttpGuard, got {type(guard).__name__}")
    return type("GuardedHttpToolsProtocol", (_GuardedProtocol,), {"guard": guard})
