"""Gateway hardening, each case with its status and message, against real processes on 127.0.0.1: body cap (413),
malformed / deeply nested JSON (400), unknown model (404), missing / unknown key (401), tenant concurrency (429),
upstream connect failure and errors before the first byte (retry on the next-best worker, else 502/503), timeouts
(hang before headers), a failure mid-stream (one SSE error event, stream closed), and no traceback or internal
detail in any response. Faults are the STAND-IN engine's seeded knobs; which engine dies in the retry test is
drawn from a seeded RNG (seed in the assertion messages)."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import random
import threading
import time

import aiohttp
import openai
import pytest

from quillcache.enginesim.process import EngineSimProcess, parse_metrics
from quillcache.gateway.server import GatewayProcess
from quillcache.cluster.etcd import free_port as _free_port

pytestmark = pytest.mark.timeout(120)

MODEL = "quillcache-sim"
KEY, KEY_LIMITED = "sk-hardening-0001", "sk-limited-00001"
KEYS = {KEY: "tenant-h", KEY_LIMITED: "tenant-lim"}
FAST = ["--fixed-ttft-ms", "20", "--decode-ms-per-token", "1", "--model", MODEL]
CLIENTS = ("native", "aiohttp")  # the upstream clients (quillcache.gateway.clients.UPSTREAM_CLIENTS)


def _post(url: str, body: bytes | None = None, *, key: str | None = KEY, data=None, chunked=False):
    """(status, parsed or raw body, headers) of one POST."""

    async def main():
        headers = {"content-type": "application/json"}
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        async with aiohttp.ClientSession() as s:
            payload = body
            if chunked:
                async def gen():
                    for i in range(0, len(body), 65536):
                        yield body[i:i + 65536]
                payload = gen()
            async with s.post(url, data=payload, headers=headers) as r:
                raw = await r.read()
                return r.status, raw, dict(r.headers)

    return asyncio.run(main())


def _assert_clean_error(status_body, status: int, fragment: str):
    got, raw, _ = status_body
    text = raw.decode(errors="replace")
    assert got == status, (got, text)
    err = json.loads(raw)["error"]
    assert fragment in err["message"], err
    assert err["code"] == status
    for leak in ("Traceback", "File \"", "quillcache/", "Exception", "aiohttp", "starlette"):
        assert leak not in text, text


@pytest.fixture(scope="module")
def gw():
    with EngineSimProcess(FAST) as e0:
        config = {"limits": {"max_body_bytes": 65536, "max_json_depth": 16}}
        with GatewayProcess([e0.url], keys=KEYS, key_limits={KEY_LIMITED: 1}, config=config) as g:
            yield g


def test_body_over_the_cap_is_413(gw):
    big = json.dumps({"model": MODEL, "prompt": "x" * 70000}).encode()
    _assert_clean_error(_post(gw.url + "/v1/completions", big), 413, "over the limit of 65536 bytes")
    _assert_clean_error(_post(gw.url + "/v1/completions", big, chunked=True), 413, "over the limit of 65536 bytes")


def test_malformed_and_deep_json_is_400(gw):
    url = gw.url + "/v1/completions"
    _assert_clean_error(_post(url, b"{not json"), 400, "not valid JSON")
    _assert_clean_error(_post(url, b"\xff\xfe{}"), 400, "not valid JSON")
    _assert_clean_error(_post(url, b"[1, 2]"), 400, "must be a JSON object")
    deep = b'{"model": "m", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    _assert_clean_error(_post(url, deep), 400, "")
    nested = json.dumps({"model": MODEL, "prompt": "hi", "x": [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]}).encode()
    _assert_clean_error(_post(url, nested), 400, "nests deeper than 16 levels")
    _assert_clean_error(_post(url, json.dumps({"model": MODEL, "prompt": ["a", "b"]}).encode()), 400,
                        "batched prompts are not supported")
    _assert_clean_error(_post(url, json.dumps({"model": MODEL}).encode()), 400, "'prompt' is missing")
    _assert_clean_error(_post(url, json.dumps({"model": MODEL, "prompt": "x", "stream": "yes"}).encode()), 400,
                        "'stream' must be true or false")
    _assert_clean_error(_post(gw.url + "/v1/chat/completions",
                              json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}).encode()),
                        400, "wizard")


def test_stream_null_is_false_as_in_the_openai_api(gw):
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": "null stream", "max_tokens": 2}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2})):
        st, raw, headers = _post(gw.url + path, json.dumps({**body, "stream": None}).encode())
        assert st == 200, raw
        assert {k.lower(): v for k, v in headers.items()}["content-type"].startswith("application/json")
        assert json.loads(raw)["usage"]["completion_tokens"] == 2


def test_a_number_that_overflows_a_float_is_400_naming_its_field(gw):
    url = gw.url + "/v1/completions"
    body = b'{"model": "%s", "prompt": "hi", "max_tokens": 2, "temperature": 1e400}' % MODEL.encode()
    _assert_clean_error(_post(url, body), 400, "field 'temperature': the number 1e400 is out of range")
    body = b'{"model": "%s", "prompt": "hi", "logit_bias": {"50": -1e999}}' % MODEL.encode()
    _assert_clean_error(_post(url, body), 400, "field 'logit_bias.50': the number -1e999 is out of range")


def test_unknown_model_is_404_and_unknown_route_too(gw):
    c = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        c.completions.create(model="no-such-model", prompt="hi")
    _assert_clean_error(_post(gw.url + "/v1/nothing", b"{}"), 404, "no route")


def test_missing_or_unknown_key_is_401(gw):
    c = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-not-a-real-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="missing or unknown API key"):
        c.completions.create(model=MODEL, prompt="hi")
    _assert_clean_error(_post(gw.url + "/v1/completions", b"{}", key=None), 401, "missing or unknown API key")
    with pytest.raises(openai.AuthenticationError):
        c.models.list()


def test_tenant_over_its_concurrency_limit_is_429(gw):
    async def main():
        async with aiohttp.ClientSession() as s:
            h = {"authorization": f"Bearer {KEY_LIMITED}"}
            body = {"model": MODEL, "prompt": "hold " * 10, "max_tokens": 400, "stream": True}
            first = await s.post(gw.url + "/v1/completions", json=body, headers=h)
            assert first.status == 200
            async with s.post(gw.url + "/v1/completions", json=body, headers=h) as second:
                out = second.status, await second.read()
            # another tenant is not limited by it
            async with s.post(gw.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 1},
                              headers={"authorization": f"Bearer {KEY}"}) as other:
                assert other.status == 200
            first.close()
            return out

    status, raw = asyncio.run(main())
    _assert_clean_error((status, raw, {}), 429, "too many concurrent requests")




@pytest.mark.parametrize("client", CLIENTS)
def test_connect_failure_retries_on_the_next_best_worker(client):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    with EngineSimProcess(FAST) as e0, EngineSimProcess(FAST) as e1:
        config = {"timeouts": {"health_interval_s": 60}, "retry": {"max_retries": 2, "backoff_s": 0.01},
                  "upstream_client": client}
        with GatewayProcess([e0.url, e1.url], keys=KEYS, config=config) as gw:
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
            prompt = f"Sticky prompt {seed} " * 10
            victim = None
            for _ in range(2):  # route the prompt so the gateway knows where it is cached
                r = c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1)
                victim = r.headers["x-quillcache-worker"]
            if rng.random() < 0.5:  # the engine holding the prefix dies (a retry), or the other one (no retry)
                dead = victim
            else:
                dead = "e1" if victim == "e0" else "e0"
            {"e0": e0, "e1": e1}[dead].stop()
            r = c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1)
            assert r.headers["x-quillcache-worker"] != dead, f"seed {seed}"
            assert r.parse().usage.completion_tokens == 1
            m = parse_metrics(gw.metrics_text())
            retries = m[f'quillcache_gateway_upstream_retries_total{{worker="{dead}"}}']
            assert retries == (1.0 if dead == victim else 0.0), f"seed {seed}: dead={dead} victim={victim}"
            if dead == victim:
                assert m[f'quillcache_gateway_upstream_errors_total{{kind="connect",worker="{dead}"}}'] == 1
            # every engine gone: 503 with a message, no traceback
            {"e0": e0, "e1": e1}["e1" if dead == "e0" else "e0"].stop()
            _assert_clean_error(_post(gw.url + "/v1/completions",
                                      json.dumps({"model": MODEL, "prompt": prompt}).encode()),
                                503, "no engine is available")


def test_no_engine_reachable_at_all_is_503_and_not_ready():
    with GatewayProcess([f"http://127.0.0.1:{_free_port()}"], keys=KEYS, wait_ready=False,
                        config={"models": {MODEL: {}}}) as gw:
        st, raw, _ = _post(gw.url + "/v1/completions", json.dumps({"model": MODEL, "prompt": "x"}).encode())
        _assert_clean_error((st, raw, {}), 503, "no engine is available")
        import urllib.error
        import urllib.request

        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(gw.url + "/ready", timeout=5)
        assert ei.value.code == 503


@pytest.mark.parametrize("client", CLIENTS)
def test_engine_errors_before_the_first_byte_are_retried_then_502(client):
    err = [*FAST, "--error-rate", "1.0", "--fault-seed", "11"]
    with EngineSimProcess(err) as e0, EngineSimProcess(err) as e1:
        config = {"retry": {"max_retries": 1, "backoff_s": 0.01}, "upstream_client": client}
        with GatewayProcess([e0.url, e1.url], keys=KEYS, config=config) as gw:
            st = _post(gw.url + "/v1/completions", json.dumps({"model": MODEL, "prompt": "boom " * 8}).encode())
            _assert_clean_error(st, 502, "engine answered HTTP 500")
            m = parse_metrics(gw.metrics_text())
            assert sum(v for k, v in m.items() if k.startswith("quillcache_gateway_upstream_errors_total")
                       and 'kind="status"' in k) == 2
            assert sum(v for k, v in m.items() if k.startswith("quillcache_gateway_upstream_retries_total")) == 1


@pytest.mark.parametrize("client", CLIENTS)
def test_hang_before_headers_hits_the_first_byte_timeout(client):
    with EngineSimProcess([*FAST, "--hang-before-headers-s", "30"]) as e0:
        config = {"timeouts": {"first_byte_s": 0.3}, "retry": {"max_retries": 0}, "upstream_client": client}
        with GatewayProcess([e0.url], keys=KEYS, config=config) as gw:
            t0 = time.monotonic()
            st = _post(gw.url + "/v1/completions", json.dumps({"model": MODEL, "prompt": "hang " * 8}).encode())
            assert time.monotonic() - t0 < 5
            _assert_clean_error(st, 502, "no response within 0.3 s")
            assert _wait_loads_zero(gw)


def _wait_loads_zero(gw, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = parse_metrics(gw.metrics_text())
        inflight = sum(v for k, v in m.items() if k.startswith("quillcache_gateway_inflight_requests{"))
        if inflight == 0 and m["quillcache_gateway_tenant_inflight_requests"] == 0:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("client", CLIENTS)
def test_failure_mid_stream_ends_with_one_sse_error_event(client):
    with EngineSimProcess([*FAST, "--die-mid-stream-after-tokens", "3"]) as e0:
        with GatewayProcess([e0.url], keys=KEYS, config={"upstream_client": client}) as gw:
            st, raw, headers = _post(gw.url + "/v1/completions", json.dumps(
                {"model": MODEL, "prompt": "die " * 8, "max_tokens": 20, "stream": True}).encode())
            assert st == 200 and headers["x-quillcache-worker"] == "e0"
            events = [e for e in raw.decode().split("\n\n") if e.strip()]
            assert all(e.startswith("data: ") for e in events), events
            payloads = [json.loads(e[6:]) for e in events]
            assert len(payloads) >= 2 and "error" in payloads[-1] and "[DONE]" not in raw.decode()
            assert payloads[-1]["error"]["message"] == "the engine failed mid-stream; the response is incomplete"
            assert all("error" not in p for p in payloads[:-1])
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
            with pytest.raises(openai.APIError, match="failed mid-stream"):
                for _ in c.completions.create(model=MODEL, prompt="die " * 8, max_tokens=20, stream=True):
                    pass
            assert _wait_loads_zero(gw)
            m = parse_metrics(gw.metrics_text())
            assert m['quillcache_gateway_upstream_errors_total{kind="mid_stream",worker="e0"}'] == 2


@pytest.mark.parametrize("client", CLIENTS)
def test_idle_timeout_mid_stream_ends_with_an_error_event(client):
    with EngineSimProcess(["--fixed-ttft-ms", "5", "--decode-ms-per-token", "3000", "--model", MODEL]) as e0:
        with GatewayProcess([e0.url], keys=KEYS, config={"timeouts": {"idle_s": 0.4},
                                                                "upstream_client": client}) as gw:
            t0 = time.monotonic()
            st, raw, _ = _post(gw.url + "/v1/completions", json.dumps(
                {"model": MODEL, "prompt": "slow " * 8, "max_tokens": 5, "stream": True}).encode())
            assert st == 200 and time.monotonic() - t0 < 2.5
            events = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.strip()]
            assert "error" in events[-1] and "failed mid-stream" in events[-1]["error"]["message"]
            assert _wait_loads_zero(gw)


_SSE_LINE_ENDS = {"lf": b"\n", "cr": b"\r", "crlf": b"\r\n"}


def _sse_wire(framing: str) -> bytes:
    """An OpenAI-shaped completion stream framed as named: ``lf``/``cr``/``crlf`` line ends (all valid SSE), or
    ``unterminated`` (LF, the last event without its blank line)."""
    eol = _SSE_LINE_ENDS.get(framing, b"\n")
    events = [b"data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "fake",
                                      "choices": [{"index": 0, "text": f"t{i}", "logprobs": None,
                                                   "finish_reason": None}]}).encode() for i in range(3)]
    wire = b"".join(e + eol + eol for e in events) + b"data: [DONE]"
    return wire + (b"\n" if framing == "unterminated" else eol + eol)


class FakeEngine(http.server.BaseHTTPRequestHandler):
    """A raw HTTP stand-in engine serving one model, ``fake``, on ``/v1/models``; subclasses answer POSTs."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        body = json.dumps({"object": "list", "data": [{"id": "fake", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextlib.contextmanager
def serve_fake_engine(handler: type[FakeEngine]):
    """``handler`` served on 127.0.0.1 (a free port) until the block ends; yields its base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


class _SseUpstream(FakeEngine):
    """A stand-in for an OpenAI-compatible engine whose SSE framing differs from engine-sim's: the completion
    stream is ``_sse_wire(prompt)``, sent as HTTP chunks cut at points drawn from a seeded RNG."""

    def do_POST(self) -> None:
        prompt = json.loads(self.rfile.read(int(self.headers["content-length"])))["prompt"]
        wire = _sse_wire(prompt)
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        rng = random.Random(f"sse-{prompt}")
        cuts = sorted(rng.sample(range(1, len(wire)), 12)) + [len(wire)]
        start = 0
        for cut in cuts:
            self.wfile.write(b"%x\r\n%s\r\n" % (cut - start, wire[start:cut]))
            self.wfile.flush()
            start = cut
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture(scope="module")
def sse_upstream():
    with serve_fake_engine(_SseUpstream) as url:
        yield url


@pytest.mark.parametrize("client", CLIENTS)
def test_sse_framed_with_cr_or_crlf_or_unterminated_passes_through_whole(client, sse_upstream):
    with GatewayProcess([sse_upstream], keys=KEYS, config={"models": {"fake": {}}, "upstream_client": client}) as gw:
        for framing in ("crlf", "cr", "lf", "unterminated"):
            st, raw, _ = _post(gw.url + "/v1/completions", json.dumps(
                {"model": "fake", "prompt": framing, "stream": True}).encode())
            assert st == 200 and raw == _sse_wire(framing), (framing, raw[:200])
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        for framing in ("crlf", "cr"):
            texts = [ch.choices[0].text for ch in c.completions.create(model="fake", prompt=framing, stream=True)]
            assert texts == ["t0", "t1", "t2"], framing
        m = parse_metrics(gw.metrics_text())
        assert m["quillcache_gateway_time_to_first_token_seconds_count"] == 6  # every stream produced output
        assert m.get('quillcache_gateway_requests_total{endpoint="/v1/completions",status="200"}') == 6
        assert _wait_loads_zero(gw)


def test_cli_refuses_bad_flags_in_one_line(tmp_path, capsys, monkeypatch):
    from quillcache.cli import main

    def run(*args):
        rc = main(["gateway", *args])
        return rc, capsys.readouterr().err.strip()

    rc, err = run()
    assert rc == 2 and err == "quillcache gateway: give --engines URL[,URL...] or --config FILE"
    rc, err = run("--engines", "ftp://x:1")
    assert rc == 2 and "is not a http/https URL" in err and "\n" not in err
    bad = tmp_path / "k.json"
    bad.write_text("{}")
    rc, err = run("--engines", "http://127.0.0.1:9", "--keys", str(bad))
    assert rc == 2 and "must be {" in err and "Traceback" not in err
    monkeypatch.delenv("QUILLCACHE_GATEWAY_KEYS", raising=False)
    rc, err = run("--engines", "http://127.0.0.1:9")
    assert rc == 2 and "no API keys" in err
    conf = tmp_path / "c.json"
    conf.write_text('{"engines": [{"url": "http://127.0.0.1:9"}], "limits": {"max_body_bytes": -1}}')
    rc, err = run("--config", str(conf), "--keys", str(bad))
    assert rc == 2 and "limits.max_body_bytes=-1" in err
