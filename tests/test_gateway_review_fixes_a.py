"""Regressions from the gateway review (rev-gateway findings 1, 2, 3, 4, 6 and the start-up part of 7), each
against the real code: the HTTP guard's protocol fed reads split where TCP may split them; the two upstream
clients and an in-process gateway against a scripted engine on 127.0.0.1 whose answer the prompt picks.

1. a head ending across two reads (its blank line's last 1-3 bytes arrive with the body) is measured as
   the head, not as the whole read: no false 431, also for a pipelined head after it;
2. the native client skips 1xx interim responses (100, 103) and hands on the final one;
3. decision_seconds ends at the routing decision, not at the engine's answer;
4. no retry is counted and no backoff slept when no other engine is left to try;
6. an engine that answers something that is not HTTP is a ``protocol`` failure (502, engine kept healthy);
   ``connect`` stays for an engine that closed before any byte;
7. a failed start (``peer_bind`` on an address in use) stops what it started and is one line, no traceback.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import uvicorn
from uvicorn.server import ServerState

from quillcache.gateway.app import Gateway, GatewayStartError
from quillcache.gateway.config import config_from_dict, parse_engine_urls
from quillcache.gateway.native_upstream import NativeUpstream
from quillcache.gateway.tenants import TenantKey, TenantTable
from quillcache.gateway.upstream import Upstream, UpstreamFailure
from quillcache.httpserve.guard import HttpGuard, guarded_protocol

pytestmark = pytest.mark.timeout(120)

KEY = "sk-review-fix-a-0001"
MODEL = "qc-model"


# ------------------------------------------------------------------------------------ 1. the guard's head size
async def _echo_length(scope, receive, send):
    """Answers every request with the length of the body it received."""
    if scope["type"] != "http":
        return
    got = 0
    while True:
        message = await receive()
        got += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    out = str(got).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(out))]})
    await send({"type": "http.response.body", "body": out})


class _Transport(asyncio.Transport):
    """What the protocol writes, kept; every read is one ``data_received`` call, exactly as split here."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closing = False

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 2), "peername": ("127.0.0.1", 1)}.get(name, default)

    def write(self, data) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


def _guarded_exchange(reads: list[bytes], max_head_bytes: int) -> bytes:
    """What ``guarded_protocol`` answers when the client's bytes arrive in exactly these reads."""

    async def run() -> bytes:
        cfg = uvicorn.Config(_echo_length, lifespan="off", log_level="error")
        cfg.load()
        proto = guarded_protocol(HttpGuard(max_head_bytes=max_head_bytes))(
            config=cfg, server_state=ServerState(), app_state={}, _loop=asyncio.get_running_loop())
        transport = _Transport()
        proto.connection_made(transport)
        for data in reads:
            proto.data_received(data)
            for _ in range(20):  # the application's task runs
                await asyncio.sleep(0)
        for _ in range(20):
            await asyncio.sleep(0)
        proto.connection_lost(None)
        return bytes(transport.out)

    return asyncio.run(run())


def _head(size: int, body_bytes: int) -> bytes:
    base = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\nx-pad: " % body_bytes
    head = base + b"a" * (size - len(base) - 4) + b"\r\n\r\n"
    assert len(head) == size
    return head


def test_a_head_whose_end_arrives_with_the_body_is_measured_as_the_head():
    body = b"y" * 20_000
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n20000"
    at_limit, over = _head(256, len(body)), _head(257, len(body))
    for k in (1, 2, 3):  # the blank line's last k bytes arrive with the body (was: 431, the body counted as head)
        assert _guarded_exchange([at_limit[:-k], at_limit[-k:] + body], 256) == ok, k
        assert _guarded_exchange([over[:-k], over[-k:] + body], 256).startswith(b"HTTP/1.1 431 "), k
    # a head of exactly the limit, 3 bytes per read (was: 431)
    data = at_limit + body
    assert _guarded_exchange([data[i:i + 3] for i in range(0, len(data), 3)], 256) == ok
    # a pipelined head of exactly the limit after such a request is measured from its own start
    assert _guarded_exchange([at_limit[:-1], at_limit[-1:] + body + at_limit + body], 256) == ok + ok
    answer = _guarded_exchange([at_limit[:-1], at_limit[-1:] + body + over + body], 256)
    assert answer.startswith(ok + b"HTTP/1.1 431 "), answer[:120]


# ------------------------------------------------------------------------------------ a scripted engine
async def _engine_handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """An engine whose answer to a POST is picked by the prompt's first word."""
    def reply(status: int, body: bytes, extra: bytes = b"") -> bytes:
        return (b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
                % (status, len(body), extra) + body)

    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = await reader.readexactly(length) if length else b""
            if not body:  # /health and other GETs
                writer.write(reply(200, b"{}"))
                await writer.drain()
                continue
            mode = json.loads(body)["prompt"].split()[0]
            if mode == "garbage":
                writer.write(b"NOT HTTP AT ALL\r\n\r\n")
            elif mode == "partial":  # a head cut off
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-le")
            elif mode == "continue":
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + reply(200, b'{"ok":1}'))
            elif mode == "hints":  # 103 with a header of its own, then the final answer in a later read
                writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>\r\n\r\n")
                await writer.drain()
                await asyncio.sleep(0.05)
                writer.write(reply(200, b'{"ok":2}'))
            elif mode == "s500":
                writer.write(reply(500, b'{"error":"boom"}'))
            elif mode == "slow":
                await asyncio.sleep(0.4)
                writer.write(reply(200, b'{"ok":"slow"}'))
            if mode in ("garbage", "partial", "close"):
                await writer.drain()
                return
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _start_engine() -> tuple[asyncio.AbstractServer, int]:
    server = await asyncio.start_server(_engine_handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _prompt(mode: str) -> bytes:
    return json.dumps({"model": MODEL, "prompt": f"{mode} please", "max_tokens": 2}).encode()


def _config(urls: str, **extra):
    return config_from_dict({"models": {MODEL: {}}, "timeouts": {"health_interval_s": 60}, **extra},
                            engines=parse_engine_urls(urls))


# ------------------------------------------------------------------------------------ 2 and 6: the clients
def test_the_native_client_skips_interim_1xx_answers():
    async def run() -> None:
        server, port = await _start_engine()
        cfg = _config(f"http://127.0.0.1:{port}")
        up = NativeUpstream(cfg.timeouts, cfg.limits)
        await up.start()
        try:
            url = f"http://127.0.0.1:{port}/v1/completions"
            for mode, want in (("continue", b'{"ok":1}'), ("hints", b'{"ok":2}'), ("continue", b'{"ok":1}')):
                resp = await up.open(url, _prompt(mode), {"content-type": "application/json"})
                # was: status 100 with an empty body, the real answer dropped
                assert resp.status == 200 and await resp.read() == want, mode
                assert "link" not in resp.headers and resp.headers["content-type"] == "application/json"
                resp.release()
            assert up.open_connections == 1  # each final answer ended complete: one kept-alive connection
        finally:
            await up.close()
            server.close()

    asyncio.run(run())


@pytest.mark.parametrize("client", [NativeUpstream, Upstream])
def test_a_reply_that_is_not_http_is_a_protocol_failure_not_an_unreachable_engine(client):
    async def kind(up, port: int, mode: str) -> str:
        with pytest.raises(UpstreamFailure) as e:
            await up.open(f"http://127.0.0.1:{port}/v1/completions", _prompt(mode),
                          {"content-type": "application/json"})
        assert str(e.value) and len(str(e.value)) <= 200
        assert "NOT HTTP" not in str(e.value)  # the engine's bytes are not quoted to the client
        return e.value.kind

    async def run() -> None:
        server, port = await _start_engine()
        cfg = _config(f"http://127.0.0.1:{port}")
        try:
            for mode, want in (("garbage", "protocol"), ("partial", "protocol"), ("close", "connect")):
                up = client(cfg.timeouts, cfg.limits)  # a fresh pool each: no stale-connection retry in play
                await up.start()
                try:
                    assert await kind(up, port, mode) == want, mode  # was: "connect" for all three
                finally:
                    await up.close()
        finally:
            server.close()

    asyncio.run(run())


# ------------------------------------------------------------------------------------ an in-process gateway
async def _post(gw: Gateway, body: bytes) -> tuple[int, bytes]:
    """One POST /v1/completions through the gateway's ASGI entry; the client stays connected."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    inbox = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []

    async def receive():
        if inbox:
            return inbox.pop(0)
        await asyncio.Event().wait()  # never disconnects

    async def send(message):
        sent.append(message)

    await gw.asgi(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def _gateway(urls: str, **extra) -> Gateway:
    return Gateway(_config(urls, **extra), TenantTable({KEY: TenantKey(tenant="tenant-r", max_concurrency=8)}))


def _sample(gw: Gateway, name: str, **labels) -> float:
    return gw.metrics.registry.get_sample_value("quillcache_gateway_" + name, labels) or 0.0


@pytest.mark.parametrize("client", ["native", "aiohttp"])
def test_a_malformed_engine_answer_is_a_502_and_the_engine_stays_healthy(client):
    async def run() -> None:
        server, port = await _start_engine()
        gw = _gateway(f"http://127.0.0.1:{port}", upstream_client=client, retry={"max_retries": 0})
        await gw.start()
        try:
            assert gw.healthy == [True]
            status, body = await _post(gw, _prompt("garbage"))
            # was: 503 "no engine is available", the engine marked down until the next probe
            assert status == 502, body
            assert json.loads(body)["error"]["message"].startswith(
                "the engines failed to answer: malformed response from the engine")
            assert gw.healthy == [True]
            assert _sample(gw, "upstream_errors_total", worker="e0", kind="protocol") == 1
            assert _sample(gw, "upstream_errors_total", worker="e0", kind="connect") == 0
            assert (await _post(gw, _prompt("continue")))[0] == 200  # and it serves the next request
        finally:
            await gw.stop()
            server.close()

    asyncio.run(run())


def test_decision_seconds_ends_at_the_decision_not_at_the_engines_answer():
    async def run() -> None:
        server, port = await _start_engine()
        gw = _gateway(f"http://127.0.0.1:{port}")
        await gw.start()
        try:
            for _ in range(3):
                t0 = time.perf_counter()
                assert (await _post(gw, _prompt("slow")))[0] == 200
                assert time.perf_counter() - t0 >= 0.4
            # was: each observation took the engine's 0.4 s answer with it (all in +Inf)
            assert _sample(gw, "decision_seconds_count") == 3
            assert _sample(gw, "decision_seconds_sum") < 0.3
            assert _sample(gw, "decision_seconds_bucket", le="0.05") == 3
        finally:
            await gw.stop()
            server.close()

    asyncio.run(run())


def test_no_retry_is_counted_or_slept_when_no_other_engine_is_left():
    async def run() -> None:
        server, port = await _start_engine()
        other, port2 = await _start_engine()
        one = _gateway(f"http://127.0.0.1:{port}", retry={"max_retries": 2, "backoff_s": 0.5})
        two = _gateway(f"http://127.0.0.1:{port},http://127.0.0.1:{port2}", retry={"max_retries": 2, "backoff_s": 0.1})
        await one.start()
        await two.start()
        try:
            t0 = time.perf_counter()
            assert (await _post(one, _prompt("s500")))[0] == 502
            assert time.perf_counter() - t0 < 0.4  # was: a 0.5 s backoff before giving up anyway
            assert _sample(one, "upstream_retries_total", worker="e0") == 0  # was: 1
            assert _sample(one, "upstream_errors_total", worker="e0", kind="status") == 1
            # with another engine left, the retry still happens: counted once, after its backoff
            t0 = time.perf_counter()
            assert (await _post(two, _prompt("s500")))[0] == 502
            assert time.perf_counter() - t0 >= 0.1
            retried = [_sample(two, "upstream_retries_total", worker=w) for w in ("e0", "e1")]
            assert sorted(retried) == [0, 1]
            assert [_sample(two, "upstream_errors_total", worker=w, kind="status") for w in ("e0", "e1")] == [1, 1]
        finally:
            await one.stop()
            await two.stop()
            server.close()
            other.close()

    asyncio.run(run())


# ------------------------------------------------------------------------------------ 7. a failed start
def _taken_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def test_a_failed_start_stops_what_it_started():
    taken, port = _taken_port()

    async def run() -> None:
        gw = _gateway("http://127.0.0.1:9", peer_bind=f"tcp://127.0.0.1:{port}")
        with pytest.raises(GatewayStartError, match=rf"peer_bind 'tcp://127.0.0.1:{port}': .*in use"):
            await gw.start()
        # was: the upstream client and the health loop left running
        assert gw.upstream.pool is None and gw._tasks == [] and not gw.started
        assert gw.decider.peers is None

    try:
        asyncio.run(run())
    finally:
        taken.close()


def test_the_cli_says_in_one_line_why_the_gateway_cannot_start(tmp_path):
    taken, port = _taken_port()
    try:
        (tmp_path / "c.json").write_text(json.dumps({"engines": [{"url": "http://127.0.0.1:9", "name": "e0"}],
                                                     "peer_bind": f"tcp://127.0.0.1:{port}"}))
        run = subprocess.run([sys.executable, "-m", "quillcache", "gateway", "--config", str(tmp_path / "c.json"),
                              "--port", "0"], capture_output=True, text=True, timeout=90,
                             env={**os.environ, "QUILLCACHE_GATEWAY_KEYS": f"{KEY}=tenant-r"})
    finally:
        taken.close()
    # was: exit 3 after a zmq traceback through uvicorn's lifespan
    assert run.returncode == 1 and run.stdout == "", (run.returncode, run.stderr[-2000:])
    assert run.stderr.strip().splitlines() == [
        f"quillcache gateway: cannot start: peer_bind 'tcp://127.0.0.1:{port}': Address already in use "
        f"(addr='tcp://127.0.0.1:{port}')"], run.stderr[-2000:]
