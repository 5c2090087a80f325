"""The native upstream client (quillcache.gateway.native_upstream): httptools' response parser fed
chunked and content-length bodies split at every byte boundary (Hypothesis), the keep-alive pool
(reuse, the total bound, keep-alive expiry), the failure classes before the first byte, a stale
pooled connection retried once on a fresh one, short bodies and idle timeouts, and a cancelled
stream seen as a closed connection by the server. Servers are raw asyncio TCP servers on
127.0.0.1 (real sockets); every wait polls with a deadline."""

from __future__ import annotations

import asyncio
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.gateway.config import ConfigError, LimitsConfig, TimeoutsConfig, config_from_dict, parse_engine_urls
from quillcache.gateway.native_upstream import (NativeResponse, NativeTarget, NativeUpstream, UpstreamBodyError,
                                                _Connection, _Pool)
from quillcache.gateway.clients import UPSTREAM_CLIENTS
from quillcache.gateway.upstream import Upstream, UpstreamFailure

OK_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"


def _chunked(parts: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts if p) + b"0\r\n\r\n"


def _client(**timeouts) -> NativeUpstream:
    t = {"connect_s": 1.0, "first_byte_s": 2.0, "idle_s": 2.0, "keepalive_s": 5.0, **timeouts}
    return NativeUpstream(TimeoutsConfig(**t), LimitsConfig())


async def _until(pred, deadline_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not pred():
        assert loop.time() < end, "condition not met before the deadline"
        await asyncio.sleep(0.005)


class RawServer:
    """A TCP server on 127.0.0.1 whose per-request answer is ``handler(n_on_conn, request_bytes)``:
    bytes to write (a list: pieces, a float among them a pause, a None closing), None to close the connection, ``...`` to
    answer nothing until the client closes; counts connections and the client closes it saw."""

    def __init__(self, handler) -> None:
        self.handler = handler
        self.connections = 0
        self.live = 0
        self.max_live = 0
        self.eofs = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.live += 1
        self.max_live = max(self.max_live, self.live)
        n = 0
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.eofs += 1
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                out = self.handler(n, head + body)
                n += 1
                if asyncio.iscoroutine(out):
                    out = await out
                if out is None:
                    return
                if out is ...:  # answer nothing: wait for the client to close
                    await reader.read()
                    self.eofs += 1
                    return
                for piece in out if isinstance(out, list) else [out]:
                    if piece is None:  # close after the pieces before it
                        return
                    if isinstance(piece, float):
                        await asyncio.sleep(piece)
                        continue
                    writer.write(piece)
                    await writer.drain()
        finally:
            self.live -= 1
            writer.close()

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()


def _ok(body: bytes = b'{"ok": true}') -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


# ------------------------------------------------------------------------------------ parser path
def _fed(pieces: list[bytes]) -> tuple[int, dict, bytes, bool]:
    """Feed one response to a connection's parser at exactly the boundaries of ``pieces`` (the connection's
    transport is one end of a real socket pair); its status, headers, body read through ``iter_any``, and
    whether the connection went back to the pool."""

    async def main():
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        pool = _Pool(4, 5.0, 1.0)
        try:
            _, conn = await loop.create_connection(lambda: _Connection(pool, loop, ("pair", 0)), sock=a)
            pool.open.add(conn)
            resp = NativeResponse(conn, 2.0)
            waiter = loop.create_future()
            conn.send(b"POST / HTTP/1.1\r\n\r\n", b"", resp, waiter)
            for piece in pieces:
                conn.data_received(piece)
            await waiter
            got = [c async for c in resp.content.iter_any()]
            return resp.status, resp.headers, b"".join(got), pool.idle.get(("pair", 0)) == [conn]
        finally:
            pool.close_all()
            b.close()

    return asyncio.run(main())


def _wire(parts: list[bytes], chunked: bool) -> bytes:
    body = b"".join(parts)
    return OK_HEAD + (b"transfer-encoding: chunked\r\n\r\n" + _chunked(parts) if chunked
                      else b"content-length: %d\r\n\r\n" % len(body) + body)


@settings(max_examples=60, deadline=None)
@given(parts=st.lists(st.binary(min_size=0, max_size=40), min_size=0, max_size=6), chunked=st.booleans(),
       data=st.data())
def test_bodies_split_anywhere_come_through_whole(parts, chunked, data):
    wire = _wire(parts, chunked)
    cuts = sorted(data.draw(st.sets(st.integers(1, len(wire) - 1), max_size=len(wire)), label="cuts"))
    pieces = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)])]
    status, headers, body, pooled = _fed(pieces)
    assert status == 200 and headers["content-type"] == "text/event-stream"
    assert body == b"".join(parts), f"cuts {cuts}"
    assert pooled, "a complete keep-alive response returns its connection to the pool"


@pytest.mark.parametrize("chunked", [True, False])
def test_a_response_split_at_every_byte_boundary(chunked):
    parts = [b"data: {\"a\": 1}\n\n", b"data: \r\n0\r\n\r\n", b"data: [DONE]\n\n"]  # body bytes that look like framing
    wire = _wire(parts, chunked)
    for i in range(1, len(wire)):
        assert _fed([wire[:i], wire[i:]])[2] == b"".join(parts), f"split at byte {i}"
    assert _fed([wire[i:i + 1] for i in range(len(wire))])[2] == b"".join(parts), "one byte at a time"


def test_native_target_builds_the_request_head_once():
    t = NativeTarget("http://127.0.0.1:8123/v1/completions")
    assert t.key == ("127.0.0.1", 8123)
    head = t.head(b"POST", {"content-type": "application/json"}, 7)
    assert head == (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:8123\r\ncontent-type: application/json\r\n"
                    b"content-length: 7\r\n\r\n")
    with pytest.raises(ValueError, match="plain http:// only"):
        NativeTarget("https://127.0.0.1:1/")


def test_config_picks_the_client_by_name():
    engines = parse_engine_urls("http://127.0.0.1:8001")
    assert set(UPSTREAM_CLIENTS) >= {"aiohttp", "native"} and UPSTREAM_CLIENTS["aiohttp"] is Upstream
    assert config_from_dict({"upstream_client": "aiohttp"}, engines=engines).upstream_client == "aiohttp"
    with pytest.raises(ConfigError, match=r"upstream_client 'curl' is not registered; known: \['aiohttp', 'native'\]"):
        config_from_dict({"upstream_client": "curl"}, engines=engines)
    with pytest.raises(ConfigError, match="plain http only"):
        config_from_dict({"upstream_client": "native"}, engines=parse_engine_urls("https://127.0.0.1:8001"))


# ------------------------------------------------------------------------------------------- pool
def test_keep_alive_reuse_the_total_bound_and_expiry():
    async def main():
        release = asyncio.Event()

        async def slow(n, req):
            await release.wait()
            return _ok()

        async with RawServer(lambda n, req: _ok()) as srv:
            up = NativeUpstream(TimeoutsConfig(keepalive_s=0.2), LimitsConfig(max_upstream_connections=3))
            await up.start()
            try:
                for _ in range(5):  # one at a time: one connection, reused
                    resp = await up.open(up.target(srv.url + "/x"), b"{}", {"content-type": "application/json"})
                    assert await resp.read() == b'{"ok": true}'
                    resp.release()
                assert srv.connections == 1 and up.open_connections == 1
                await _until(lambda: up.open_connections == 0)  # keepalive_s passed: closed
                await _until(lambda: srv.live == 0)
            finally:
                await up.close()
        async with RawServer(slow) as srv:
            up = NativeUpstream(TimeoutsConfig(), LimitsConfig(max_upstream_connections=3))
            await up.start()
            try:
                async def one():
                    resp = await up.open(srv.url + "/x", b"{}", {})
                    return await resp.read()

                tasks = [asyncio.create_task(one()) for _ in range(8)]
                await _until(lambda: srv.live == 3)
                release.set()
                assert await asyncio.gather(*tasks) == [b'{"ok": true}'] * 8
                assert srv.max_live == 3 and up.open_connections <= 3, "the total bound holds"
            finally:
                await up.close()
            await _until(lambda: srv.live == 0)

    asyncio.run(main())


# ------------------------------------------------------------------------------- failure classes
def test_failure_classes_before_the_first_byte():
    async def main():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        up = _client(first_byte_s=0.2)
        await up.start()
        try:
            with pytest.raises(UpstreamFailure) as e:
                await up.open(dead + "/x", b"", {})
            assert e.value.kind == "connect"

            async with RawServer(lambda n, r: ...) as srv:
                with pytest.raises(UpstreamFailure) as e:
                    await up.open(srv.url + "/x", b"", {})
                assert e.value.kind == "timeout" and "0.2 s" in str(e.value)
                await _until(lambda: srv.eofs == 1)  # the timed-out connection was closed
            body = b"overloaded" * 1000
            async with RawServer(lambda n, r: b"HTTP/1.1 503 Busy\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
                                 ) as srv:
                with pytest.raises(UpstreamFailure) as e:
                    await up.open(srv.url + "/x", b"", {})
                assert e.value.kind == "status" and e.value.status == 503 and "overloaded" not in str(e.value)
            async with RawServer(lambda n, r: None) as srv:  # closes on the request: before any byte
                with pytest.raises(UpstreamFailure) as e:
                    await up.open(srv.url + "/x", b"", {})
                assert e.value.kind == "connect" and srv.connections == 1, "a fresh connection is not retried"
            async with RawServer(lambda n, r: b"HTTP/1.1 429 Slow\r\ncontent-length: 0\r\n\r\n") as srv:
                with pytest.raises(UpstreamFailure) as e:
                    await up.open(srv.url + "/x", b"", {})
                assert e.value.kind == "status" and e.value.status == 429
            async with RawServer(lambda n, r: b"HTTP/1.1 404 No\r\ncontent-length: 2\r\n\r\nno") as srv:
                resp = await up.open(srv.url + "/x", b"", {})  # 4xx reaches the caller
                assert resp.status == 404 and await resp.read() == b"no"
        finally:
            await up.close()

    asyncio.run(main())


def test_a_stale_pooled_connection_is_retried_once_on_a_fresh_one():
    async def main():
        # each connection answers its first request and drops the second one unanswered
        async with RawServer(lambda n, r: _ok() if n == 0 else None) as srv:
            up = _client()
            await up.start()
            try:
                for i in range(3):
                    resp = await up.open(srv.url + "/x", b"{}", {})
                    assert await resp.read() == b'{"ok": true}', f"request {i}"
                assert srv.connections == 3  # requests 2 and 3 each met a dropped pooled connection first
            finally:
                await up.close()
        # the engine closes every connection after its response: the pool sees the close and drops it
        async with RawServer(lambda n, r: [_ok(), None]) as srv:
            up = _client()
            await up.start()
            try:
                for i in range(3):
                    resp = await up.open(srv.url + "/x", b"{}", {})
                    assert await resp.read() == b'{"ok": true}', f"request {i}"
                    await _until(lambda: up.open_connections == 0)  # detected while idle, not at the next use
                assert srv.connections == 3
            finally:
                await up.close()

    asyncio.run(main())


def test_short_body_garbage_and_idle_timeout_fail_the_read():
    async def main():
        up = _client(idle_s=0.2)
        await up.start()
        try:
            async with RawServer(lambda n, r: [OK_HEAD + b"content-length: 100\r\n\r\npartial", None]) as srv:
                resp = await up.open(srv.url + "/x", b"", {})
                with pytest.raises(UpstreamBodyError, match="closed the connection mid-body"):
                    await resp.read()
                resp.close()

            async def short(n, r):
                return [OK_HEAD + b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"]

            async with RawServer(short) as srv:
                resp = await up.open(srv.url + "/x", b"", {})
                got = []
                with pytest.raises(UpstreamBodyError, match="no body bytes within 0.2 s"):
                    async for c in resp.content.iter_any():
                        got.append(c)
                assert b"".join(got) == b"hello"
                resp.close()
            async with RawServer(lambda n, r: OK_HEAD + b"transfer-encoding: chunked\r\n\r\nzz\r\n") as srv:
                resp = await up.open(srv.url + "/x", b"", {})
                with pytest.raises(UpstreamBodyError, match="malformed"):
                    await resp.read()
            async with RawServer(lambda n, r: [OK_HEAD + b"\r\nuntil-close body", None]) as srv:
                # no length, not chunked: the body ends at the close (the server closes after writing)
                resp = await up.open(srv.url + "/x", b"", {})
                assert await resp.read() == b"until-close body"
            assert up.open_connections == 0
        finally:
            await up.close()

    asyncio.run(main())


def test_a_cancelled_stream_closes_the_upstream_connection():
    async def main():
        async def stream(n, r):
            return [OK_HEAD + b"transfer-encoding: chunked\r\n\r\n"] + [_chunked([b"data: x\n\n"])[:-5], 0.05] * 200

        async with RawServer(stream) as srv:
            up = _client()
            await up.start()
            try:
                resp = await up.open(srv.url + "/x", b"", {})
                seen = []

                async def consume():
                    async for c in resp.content.iter_any():
                        seen.append(c)

                task = asyncio.create_task(consume())
                await _until(lambda: len(seen) >= 2)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                resp.close()  # what the gateway's exchange does on a client disconnect
                await _until(lambda: srv.live == 0)  # the server saw the connection close
                assert up.open_connections == 0
            finally:
                await up.close()

    asyncio.run(main())


def test_a_waiter_woken_and_cancelled_in_the_same_turn_passes_the_wake_up_on():
    """The pool is full (one connection); two requests wait for a slot. The connection closes (a response
    cancelled), which wakes the first waiter, and in the same loop turn that waiter's request is cancelled (its
    client left). The second waiter must get the free slot, not wait for some later pool event."""

    async def main():
        async def answer(n, r):
            if srv.connections == 1:  # the request holding the only slot: a stream that goes on
                return [OK_HEAD + b"transfer-encoding: chunked\r\n\r\n"] + [_chunked([b"data: x\n\n"])[:-5], 0.05] * 200
            return _ok()

        async with RawServer(answer) as srv:
            up = NativeUpstream(TimeoutsConfig(keepalive_s=30.0), LimitsConfig(max_upstream_connections=1))
            await up.start()
            try:
                held = await up.open(srv.url + "/x", b"", {})
                first = asyncio.create_task(up.open(srv.url + "/x", b"", {}))
                second = asyncio.create_task(up.open(srv.url + "/x", b"", {}))
                await _until(lambda: len(up.pool.waiters) == 2)
                held.close()  # the slot is free: wakes the first waiter ...
                first.cancel()  # ... whose client leaves in the same loop turn
                await _until(second.done, 3.0)
                resp = second.result()
                assert await resp.read() == b'{"ok": true}'
                resp.release()
                assert first.cancelled() and up.open_connections <= 1
            finally:
                await up.close()

    asyncio.run(main())
