"""Review fixes of the HTTP surface, on the real gateway and STAND-IN engine (127.0.0.1, free ports):

1. guard: bytes a client sends while a response streams (a stray CRLF, a pipelined request's head or half
   its body) start no head/body timer until that response is complete; the stream is never cut, no
   answer is ever written into it, and the pipelined request is then served (or refused after it);
2. engine: a lone surrogate in ``model`` is a 404 naming it, never a 500 with a traceback;
5. both servers: a Content-Type other than JSON is 415 naming it (none, or JSON with parameters, is served);
6. a JSON integer with more digits than CPython converts is a 400 naming the limit;
7. engine: a body over the cap is an OpenAI-shaped 413, as the gateway's;
8. guard: a head is measured in bytes received up to its end, whitespace included, also when it arrives
   in one read or follows a request body in the same read.

Every wait is a socket read with a deadline (the stream itself lasts longer than the limits)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from quillcache.enginesim.app import MAX_BODY_BYTES
from quillcache.enginesim.process import EngineSimProcess
from quillcache.gateway.server import GatewayProcess
from quillcache.httpserve.jsonbody import BodyError, BodyTooLarge, loads_strict, read_capped
from test_httpserve_guard import _addr, _exchange, _read_all

pytestmark = pytest.mark.timeout(120)

MODEL = "quillcache-sim"
KEY = "sk-http-review-0001"
LIMIT_S = 1.0  # the gateway's head and body timeouts here
HEAD_LIMIT = 4096
TOKENS = 40  # x 60 ms per token: a stream of ~2.4 s, longer than both timeouts
END = b"\r\n0\r\n\r\n"  # the last chunk of a chunked response


@pytest.fixture(scope="module")
def engine():
    with EngineSimProcess(["--fixed-ttft-ms", "5", "--decode-ms-per-token", "60", "--model", MODEL]) as e:
        yield e


@pytest.fixture(scope="module")
def gw(engine):
    config = {"limits": {"max_head_bytes": HEAD_LIMIT},
              "timeouts": {"client_head_s": LIMIT_S, "client_body_s": LIMIT_S}}
    with GatewayProcess([engine.url], keys={KEY: "tenant-r"}, config=config) as g:
        yield g


def _recv_until(sock: socket.socket, marker: bytes, deadline_s: float, got: bytes = b"") -> bytes:
    """What the server sends until ``marker`` has arrived (AssertionError if it does not within ``deadline_s``)."""
    end = time.monotonic() + deadline_s
    while marker not in got:
        left = end - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{marker!r} did not arrive within {deadline_s} s (got ...{got[-300:]!r})")
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, socket.timeout):
            continue
        if not chunk:
            raise AssertionError(f"the server closed before {marker!r} (got ...{got[-300:]!r})")
        got += chunk
    return got


def _post_head(path: str, body: bytes, *, ctype: str | None = "application/json", close: bool = False) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n"
    if ctype is not None:
        head += f"Content-Type: {ctype}\r\n"
    if close:
        head += "Connection: close\r\n"
    return head.encode() + b"\r\n"


def _post(url: str, path: str, body: bytes, *, ctype: str | None = "application/json") -> tuple[int, bytes]:
    """(status, body) of one POST over a fresh connection."""
    answer, _ = _exchange(url, _post_head(path, body, ctype=ctype, close=True) + body)
    status = int(answer.split(b" ", 2)[1])
    return status, answer.partition(b"\r\n\r\n")[2]


def _stream_request() -> bytes:
    body = json.dumps({"model": MODEL, "prompt": "stream me", "max_tokens": TOKENS, "stream": True}).encode()
    return _post_head("/v1/completions", body) + body


def _check_whole_stream(stream: bytes) -> None:
    assert stream.startswith(b"HTTP/1.1 200 "), stream[:300]
    assert stream.count(b'"text_completion"') == TOKENS, stream[-500:]
    assert stream.endswith(b"data: [DONE]\n\n"), stream[-300:]
    assert b"HTTP/1.1 4" not in stream  # no answer written into the stream


# ---------------------------------------------------------------- 1. nothing a client sends cuts a stream
def test_a_stray_crlf_and_a_pipelined_head_during_a_stream_do_not_cut_it_and_the_request_is_served(gw):
    with socket.create_connection(_addr(gw.url), timeout=10) as s:
        s.sendall(_stream_request())
        got = _recv_until(s, b"data: ", 10)  # the stream has started
        t0 = time.monotonic()
        s.sendall(b"\r\n")  # a stray CRLF (RFC 9112 2.2: a server SHOULD ignore it)
        s.sendall(b"GET /health HTTP/1.1\r\nHo")  # and the start of a pipelined request
        got = _recv_until(s, END, 20, got)
        assert time.monotonic() - t0 > LIMIT_S  # both timers would have fired during the stream
        s.sendall(b"st: x\r\nConnection: close\r\n\r\n")  # its head deadline runs from the stream's end
        rest = _read_all(s, 10)
    stream, _, after = got.partition(END)
    _check_whole_stream(stream)
    assert (after + rest).startswith(b"HTTP/1.1 200 "), after + rest
    assert b'"status":"ok"' in rest or b'"status":"ok"' in after


def test_a_pipelined_body_half_sent_during_a_stream_gets_its_deadline_after_it(gw):
    body = json.dumps({"model": MODEL, "prompt": "again", "max_tokens": 2}).encode()
    with socket.create_connection(_addr(gw.url), timeout=10) as s:
        s.sendall(_stream_request())
        got = _recv_until(s, b"data: ", 10)
        t0 = time.monotonic()
        s.sendall(_post_head("/v1/completions", body, close=True) + body[:10])
        got = _recv_until(s, END, 20, got)
        assert time.monotonic() - t0 > LIMIT_S  # its body was silent longer than the body timeout
        s.sendall(body[10:])
        rest = _read_all(s, 10)
    stream, _, after = got.partition(END)
    _check_whole_stream(stream)
    answer = after + rest
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["object"] == "text_completion"


def test_a_pipelined_head_over_the_limit_during_a_stream_is_refused_after_it(gw):
    with socket.create_connection(_addr(gw.url), timeout=10) as s:
        s.sendall(_stream_request())
        got = _recv_until(s, b"data: ", 10)
        s.sendall(b"GET /health HTTP/1.1\r\nX-Pad: " + b"a" * (2 * HEAD_LIMIT))  # never ends
        got += _read_all(s, 20)
    stream, sep, after = got.partition(END)
    assert sep, got[-300:]
    _check_whole_stream(stream)
    assert after.startswith(b"HTTP/1.1 431 "), after[:300]
    assert f"over {HEAD_LIMIT} bytes".encode() in after


# ---------------------------------------------------------------- 8. the head is measured in bytes received
def _padded_head(size: int) -> bytes:
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Pad:" + b"a\r\n\r\n"
    return head.replace(b"X-Pad:", b"X-Pad:" + b" " * (size - len(head)))  # whitespace before the value


def test_a_head_padded_with_whitespace_counts_every_byte_up_to_its_end(gw):
    for size, status in ((HEAD_LIMIT, b"200"), (HEAD_LIMIT + 1, b"431"), (60_000, b"431")):
        head = _padded_head(size)
        assert len(head) == size
        answer, _ = _exchange(gw.url, head)  # one send: usually one read
        assert answer.startswith(b"HTTP/1.1 " + status), (size, answer[:200])
        with socket.create_connection(_addr(gw.url), timeout=5) as s:  # its end split across two sends
            s.sendall(head[:-3])
            s.sendall(head[-3:])
            answer = _read_all(s, 10)
        assert answer.startswith(b"HTTP/1.1 " + status), (size, answer[:200])


def test_a_head_after_a_request_body_in_the_same_read_is_measured_from_its_start(gw):
    first = b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
    answer, _ = _exchange(gw.url, first + _padded_head(HEAD_LIMIT))
    assert answer.count(b"HTTP/1.1 200 ") == 2, answer[:600]
    answer, _ = _exchange(gw.url, first + _padded_head(60_000))
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]  # the first is served, then the refusal
    assert b"HTTP/1.1 431 " in answer, answer[:600]


# ---------------------------------------------------------------- 2. a lone surrogate in the model
def test_a_lone_surrogate_in_the_model_is_a_404_naming_it(engine):
    for path, body in (("/v1/completions", b'{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}'),
                       ("/v1/chat/completions", b'{"model": "nope-\\udfff", "messages": [{"role": "user", '
                                                b'"content": "x"}]}')):
        status, raw = _post(engine.url, path, body)
        assert status == 404, raw
        err = json.loads(raw)["error"]
        assert err["code"] == 404 and "does not exist" in err["message"], err
        assert "\\ud800" in err["message"] or "\\udfff" in err["message"], err
        assert raw.decode("utf-8")  # the answer is valid UTF-8


# ---------------------------------------------------------------- 5. Content-Type
def test_a_body_declared_as_something_other_than_json_is_415_naming_the_type(engine, gw):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    for url in (engine.url, gw.url):
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            status, raw = _post(url, "/v1/completions", body, ctype=ctype)
            assert status == 415, (url, ctype, raw)
            err = json.loads(raw)["error"]
            assert err["code"] == 415 and ctype.split(";")[0] in err["message"], err
        for ctype in (None, "application/json", "application/json; charset=utf-8", "Application/JSON",
                      "application/vnd.quill+json"):
            status, raw = _post(url, "/v1/completions", body, ctype=ctype)
            assert status == 200, (url, ctype, raw)


# ---------------------------------------------------------------- 6. an integer with too many digits
def test_an_integer_with_too_many_digits_names_the_limit(engine, gw):
    raw = b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "max_tokens": ' + b"1" * 5000 + b"}"
    with pytest.raises(BodyError, match=r"a number in the body has too many digits \(limit 4300") as ei:
        loads_strict(raw)
    assert "not valid JSON" not in str(ei.value) and "set_int_max_str_digits" not in str(ei.value)
    assert loads_strict(b"[" + b"9" * 4300 + b"]") == [int("9" * 4300)]  # at the limit: a number
    for url in (engine.url, gw.url):
        status, body = _post(url, "/v1/completions", raw)
        assert status == 400, body
        assert "too many digits (limit 4300" in json.loads(body)["error"]["message"]


# ---------------------------------------------------------------- 7. the engine's 413
def test_the_engine_body_cap_is_an_openai_shaped_413(engine):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: " + str(MAX_BODY_BYTES + 1).encode() + b"\r\n\r\n")
    answer, _ = _exchange(engine.url, head + b"a" * 1024)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    err = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert err["code"] == 413 and f"over the limit of {MAX_BODY_BYTES} bytes" in err["message"], err


def test_a_body_without_a_length_is_refused_once_it_passes_the_cap():
    class Chunked:  # a body sent chunked: no Content-Length, so the cap is checked as it is read
        headers: dict[str, str] = {}

        async def stream(self):
            for _ in range(10):
                yield b"x" * 100

    with pytest.raises(BodyTooLarge, match="over the limit of 450 bytes"):
        asyncio.run(read_capped(Chunked(), 450))
    assert asyncio.run(read_capped(Chunked(), 1000)) == b"x" * 1000
