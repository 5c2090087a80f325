"""quillcache.httpserve.guard on the real servers (gateway and STAND-IN engine on 127.0.0.1): a head over the size
limit is 431, a connection or head that stalls is 408 and closed, a body that goes silent is 408 and closed,
malformed framing is 400 naming the fault, and after all of it the server still serves; a streaming response
longer than every limit is not cut. Deadlines are the gateway's config (short here); every wait is a socket read
with a timeout."""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import openai
import pytest

from quillcache.enginesim.process import EngineSimProcess
from quillcache.gateway.config import ConfigError, LimitsConfig
from quillcache.gateway.server import GatewayProcess
from quillcache.httpserve import HttpGuard, guarded_protocol

pytestmark = pytest.mark.timeout(120)

MODEL = "quillcache-sim"
KEY = "sk-httpguard-0001"
HEAD_S, BODY_S = 0.5, 0.5


def _addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _read_all(sock: socket.socket, deadline_s: float) -> bytes:
    """Everything the server sends until it closes (or ``deadline_s`` passes: then what came so far)."""
    out = b""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        sock.settimeout(max(0.01, end - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, socket.timeout):
            break
        except ConnectionResetError:
            break
        if not chunk:
            return out
        out += chunk
    raise AssertionError(f"the server did not close the connection within {deadline_s} s (got {out[:200]!r})")


def _exchange(url: str, data: bytes, deadline_s: float = 10.0) -> tuple[bytes, float]:
    """(what the server answered before closing, seconds it took) after sending ``data`` and then nothing."""
    with socket.create_connection(_addr(url), timeout=5) as s:
        t0 = time.monotonic()
        if data:
            s.sendall(data)
        return _read_all(s, deadline_s), time.monotonic() - t0


def _healthy(url: str) -> bool:
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return r.status == 200


@pytest.fixture(scope="module")
def engine():
    with EngineSimProcess(["--fixed-ttft-ms", "5", "--decode-ms-per-token", "1", "--model", MODEL]) as e:
        yield e


@pytest.fixture(scope="module")
def gw(engine):
    config = {"limits": {"max_head_bytes": 4096}, "timeouts": {"client_head_s": HEAD_S, "client_body_s": BODY_S}}
    with GatewayProcess([engine.url], keys={KEY: "tenant-g"}, config=config) as g:
        yield g


def test_a_head_over_the_limit_is_431_and_the_server_keeps_serving(engine, gw):
    for url, limit in ((gw.url, 4096), (engine.url, 64 << 10)):
        big = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (limit + 10) + b"\r\n\r\n"
        answer, _ = _exchange(url, big)
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        assert f"over {limit} bytes".encode() in answer
        # a head that never ends is refused once it passes the limit, without waiting for its end
        with socket.create_connection(_addr(url), timeout=5) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nX-Pad: " + b"b" * (2 * limit))
            answer = _read_all(s, 10.0)
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        assert _healthy(url)
    # a head just under the limit is served
    ok = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Pad: " + b"a" * 3000 + b"\r\n\r\n"
    answer, _ = _exchange(gw.url, ok)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]


def test_a_silent_connection_and_a_stalled_head_are_408_within_the_deadline(gw):
    for data in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le"):
        answer, took = _exchange(gw.url, data)
        assert answer.startswith(b"HTTP/1.1 408 "), (data, answer[:200])
        assert b"request head not complete within 0.5 s" in answer
        assert HEAD_S * 0.9 <= took < HEAD_S + 5.0, took
    assert _healthy(gw.url)


def test_a_body_that_goes_silent_is_408_and_the_app_sees_a_disconnect(gw):
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    answer, took = _exchange(gw.url, head + body[:5])
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"request body silent for 0.5 s" in answer
    assert took < BODY_S + 5.0
    # the same request sent whole is served on the same server
    answer, _ = _exchange(gw.url, head.replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n") + body)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]


def test_malformed_framing_is_400_naming_the_fault(engine, gw):
    for url in (gw.url, engine.url):
        answer, _ = _exchange(url, b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
        text = answer.split(b"\r\n\r\n", 1)[1].decode()
        assert text.startswith("Invalid HTTP request received: ") and len(text) > len("Invalid HTTP request received: ")
        assert _healthy(url)


def test_a_stream_longer_than_every_limit_is_not_cut(engine):
    """Limits apply while the client sends; a response the server streams for longer is never cut."""
    with EngineSimProcess(["--fixed-ttft-ms", "5", "--decode-ms-per-token", "60", "--model", MODEL]) as slow:
        config = {"timeouts": {"client_head_s": 0.3, "client_body_s": 0.3}}
        with GatewayProcess([slow.url], keys={KEY: "tenant-g"}, config=config) as g:
            client = openai.OpenAI(base_url=g.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
            t0 = time.monotonic()
            chunks = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=20, stream=True))
            assert time.monotonic() - t0 > 0.6  # the stream outlived both limits
            assert sum(len(c.choices[0].text) for c in chunks if c.choices) > 0


def test_limits_are_validated():
    with pytest.raises(ValueError, match="max_head_bytes"):
        HttpGuard(max_head_bytes=10)
    with pytest.raises(ValueError, match="head_timeout_s"):
        HttpGuard(head_timeout_s=0)
    with pytest.raises(TypeError, match="HttpGuard"):
        guarded_protocol({"max_head_bytes": 1000})
    with pytest.raises(ConfigError, match="limits.max_head_bytes"):
        LimitsConfig(max_head_bytes=100)
