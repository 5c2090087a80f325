"""An engine that ends its stream with an OpenAI error event (vLLM does; engine-sim does since its review fixes) is
not a stream that produced output: the gateway passes the event on as the engine sent it, counts it
(``upstream_errors_total{kind="error_event"}``), records no time to first token when the error came before any
output, and takes back the residency it guessed for the prompt (the engine never processed it). Before, the error
event was read as the first token: no error counted, a TTFT sample, and the guessed entries kept (re-review of
2026-11-29, /tmp/s35/rr_servers M1). Against a real gateway process and a raw HTTP stand-in engine on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json

import pytest
from polling import wait_until
from test_gateway_hardening import (CLIENTS, KEYS, FakeEngine, _post, _wait_loads_zero,
                                    serve_fake_engine)

from quillcache.enginesim.process import parse_metrics
from quillcache.gateway.proxying import sse_error_event
from quillcache.gateway.server import GatewayProcess

pytestmark = pytest.mark.timeout(120)

_ERROR = {"error": {"message": "engine bug", "type": "InternalServerError", "param": None, "code": 500}}


def _event(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def _token(i: int) -> bytes:
    return _event({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": f"t{i}"}]})


def _wire(prompt: str) -> bytes:
    """``error-first``: the error event, then [DONE] (vLLM's order); ``error-after-2``: two tokens, then the error;
    ``tokens``: three tokens and [DONE]; ``error-word``: a token whose text says "error" (output, not an error)."""
    if prompt.startswith("error-first"):
        return _event(_ERROR) + _event(b"[DONE]")
    if prompt.startswith("error-after-2"):
        return _token(0) + _token(1) + _event(_ERROR)
    if prompt.startswith("error-word"):
        return _event({"choices": [{"index": 0, "text": '{"error": "not one"}'}]}) + _event(b"[DONE]")
    return _token(0) + _token(1) + _token(2) + _event(b"[DONE]")


class _Engine(FakeEngine):
    def do_POST(self) -> None:
        prompt = json.loads(self.rfile.read(int(self.headers["content-length"])))["prompt"]
        wire = _wire(prompt)
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(wire)))
        self.end_headers()
        self.wfile.write(wire)


@pytest.fixture(scope="module")
def engine():
    with serve_fake_engine(_Engine) as url:
        yield url


def _residency(gw) -> float:
    m = parse_metrics(gw.metrics_text())
    return sum(v for k, v in m.items() if k.startswith("quillcache_gateway_residency_entries{"))


def _wait_residency(gw, want: float, timeout_s: float = 10.0) -> float:
    """The gateway's residency entries once they equal ``want``, or as they are at the deadline."""
    with contextlib.suppress(AssertionError):
        wait_until(lambda: _residency(gw) == want, timeout_s, f"{want} residency entries")
    return _residency(gw)


@pytest.mark.parametrize("client", CLIENTS)
def test_an_error_event_before_any_output_is_an_upstream_error_not_a_first_token(client, engine):
    with GatewayProcess([engine], keys=KEYS, config={"models": {"fake": {}}, "upstream_client": client}) as gw:
        prompt = "error-first " + "word " * 3000  # several full blocks: the gateway guesses they become resident
        st, raw, _ = _post(gw.url + "/v1/completions", json.dumps(
            {"model": "fake", "prompt": prompt, "stream": True}).encode())
        assert st == 200 and raw == _wire(prompt)  # passed on as the engine sent it
        assert _wait_loads_zero(gw)
        m = parse_metrics(gw.metrics_text())
        assert sum(v for k, v in m.items() if 'kind="error_event"' in k) == 1
        assert m.get("quillcache_gateway_time_to_first_token_seconds_count", 0) == 0
        assert _wait_residency(gw, 0) == 0  # the guess taken back: the engine never processed the prompt

        # output before the error: a first token (TTFT), the error counted, the prompt's blocks kept
        prompt2 = "error-after-2 " + "word " * 3000
        st, raw, _ = _post(gw.url + "/v1/completions", json.dumps(
            {"model": "fake", "prompt": prompt2, "stream": True}).encode())
        assert st == 200 and raw == _wire(prompt2)
        assert _wait_loads_zero(gw)
        m = parse_metrics(gw.metrics_text())
        assert sum(v for k, v in m.items() if 'kind="error_event"' in k) == 2
        assert m["quillcache_gateway_time_to_first_token_seconds_count"] == 1
        assert _residency(gw) > 0

        # a token whose text holds the word is output, not an error
        st, raw, _ = _post(gw.url + "/v1/completions", json.dumps(
            {"model": "fake", "prompt": "error-word", "stream": True}).encode())
        assert st == 200
        m = parse_metrics(gw.metrics_text())
        assert sum(v for k, v in m.items() if 'kind="error_event"' in k) == 2
        assert m["quillcache_gateway_time_to_first_token_seconds_count"] == 2


def test_sse_error_event_finds_the_first_error_and_only_errors():
    assert sse_error_event(_token(0) + _token(1)) is None
    assert sse_error_event(_event(_ERROR) + _event(b"[DONE]")) == 0
    assert sse_error_event(_token(0) + _token(1) + _event(_ERROR)) == 2
    assert sse_error_event(_event({"object": "error", "message": "bad", "code": 400})) == 0  # vLLM's older shape
    assert sse_error_event(_wire("error-word")) is None
    assert sse_error_event(b'data: {"error": "just a string"}\n\n') is None
    assert sse_error_event(b'data: {"error": {"message": "x"}}\r\n\r\n') == 0
