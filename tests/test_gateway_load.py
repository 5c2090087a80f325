"""1,000 concurrent streams through the gateway (two STAND-IN engines, real processes on 127.0.0.1): every stream
completes, the gateway really held them at once, and afterwards every load counter is back at zero and the
gateway's sockets return to their idle count (no leaked upstream or client connections). Bounded: streams last
about half a second each; the whole test takes seconds, not minutes."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import aiohttp
import pytest

from quillcache.enginesim.process import EngineSimProcess, parse_metrics
from quillcache.gateway.server import GatewayProcess

pytestmark = [pytest.mark.timeout(180), pytest.mark.skipif(not sys.platform.startswith("linux"),
                                                           reason="counts sockets through /proc")]

MODEL = "quillcache-sim"
KEY = "sk-load-test-0001"
N_STREAMS = 1000


def _sockets(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                n += 1
        except OSError:
            pass
    return n


def _loads(gw) -> tuple[float, float]:
    m = parse_metrics(gw.metrics_text())
    inflight = sum(v for k, v in m.items() if k.startswith("quillcache_gateway_inflight_requests{"))
    return inflight, m["quillcache_gateway_tenant_inflight_requests"]


def test_a_thousand_concurrent_streams_leave_nothing_behind():
    args = ["--fixed-ttft-ms", "300", "--decode-ms-per-token", "20", "--max-num-seqs", "2048", "--prefill-concurrency", "0",
            "--model", MODEL]
    with EngineSimProcess(args) as e0, EngineSimProcess(args) as e1:
        config = {"timeouts": {"keepalive_s": 0.5}, "limits": {"tenant_max_concurrency": 4096}}
        with GatewayProcess([e0.url, e1.url], keys={KEY: "tenant-load"}, config=config) as gw:
            pid = gw.proc.pid
            idle_sockets = _sockets(pid)
            peak = {"inflight": 0.0}

            async def one(session, i: int) -> tuple[int, bool, str]:
                body = {"model": MODEL, "prompt": f"stream {i % 50} " * 8, "max_tokens": 10, "stream": True}
                async with session.post(gw.url + "/v1/completions", json=body,
                                        headers={"authorization": f"Bearer {KEY}"}) as r:
                    raw = await r.read()
                    return r.status, raw.rstrip().endswith(b"data: [DONE]"), r.headers.get("x-quillcache-worker", "")

            async def watch(stop: asyncio.Event) -> None:
                async with aiohttp.ClientSession() as s:
                    while not stop.is_set():
                        async with s.get(gw.url + "/metrics") as r:
                            m = parse_metrics(await r.text())
                        inflight = sum(v for k, v in m.items()
                                       if k.startswith("quillcache_gateway_inflight_requests{"))
                        peak["inflight"] = max(peak["inflight"], inflight)
                        await asyncio.sleep(0.05)

            async def main():
                stop = asyncio.Event()
                watcher = asyncio.create_task(watch(stop))
                conn = aiohttp.TCPConnector(limit=0)
                async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
                    out = await asyncio.gather(*(one(s, i) for i in range(N_STREAMS)))
                stop.set()
                await watcher
                return out

            t0 = time.monotonic()
            results = asyncio.run(main())
            wall_s = time.monotonic() - t0
            statuses = [r[0] for r in results]
            assert statuses.count(200) == N_STREAMS, {s: statuses.count(s) for s in set(statuses)}
            assert all(r[1] for r in results), "a stream ended without data: [DONE]"
            assert {r[2] for r in results} == {"e0", "e1"}
            assert peak["inflight"] >= 0.5 * N_STREAMS, (peak, wall_s)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if _loads(gw) == (0.0, 0.0) and _sockets(pid) <= idle_sockets + 2:
                    break
                time.sleep(0.1)
            assert _loads(gw) == (0.0, 0.0)
            assert _sockets(pid) <= idle_sockets + 2, (idle_sockets, _sockets(pid))
            m = parse_metrics(gw.metrics_text())
            assert m['quillcache_gateway_requests_total{endpoint="/v1/completions",status="200"}'] == N_STREAMS
