"""The gateway end to end: real uvicorn servers on 127.0.0.1 (the gateway and STAND-IN engines, each its own
process), the official ``openai`` SDK as the client (headers through ``with_raw_response`` /
``with_streaming_response``), never an in-process ASGI transport."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time

import aiohttp
import openai
import pytest

from polling import wait_until

from quillcache.enginesim.process import EngineSimProcess, parse_metrics
from quillcache.gateway.server import GatewayProcess

pytestmark = pytest.mark.timeout(120)

MODEL = "quillcache-sim"
LORA = "quillcache-sim-sql"  # a LoRA adapter the stand-in serves under its own model name
KEYS = {"sk-tenant-a-0001": "tenant-a", "sk-tenant-b-0001": "tenant-b"}
KEY_A, KEY_B = "sk-tenant-a-0001", "sk-tenant-b-0001"


def _qc_headers(headers) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items() if k.lower().startswith("x-quillcache-")}


def _wait_until(fn, what: str, timeout_s: float = 10.0):
    return wait_until(fn, timeout_s, what)


@pytest.fixture(scope="module")
def stack():
    """Two stand-in engines (fast: 20 ms TTFT, 1 ms/token) behind one gateway (approximate prefix state)."""
    args = ["--fixed-ttft-ms", "20", "--decode-ms-per-token", "1", "--model", MODEL, "--lora", LORA]
    with EngineSimProcess(args) as e0, EngineSimProcess(args) as e1:
        with GatewayProcess([e0.url, e1.url], keys=KEYS, config={"seed": 3}) as gw:
            yield gw, [e0, e1]


def _client(gw, key=KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)


def test_completions_and_chat_streaming_and_not_through_the_sdk(stack):
    gw, engines = stack
    c = _client(gw)
    raw = c.completions.with_raw_response.create(model=MODEL, prompt="The quick brown fox " * 10, max_tokens=4)
    h = _qc_headers(raw.headers)
    assert set(h) == {"x-quillcache-worker", "x-quillcache-cached-tokens", "x-quillcache-timing-class",
                      "x-quillcache-request-id"}
    assert h["x-quillcache-worker"] in ("e0", "e1") and h["x-quillcache-timing-class"] in ("within-slo", "over-slo")
    r = raw.parse()
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens == 200 and r.choices[0].text
    raw2 = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello " * 40}], max_tokens=3)
    assert raw2.parse().choices[0].message.content
    assert _qc_headers(raw2.headers)["x-quillcache-request-id"] != h["x-quillcache-request-id"]
    with c.chat.completions.with_streaming_response.create(
            model=MODEL, messages=[{"role": "user", "content": "stream me " * 30}], max_tokens=5, stream=True,
            stream_options={"include_usage": True}) as resp:
        assert _qc_headers(resp.headers)["x-quillcache-worker"] in ("e0", "e1")
        chunks = list(resp.parse())
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    stream = c.completions.create(model=MODEL, prompt="count " * 50, max_tokens=6, stream=True)
    assert sum(len(ch.choices) for ch in stream) == 6
    models = c.models.list()
    assert sorted(m.id for m in models.data) == sorted([MODEL, LORA])


def test_a_lora_adapter_is_its_own_scope(stack):
    """The same prompt under the base model and under its LoRA adapter never shares cache (discovered from
    the engines' /v1/models: the adapter's ``parent`` is the base model)."""
    gw, engines = stack
    c = _client(gw)
    prompt = "Adapter scope check with a reasonably long prompt. " * 6
    for _ in range(2):
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    r = c.completions.with_raw_response.create(model=LORA, prompt=prompt, max_tokens=1)
    assert r.headers["x-quillcache-cached-tokens"] == "0"
    assert r.parse().usage.prompt_tokens_details.cached_tokens == 0
    r = c.completions.with_raw_response.create(model=LORA, prompt=prompt, max_tokens=1)
    assert int(r.headers["x-quillcache-cached-tokens"]) == r.parse().usage.prompt_tokens_details.cached_tokens > 0


def test_repeated_prompt_routes_to_its_cache_and_headers_match_the_engine(stack):
    gw, engines = stack
    c = _client(gw)
    prompt = "A long shared system prompt about caching. " * 12  # 528 byte tokens, 33 blocks
    first = c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert _qc_headers(first.headers)["x-quillcache-cached-tokens"] == "0"
    worker = _qc_headers(first.headers)["x-quillcache-worker"]
    for _ in range(3):
        again = c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=2)
        h = _qc_headers(again.headers)
        assert h["x-quillcache-worker"] == worker
        engine_cached = again.parse().usage.prompt_tokens_details.cached_tokens
        assert int(h["x-quillcache-cached-tokens"]) == engine_cached == 512


def test_another_tenants_history_changes_nothing_tenant_b_sees(stack):
    """Tenant B's headers and usage for a prompt are the same whether or not tenant A sent it before."""
    gw, engines = stack
    ca, cb = _client(gw, KEY_A), _client(gw, KEY_B)
    fresh = "Alpha: a private prompt that nobody has sent before. " * 6  # no block in common with `shared`
    shared = "Bravo: a private prompt that tenant A sends first. " * 6
    for _ in range(3):
        ra = ca.completions.with_raw_response.create(model=MODEL, prompt=shared, max_tokens=2)
    assert int(_qc_headers(ra.headers)["x-quillcache-cached-tokens"]) > 0  # A's own cache works
    seen = []
    for prompt in (fresh, shared):
        rb = cb.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=2)
        h = _qc_headers(rb.headers)
        usage = rb.parse().usage
        seen.append((h["x-quillcache-cached-tokens"], h["x-quillcache-timing-class"],
                     usage.prompt_tokens_details.cached_tokens))
    assert seen[0] == seen[1] == ("0", seen[0][1], 0), seen
    # and B's own repeat hits its own (salted) blocks
    rb = cb.completions.with_raw_response.create(model=MODEL, prompt=shared, max_tokens=2)
    assert rb.parse().usage.prompt_tokens_details.cached_tokens > 0


def test_client_cache_salt_narrows_the_scope(stack):
    gw, engines = stack
    c = _client(gw, KEY_A)
    prompt = "Salted conversation context for scope checks. " * 6
    c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "s1"})
    r = c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1,
                                               extra_body={"cache_salt": "s2"})
    assert _qc_headers(r.headers)["x-quillcache-cached-tokens"] == "0"
    assert r.parse().usage.prompt_tokens_details.cached_tokens == 0
    r = c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1,
                                               extra_body={"cache_salt": "s1"})
    assert int(_qc_headers(r.headers)["x-quillcache-cached-tokens"]) > 0


@pytest.fixture(scope="module")
def slow_stack():
    """One stand-in engine with a 500 ms TTFT behind a gateway."""
    with EngineSimProcess(["--fixed-ttft-ms", "500", "--decode-ms-per-token", "5", "--model", MODEL]) as e0:
        with GatewayProcess([e0.url], keys=KEYS) as gw:
            yield gw, e0


def test_decision_headers_arrive_long_before_the_first_token(slow_stack):
    gw, e0 = slow_stack

    async def once(session) -> tuple[float, float]:
        body = {"model": MODEL, "prompt": "timing " * 20, "max_tokens": 2, "stream": True}
        t0 = time.perf_counter()
        async with session.post(gw.url + "/v1/completions", json=body,
                                headers={"authorization": f"Bearer {KEY_A}"}) as resp:
            t_headers = time.perf_counter() - t0
            assert resp.status == 200 and "x-quillcache-worker" in resp.headers
            await resp.content.readuntil(b"\n\n")
            t_first = time.perf_counter() - t0
        return t_headers, t_first

    async def main():
        async with aiohttp.ClientSession() as s:
            await once(s)  # warm the connections
            return [await once(s) for _ in range(3)]

    times = asyncio.run(main())
    for t_headers, t_first in times:
        assert t_first >= 0.45, times
        assert t_headers < 0.25, times  # generous (a loaded 2-core machine); the study measures the real number
    assert min(t for t, _ in times) < 0.1, times
    # the SDK sees the headers before iterating the stream, too
    c = _client(gw)
    t0 = time.perf_counter()
    with c.completions.with_streaming_response.create(model=MODEL, prompt="sdk timing " * 10, max_tokens=2,
                                                      stream=True) as resp:
        t_h = time.perf_counter() - t0
        assert _qc_headers(resp.headers)["x-quillcache-worker"] == "e0"
        list(resp.parse())
    assert t_h < 0.3 and time.perf_counter() - t0 >= 0.45


def test_client_disconnect_cancels_the_upstream_and_releases_the_load(slow_stack):
    gw, e0 = slow_stack

    def cancelled() -> float:
        return parse_metrics(_get(e0.url + "/metrics")).get("quillcache_sim_cancelled_total", 0.0)

    before = cancelled()

    async def main():
        async with aiohttp.ClientSession() as s:
            resp = await s.post(gw.url + "/v1/completions", headers={"authorization": f"Bearer {KEY_A}"},
                                json={"model": MODEL, "prompt": "disconnect " * 20, "max_tokens": 50,
                                      "stream": True})
            assert resp.status == 200
            resp.close()  # gone before the first token

    asyncio.run(main())
    _wait_until(lambda: cancelled() >= before + 1, "the engine to count a cancellation")
    _wait_until(lambda: _gauges(gw)["inflight"] == 0 and _gauges(gw)["tenant"] == 0, "loads back at zero")
    m = parse_metrics(gw.metrics_text())
    assert m["quillcache_gateway_client_disconnects_total"] >= 1


def test_client_leaving_a_non_streaming_request_cancels_the_engines_work(slow_stack):
    """The client gives up while the gateway waits for the engine's whole answer (500 ms TTFT + 400 tokens at
    5 ms: 2.5 s of work): the engine must see the close at once, as it does for a stream."""
    gw, e0 = slow_stack

    def cancelled() -> float:
        return parse_metrics(_get(e0.url + "/metrics")).get("quillcache_sim_cancelled_total", 0.0)

    before = cancelled()
    disconnects = parse_metrics(gw.metrics_text()).get("quillcache_gateway_client_disconnects_total", 0.0)

    async def main():
        async with aiohttp.ClientSession() as s:
            post = asyncio.create_task(s.post(
                gw.url + "/v1/completions", headers={"authorization": f"Bearer {KEY_A}"},
                json={"model": MODEL, "prompt": "abandoned " * 20, "max_tokens": 400, "stream": False}))
            deadline = time.monotonic() + 10
            # the engine itself holds the request (the gateway's own in-flight gauge rises at its routing
            # decision, before the request's bytes are sent: a client leaving then never reaches the engine)
            while await asyncio.to_thread(_engine_requests, e0) < 1:
                assert time.monotonic() < deadline and not post.done(), "the request never reached the engine"
                await asyncio.sleep(0.01)
            post.cancel()  # the client leaves (its connection closes)
            with contextlib.suppress(asyncio.CancelledError):
                await post

    asyncio.run(main())
    # a generation that ran to its end would not count as cancelled: this is the engine seeing the close
    _wait_until(lambda: cancelled() >= before + 1, "the engine to count a cancellation")
    _wait_until(lambda: _gauges(gw)["inflight"] == 0 and _gauges(gw)["tenant"] == 0, "loads back at zero")
    m = parse_metrics(gw.metrics_text())
    assert m["quillcache_gateway_client_disconnects_total"] == disconnects + 1
    assert m.get('quillcache_gateway_requests_total{endpoint="/v1/completions",status="499"}', 0) >= 1


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def _engine_requests(engine) -> float:
    """Requests the stand-in engine holds now (running or waiting for a batch slot), from its /metrics."""
    m = parse_metrics(_get(engine.url + "/metrics"))
    return sum(v for k, v in m.items()
               if k.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")))


def _gauges(gw) -> dict[str, float]:
    m = parse_metrics(gw.metrics_text())
    inflight = sum(v for k, v in m.items() if k.startswith("quillcache_gateway_inflight_requests{"))
    return {"inflight": inflight, "tenant": m["quillcache_gateway_tenant_inflight_requests"]}


def test_health_ready_and_metrics_names(stack):
    gw, engines = stack
    assert json.loads(_get(gw.url + "/health")) == {"status": "ok"}
    assert json.loads(_get(gw.url + "/ready"))["healthy_engines"] == 2
    text = gw.metrics_text()
    for name in ("quillcache_gateway_requests_total", "quillcache_gateway_time_to_first_token_seconds_bucket",
                 "quillcache_gateway_inter_token_latency_seconds_bucket", "quillcache_gateway_cached_tokens_total",
                 "quillcache_gateway_routing_decisions_total", "quillcache_gateway_upstream_errors_total",
                 "quillcache_gateway_upstream_retries_total", "quillcache_gateway_inflight_requests",
                 "quillcache_gateway_engine_healthy"):
        assert name in text, name


@pytest.mark.parametrize("what", ["engine", "gateway"])
def test_a_stand_in_engine_or_gateway_stops_when_the_process_that_started_it_is_sigkilled(what):
    """A killed test or study runs no ``finally``: the kernel stops its engines and gateways
    (``kill_on_parent_death``), so no orphan keeps serving."""
    import signal

    script = (
        "import sys\n"
        "from quillcache.enginesim.process import EngineSimProcess\n"
        "from quillcache.gateway.server import GatewayProcess\n"
        f"e = EngineSimProcess(['--model', {MODEL!r}]).start()\n"
        "pid = e.pid\n"
        f"if {what!r} == 'gateway':\n"
        "    pid = GatewayProcess([e.url]).__enter__().proc.pid\n"
        "print(e.pid, pid, flush=True)\n"
        "sys.stdin.read()\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    pids: list[int] = []
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids), parent.stderr
        parent.kill()
        parent.wait(timeout=30)
        for p in set(pids):
            _wait_until(lambda p=p: not _alive(p), f"pid {p} to exit after its parent's SIGKILL", 30.0)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
