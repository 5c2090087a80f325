"""The native upstream client: HTTP/1.1 on an asyncio ``Protocol`` with httptools' response parser.

The same interface and failure classes as :class:`quillcache.gateway.upstream.Upstream` (the
aiohttp client; ``upstream_client`` in the gateway config picks one, ``UPSTREAM_CLIENTS``), with
less work per request: the request line, ``Host`` and ``Content-Length`` are joined to header
bytes built once per target, and the request is written by ``open`` itself, in the loop turn it
is called from, when a pooled connection is idle.

Invariants:

- Pool: keep-alive connections per (host, port); at most ``max_upstream_connections`` open in
  total (a request past it waits for one to be released or closed; each release or close wakes one
  waiter, and a waiter cancelled after its wake-up passes it on, so no slot sits idle while a request
  waits); an idle pooled connection is closed after ``keepalive_s``, or as soon as the engine closes
  it or sends unsolicited bytes.
- A connection goes back to the pool only when its response ended complete and both sides allow
  keep-alive; any other end (``close``, cancellation, a parse error, a short body) closes it, so
  the engine sees a cancelled stream as a closed connection.
- Failure classes before the first response byte reached the caller (:class:`UpstreamFailure`):
  ``connect`` (refused, unreachable, connect timeout, or reset/closed before any response byte),
  ``protocol`` (a response head the parser refuses, or a close after some of the head but before its
  end), ``timeout`` (no headers within ``first_byte_s``), ``status`` (5xx or 429; its body read,
  bounded, and only summarised). A request on a reused pooled connection that the engine closed
  before any response byte is retried once on a fresh connection (the engine dropped an idle
  connection as the request was written); nothing else is retried here.
- A 1xx interim response other than 101 (``100 Continue``, ``103 Early Hints``; RFC 9110 15.2) is
  read and dropped: ``status`` and ``headers`` are the final response's, and ``first_byte_s`` bounds
  the wait for that final head.
- Body reads: every wait for body bytes is bounded by ``idle_s``; a body that ends short (the
  connection closed before the declared length or the last chunk) raises :class:`UpstreamBodyError`.
  A response with neither length nor chunked encoding ends at the connection's close.
"""

from __future__ import annotations

import asyncio
import collections
import json
from typing import Any
from urllib.parse import urlsplit

import httptools

from quillcache.gateway.config import LimitsConfig, TimeoutsConfig
from quillcache.gateway.upstream import ERROR_BODY_BYTES, UpstreamFailure, is_failure_status

__all__ = ["NativeResponse", "NativeTarget", "NativeUpstream", "UpstreamBodyError"]

_PAUSE_BYTES = 1 << 16  # buffered body bytes past which the socket is paused until the reader catches up


class UpstreamBodyError(Exception):
    """The response body failed after its headers (closed short, malformed, idle too long)."""


class NativeTarget:
    """One engine URL parsed once: its pool key and the request head's constant bytes."""

    __slots__ = ("host", "key", "path", "port", "url", "_head")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the native upstream client speaks plain http:// only, got {url!r:.120}")
        self.url = url
        self.host = parts.hostname
        self.port = parts.port or 80
        self.key = (self.host, self.port)
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = self.host if ":" not in self.host else f"[{self.host}]"
        self._head = f" {self.path} HTTP/1.1\r\nhost: {host}:{self.port}\r\n".encode("latin-1")

    def head(self, method: bytes, headers: dict[str, str], body_bytes: int) -> bytes:
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        return b"".join((method, self._head, extra.encode("latin-1"), b"content-length: ",
                         str(body_bytes).encode(), b"\r\n\r\n"))


class _Content:
    """``resp.content`` in aiohttp's shape: ``iter_any()`` yields the bytes available, as they come."""

    __slots__ = ("_resp",)

    def __init__(self, resp: NativeResponse) -> None:
        self._resp = resp

    def iter_any(self):
        return self._resp._iter_any()

    async def read(self, n: int = -1) -> bytes:
        return await self._resp._read(n)


class NativeResponse:
    """An engine's response: ``status``, ``headers`` (lower-case names), ``content.iter_any()``,
    ``read()``, ``release()``, ``close()`` — what the gateway reads off an aiohttp response."""

    __slots__ = ("_buf", "_buffered", "_conn", "_done", "_exc", "_waiter", "content", "headers", "status",
                 "_idle_s", "_loop", "_until_close")

    def __init__(self, conn: _Connection, idle_s: float) -> None:
        self._conn: _Connection | None = conn
        self._loop = conn.loop
        self._idle_s = idle_s
        self.status = 0
        self.headers: dict[str, str] = {}
        self._buf: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._done = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._until_close = False
        self.content = _Content(self)

    # ---- fed by the connection ---------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        self._buf.append(data)
        self._buffered += len(data)
        if self._buffered > _PAUSE_BYTES and self._conn is not None:
            self._conn.pause()
        self._wake()

    def _end(self, exc: BaseException | None) -> None:
        self._done = True
        self._exc = exc
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # ---- read by the gateway -----------------------------------------------------------------
    async def _wait(self) -> None:
        w = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(self._idle_s, _expire, w, self._idle_s)
        try:
            await w
        finally:
            timer.cancel()
            self._waiter = None

    def _take(self) -> bytes:
        buf = self._buf
        data = buf.popleft() if len(buf) == 1 else b"".join(buf)
        buf.clear()
        self._buffered = 0
        if self._conn is not None:
            self._conn.resume()
        return data

    async def _iter_any(self):
        while True:
            if self._buf:
                yield self._take()
                continue
            if self._done:
                if self._exc is not None:
                    raise self._exc
                return
            await self._wait()

    async def _read(self, n: int = -1) -> bytes:
        while not self._done and (n < 0 or self._buffered < n):
            await self._wait()
        if self._exc is not None and (n < 0 or not self._buf):
            raise self._exc
        data = self._take() if self._buf else b""
        return data if n < 0 else data[:n]

    async def read(self) -> bytes:
        """The whole body (every wait bounded by ``idle_s``)."""
        return await self._read(-1)

    def release(self) -> None:
        """Done with the response: its connection goes back to the pool if it ended complete (already
        the case once the body was read to its end), else it is closed."""
        conn = self._conn
        if conn is not None:
            self._conn = None
            if self._done and self._exc is None and conn.keep_alive:
                conn.pool.put(conn)
            else:
                conn.close()

    def close(self) -> None:
        """Close the connection unless it already went back to the pool (the engine sees a close)."""
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.close()
        if not self._done:
            self._end(UpstreamBodyError("the response was closed"))


def _expire(fut: asyncio.Future, idle_s: float) -> None:
    if not fut.done():
        fut.set_exception(UpstreamBodyError(f"no body bytes within {idle_s:g} s"))


class _Connection(asyncio.Protocol):
    """One TCP connection to an engine; at most one request on it at a time."""

    def __init__(self, pool: _Pool, loop: asyncio.AbstractEventLoop, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: NativeResponse | None = None
        self.headers_waiter: asyncio.Future | None = None
        self.keep_alive = False
        self.got_bytes = False  # any byte of the current response arrived
        self.interim = False  # the response being parsed is a 1xx interim one (not 101)
        self.closed = False
        self.paused = False
        self.idle_timer: asyncio.TimerHandle | None = None
        self._name = b""

    # ---- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.resp is None or self.closed:  # unsolicited bytes on an idle connection: not reusable
            self.close()
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamBodyError("the engine switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamBodyError(f"malformed response from the engine: {exc}"))

    def connection_lost(self, exc) -> None:
        was_closed = self.closed
        self.closed = True
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        self.pool.forget(self)
        resp = self.resp
        if resp is not None:
            self.resp = None
            w = self.headers_waiter
            if w is not None and not w.done():
                w.set_exception(ConnectionResetError("closed before the response headers"))
            elif not resp._done:
                if resp._until_close and not was_closed:
                    resp._end(None)  # a body delimited by the connection's close ended
                else:
                    resp._end(UpstreamBodyError("the engine closed the connection mid-body"))
            resp._conn = None

    # ---- httptools callbacks -----------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self.resp
        key = name.decode("latin-1").lower()
        val = value.decode("latin-1")
        old = resp.headers.get(key)
        resp.headers[key] = val if old is None else f"{old}, {val}"

    def on_headers_complete(self) -> None:
        resp = self.resp
        resp.status = status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # interim (RFC 9110 15.2): the final response follows
            self.interim = True
            return
        h = resp.headers
        resp._until_close = "content-length" not in h and "chunked" not in h.get("transfer-encoding", "")
        self.keep_alive = self.parser.should_keep_alive() and not resp._until_close
        w = self.headers_waiter
        if w is not None and not w.done():
            w.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.resp._feed(body)

    def on_message_complete(self) -> None:
        resp = self.resp
        if self.interim:  # a 1xx's end: forget it and keep reading for the final response
            self.interim = False
            resp.status = 0
            resp.headers = {}
            return
        self.resp = None
        resp._end(None)
        resp._conn = None  # what aiohttp does at the body's end: the connection is released now
        if self.keep_alive:
            self.pool.put(self)
        else:
            self.close()

    # ---- used by the pool / the response -----------------------------------------------------
    def send(self, head: bytes, body: bytes, resp: NativeResponse, waiter: asyncio.Future) -> None:
        self.resp = resp
        self.headers_waiter = waiter
        self.got_bytes = False
        self.interim = False
        self.keep_alive = False
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)

    def _fail(self, exc: BaseException) -> None:
        resp = self.resp
        w = self.headers_waiter
        if w is not None and not w.done():
            w.set_exception(exc)
        elif resp is not None and not resp._done:
            resp._end(exc)
        self.close()

    def pause(self) -> None:
        if not self.paused and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool.forget(self)
            if self.transport is not None:
                self.transport.close()


class _Pool:
    """Keep-alive connections per (host, port), bounded in total (module invariants)."""

    def __init__(self, limit: int, keepalive_s: float, connect_s: float) -> None:
        self.limit = limit
        self.keepalive_s = keepalive_s
        self.connect_s = connect_s
        self.idle: dict[tuple[str, int], list[_Connection]] = {}
        self.open: set[_Connection] = set()
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.connecting = 0

    def take_idle(self, key) -> _Connection | None:
        stack = self.idle.get(key)
        while stack:
            conn = stack.pop()
            if conn.idle_timer is not None:
                conn.idle_timer.cancel()
                conn.idle_timer = None
            if not conn.closed and not conn.transport.is_closing():
                return conn
            conn.close()
        return None

    async def connect(self, target: NativeTarget) -> tuple[_Connection, bool]:
        """A connection to ``target`` and whether it was pooled (reused), within the total bound."""
        loop = asyncio.get_running_loop()
        while len(self.open) + self.connecting >= self.limit:
            if not self._drop_one_idle():
                w = loop.create_future()
                self.waiters.append(w)
                try:
                    await w
                except asyncio.CancelledError:
                    if w.done() and not w.cancelled():  # woken, then cancelled (its client left) in the same
                        self._wake()  # loop turn: this task takes no slot, so pass the wake-up on
                    raise
                finally:
                    if w in self.waiters:
                        self.waiters.remove(w)
            conn = self.take_idle(target.key)
            if conn is not None:
                return conn, True
        self.connecting += 1
        key = target.key
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self, loop, key), target.host, target.port), self.connect_s)
        finally:
            self.connecting -= 1
        self.open.add(conn)
        return conn, False

    def _drop_one_idle(self) -> bool:
        """Close one idle connection (of any engine) to make room; False if none is idle."""
        for stack in self.idle.values():
            while stack:
                conn = stack.pop(0)
                if conn.idle_timer is not None:
                    conn.idle_timer.cancel()
                if not conn.closed:
                    conn.close()
                    return True
        return False

    def put(self, conn: _Connection) -> None:
        if conn.closed:
            return
        conn.resp = None
        conn.headers_waiter = None
        conn.resume()
        conn.idle_timer = conn.loop.call_later(self.keepalive_s, conn.close)
        self.idle.setdefault(conn.key, []).append(conn)
        self._wake()

    def forget(self, conn: _Connection) -> None:
        if conn in self.open:
            self.open.discard(conn)
            stack = self.idle.get(conn.key)
            if stack and conn in stack:
                stack.remove(conn)
            self._wake()

    def _wake(self) -> None:
        while self.waiters:
            w = self.waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    def close_all(self) -> None:
        for conn in list(self.open):
            conn.close()
        self.idle.clear()


class NativeUpstream:
    """The gateway's upstream client on asyncio + httptools (module doc); the ``Upstream`` interface."""

    def __init__(self, timeouts: TimeoutsConfig, limits: LimitsConfig) -> None:
        self.timeouts = timeouts
        self.limits = limits
        self.pool: _Pool | None = None

    @staticmethod
    def target(url: str) -> NativeTarget:
        """``url`` parsed once, for :meth:`open`."""
        return NativeTarget(url)

    async def start(self) -> None:
        self.pool = _Pool(self.limits.max_upstream_connections, self.timeouts.keepalive_s, self.timeouts.connect_s)

    async def close(self) -> None:
        if self.pool is not None:
            self.pool.close_all()
            self.pool = None

    @property
    def open_connections(self) -> int:
        """Connections open now (pooled idle ones included)."""
        return 0 if self.pool is None else len(self.pool.open)

    async def open(self, url: str | NativeTarget, payload: bytes, headers: dict[str, str]) -> NativeResponse:
        """POST ``payload``; the open response (status < 500 and != 429), or :class:`UpstreamFailure`."""
        return await self._request(b"POST", url, payload, headers, self.timeouts.first_byte_s)

    async def _request(self, method: bytes, url, payload: bytes, headers: dict[str, str],
                       first_byte_s: float) -> NativeResponse:
        pool = self.pool
        assert pool is not None, "NativeUpstream.start() first"
        target = url if isinstance(url, NativeTarget) else NativeTarget(str(url))
        head = target.head(method, headers, len(payload))
        loop = asyncio.get_running_loop()
        conn = pool.take_idle(target.key)
        reused = conn is not None
        for attempt in (0, 1):
            if conn is None:
                try:
                    conn, reused = await pool.connect(target)
                except (asyncio.TimeoutError, TimeoutError):
                    raise UpstreamFailure("connect", f"no connection within {self.timeouts.connect_s:g} s") from None
                except OSError:
                    raise UpstreamFailure("connect", "connection refused or unreachable") from None
            resp = NativeResponse(conn, self.timeouts.idle_s)
            waiter = loop.create_future()
            conn.send(head, payload, resp, waiter)
            timer = loop.call_later(first_byte_s, _first_byte_expired, waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                conn.close()
                raise
            except TimeoutError:
                conn.close()
                raise UpstreamFailure("timeout", f"no response within {first_byte_s:g} s") from None
            except (ConnectionError, OSError, UpstreamBodyError) as exc:
                got = conn.got_bytes
                conn.close()
                if reused and attempt == 0 and not got:
                    conn = None  # a stale pooled connection: once more on a fresh one
                    continue
                if isinstance(exc, UpstreamBodyError):  # the parser refused what the engine sent
                    raise UpstreamFailure("protocol", str(exc)[:200]) from None
                if got:  # it answered something, then closed before its headers were complete
                    raise UpstreamFailure("protocol", "the engine closed the connection inside its response head") \
                        from None
                raise UpstreamFailure("connect", "connection closed before the response") from None
            finally:
                timer.cancel()
            break
        if is_failure_status(resp.status):
            status = resp.status
            try:
                await asyncio.wait_for(resp._read(ERROR_BODY_BYTES), self.timeouts.connect_s)
            except (Exception, asyncio.TimeoutError):  # noqa: BLE001 - only summarised
                pass
            finally:  # also when the gateway's request is cancelled (its client left): the engine sees a close
                resp.close()
            raise UpstreamFailure("status", f"engine answered HTTP {status}", status)
        return resp

    async def _get(self, url: str) -> tuple[int, bytes] | None:
        probe_s = max(self.timeouts.connect_s, 1.0)

        async def get() -> tuple[int, bytes]:
            resp = await self._request(b"GET", url, b"", {}, probe_s)
            try:
                return resp.status, await resp.read()
            finally:
                resp.release()

        try:
            return await asyncio.wait_for(get(), probe_s)
        except (UpstreamFailure, UpstreamBodyError, OSError, ValueError, asyncio.TimeoutError):
            return None

    async def probe(self, url: str) -> bool:
        """GET ``url`` (a /health endpoint): True on a 2xx answer within the probe timeout."""
        if self.pool is None:
            return False
        got = await self._get(url)
        return got is not None and 200 <= got[0] < 300

    async def get_json(self, url: str) -> Any:
        """GET ``url`` and parse JSON, or None on any failure."""
        if self.pool is None:
            return None
        got = await self._get(url)
        if got is None or got[0] != 200:
            return None
        try:
            return json.loads(got[1])
        except ValueError:
            return None


def _first_byte_expired(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())
