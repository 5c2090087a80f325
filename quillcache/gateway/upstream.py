"""The upstream client interface, its failure classes, and the aiohttp client (one ``ClientSession``
to every engine, with the gateway's timeouts). ``quillcache.gateway.clients.UPSTREAM_CLIENTS`` names them
(``upstream_client`` in the gateway config): ``aiohttp`` here, ``native`` (asyncio + httptools, the
default) in :mod:`quillcache.gateway.native_upstream`. Both give the caller a response with
``status``, ``headers.get``, ``read()``, ``content.iter_any()``, ``release()`` and ``close()``.

Timeouts (``TimeoutsConfig``): ``connect_s`` bounds the TCP connect, ``first_byte_s`` bounds the
wait from sending the request to the engine's response headers, ``idle_s`` bounds every read of
the body (the longest silence between two chunks of a stream).

Failure classes (:class:`UpstreamFailure.kind`), all raised BEFORE any byte reached the client,
so the caller may retry on another worker:

- ``connect``: the engine could not be reached (refused, reset, DNS) or closed the connection
  before any byte of its response; the caller takes the engine for down;
- ``protocol``: the engine answered something that is not an HTTP response head (the parser refused
  it) or closed the connection part-way through its head; an engine failure, but no sign that the
  engine is down;
- ``timeout``: no response headers within ``first_byte_s``;
- ``status``: the engine answered 5xx or 429 (its body is read, bounded, and only summarised).

Any other status (2xx, 4xx) is handed to the caller with the response open. The pool holds up
to ``max_upstream_connections`` connections in total and no per-host cap, so >= 1,000 concurrent
streams to one engine each get their own connection.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import aiohttp
from yarl import URL  # aiohttp's own URL type (a dependency of aiohttp)

from quillcache.gateway.config import LimitsConfig, TimeoutsConfig

__all__ = ["ERROR_BODY_BYTES", "Upstream", "UpstreamFailure", "is_failure_status"]

ERROR_BODY_BYTES = 4096  # of a failed answer's body, read (bounded) and only summarised


def is_failure_status(status: int) -> bool:
    """An engine answer that is a ``status`` failure (retried on another worker): 5xx or 429."""
    return status >= 500 or status == 429

if sys.version_info >= (3, 11):
    _deadline = asyncio.timeout
else:  # pragma: no cover - Python 3.10
    _deadline = None


class UpstreamFailure(Exception):
    """The engine failed before the first byte (see module doc); ``kind`` is the metrics label."""

    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


class Upstream:
    def __init__(self, timeouts: TimeoutsConfig, limits: LimitsConfig) -> None:
        self.timeouts = timeouts
        self.limits = limits
        self.session: aiohttp.ClientSession | None = None
        self._req_timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect_s,
                                                  sock_read=timeouts.idle_s)
        self._probe_timeout = aiohttp.ClientTimeout(total=max(timeouts.connect_s, 1.0),
                                                    sock_connect=timeouts.connect_s)

    @staticmethod
    def target(url: str) -> URL:
        """``url`` parsed once, for :meth:`open` (aiohttp takes a ``URL`` as it is and parses a ``str`` per call)."""
        return URL(url)

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.limits.max_upstream_connections, limit_per_host=0,
                                         keepalive_timeout=self.timeouts.keepalive_s)
        # engines set no cookies the gateway should replay: no cookie jar work per request
        self.session = aiohttp.ClientSession(connector=connector, timeout=self._req_timeout,
                                             auto_decompress=False, skip_auto_headers=("User-Agent",),
                                             cookie_jar=aiohttp.DummyCookieJar())

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def open(self, url: str | URL, payload: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        """POST ``payload``; the open response (status < 500 and != 429), or :class:`UpstreamFailure`."""
        session = self.session
        assert session is not None, "Upstream.start() first"
        try:
            if _deadline is not None:
                async with _deadline(self.timeouts.first_byte_s):
                    resp = await session.post(url, data=payload, headers=headers)
            else:  # pragma: no cover
                resp = await asyncio.wait_for(session.post(url, data=payload, headers=headers),
                                              self.timeouts.first_byte_s)
        except TimeoutError:
            raise UpstreamFailure("timeout", f"no response within {self.timeouts.first_byte_s:g} s") from None
        except asyncio.TimeoutError:  # pragma: no cover - Python 3.10 (a distinct class there)
            raise UpstreamFailure("timeout", f"no response within {self.timeouts.first_byte_s:g} s") from None
        except aiohttp.ClientConnectorError:
            raise UpstreamFailure("connect", "connection refused or unreachable") from None
        except aiohttp.ServerDisconnectedError as exc:
            if not isinstance(exc.message, str):  # aiohttp passes the partial head it had parsed
                raise UpstreamFailure("protocol", "the engine closed the connection inside its response head") \
                    from None
            raise UpstreamFailure("connect", "connection closed before the response") from None
        except (aiohttp.ClientConnectionError, OSError):
            raise UpstreamFailure("connect", "connection closed before the response") from None
        except aiohttp.ClientError as exc:  # ClientResponseError: a response head the parser refused
            # its first line names the fault; the rest quotes the engine's bytes, which the client is not shown
            why = str(getattr(exc, "message", "") or "").strip().split("\n", 1)[0].rstrip(":")[:120]
            raise UpstreamFailure("protocol", "malformed response from the engine" + (f": {why}" if why else "")) \
                from None
        if is_failure_status(resp.status):
            status = resp.status
            try:
                await asyncio.wait_for(resp.content.read(ERROR_BODY_BYTES), self.timeouts.connect_s)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                pass
            finally:  # also when the gateway's request is cancelled (its client left): the engine sees a close
                resp.close()
            raise UpstreamFailure("status", f"engine answered HTTP {status}", status)
        return resp

    async def probe(self, url: str) -> bool:
        """GET ``url`` (a /health endpoint): True on a 2xx answer within the probe timeout."""
        session = self.session
        if session is None:
            return False
        try:
            async with session.get(url, timeout=self._probe_timeout) as resp:
                await resp.read()
                return 200 <= resp.status < 300
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            return False

    async def get_json(self, url: str) -> Any:
        """GET ``url`` and parse JSON, or None on any failure."""
        session = self.session
        if session is None:
            return None
        try:
            async with session.get(url, timeout=self._probe_timeout) as resp:
                if resp.status != 200:
                    return None
                return await resp.json(content_type=None)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            return None

