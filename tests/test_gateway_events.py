"""Exact prefix state from vLLM-format KV events: the gateway subscribes to a STAND-IN engine's ZMQ events (real
processes, 127.0.0.1), confirms its speculative entries with BlockStored, drops them on BlockRemoved, and so its
``x-quillcache-cached-tokens`` equals the engine's own ``usage.prompt_tokens_details.cached_tokens`` even while a
tiny GPU cache evicts under a seeded random prompt mix (seed in the assertion messages)."""

from __future__ import annotations

import random
import time

import openai
import pytest

from quillcache.enginesim.process import EngineSimProcess, parse_metrics
from quillcache.gateway.server import GatewayProcess
from quillcache.cluster.etcd import free_port as _free_port

pytestmark = pytest.mark.timeout(120)

MODEL = "quillcache-sim"
KEYS = {"sk-events-a-0001": "tenant-a", "sk-events-b-0001": "tenant-b"}


def _residency(gw) -> dict[str, float]:
    m = parse_metrics(gw.metrics_text())
    out = {}
    for state in ("pending", "confirmed", "approximate"):
        out[state] = sum(v for k, v in m.items()
                         if k.startswith("quillcache_gateway_residency_entries{") and f'state="{state}"' in k)
    return out


def _settle(gw, engine, seed) -> dict[str, float]:
    """Wait until every speculation is confirmed and the gateway holds exactly the engine's blocks."""
    deadline = time.monotonic() + 10
    while True:
        r = _residency(gw)
        cached = parse_metrics(_get(engine.url + "/metrics"))["quillcache_sim_cached_blocks"]
        if r["pending"] == 0 and r["confirmed"] == cached:
            return r
        if time.monotonic() > deadline:
            raise AssertionError(f"seed {seed}: gateway residency {r} never matched the engine's {cached} blocks")
        time.sleep(0.02)


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


@pytest.mark.parametrize("encoding,signedness", [("tagged", "u64"), ("positional", "i64")])
def test_headers_equal_the_engines_cached_tokens_under_eviction(encoding, signedness):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    # 24 GPU blocks, and every conversation is sent at least once: 6 prompts of 7-12 full 16-token blocks, 2 of
    # them the shared system prompt, hold at least 32 distinct blocks, so the engine evicts whatever the seed draws
    # (with 40 blocks and shorter prompts some draws fitted: nothing evicted, nothing tested)
    args = ["--fixed-ttft-ms", "5", "--decode-ms-per-token", "1", "--model", MODEL, "--gpu-blocks", "24",
            "--kv-events", "tcp://127.0.0.1:0", "--kv-events-replay", "tcp://127.0.0.1:0",
            "--kv-events-encoding", encoding, "--hash-signedness", signedness]
    with EngineSimProcess(args) as e0:
        engine = {"url": e0.url, "name": "e0", "kv_events": e0.info["kv_events"],
                  "kv_events_replay": e0.info["kv_events_replay"]}
        with GatewayProcess([engine], keys=KEYS) as gw:
            clients = [openai.OpenAI(base_url=gw.url + "/v1", api_key=k, max_retries=0) for k in KEYS]
            # 6 conversations whose prompts share prefixes (a system prompt, then 3-6 turns of 27 byte tokens)
            system = "System: you are a careful assistant. "  # 37 byte tokens
            prompts = [system + "".join(f"turn {c}.{t} " * 3 for t in range(rng.randint(3, 6))) for c in range(6)]
            picks = rng.sample(prompts, 6) + [rng.choice(prompts) for _ in range(24)]
            hits = 0
            for step, prompt in enumerate(picks):
                c = rng.randrange(2)
                r = clients[c].completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=2)
                header = int(r.headers["x-quillcache-cached-tokens"])
                engine_cached = r.parse().usage.prompt_tokens_details.cached_tokens
                assert header == engine_cached, f"seed {seed} step {step}: header {header} engine {engine_cached}"
                hits += header > 0
                _settle(gw, e0, seed)
            assert hits >= 5, f"seed {seed}: only {hits} cache hits; the mix is too cold to test anything"
            m = parse_metrics(gw.metrics_text())
            assert m.get('quillcache_gateway_kv_events_total{kind="removed",worker="e0"}', 0) > 0, f"seed {seed}: no eviction"
            assert _residency(gw)["approximate"] == 0


def test_reset_prefix_cache_clears_the_gateways_state():
    args = ["--fixed-ttft-ms", "5", "--model", MODEL, "--kv-events", "tcp://127.0.0.1:0"]
    with EngineSimProcess(args) as e0:
        engine = {"url": e0.url, "name": "e0", "kv_events": e0.info["kv_events"]}
        with GatewayProcess([engine], keys=KEYS) as gw:
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-events-a-0001", max_retries=0)
            c.completions.create(model=MODEL, prompt="to be cleared " * 10, max_tokens=1)
            assert _settle(gw, e0, 0)["confirmed"] > 0
            import urllib.request

            urllib.request.urlopen(urllib.request.Request(e0.url + "/reset_prefix_cache", method="POST"), timeout=5)
            deadline = time.monotonic() + 10
            while _residency(gw)["confirmed"] != 0:
                assert time.monotonic() < deadline, "AllBlocksCleared did not clear the gateway's entries"
                time.sleep(0.02)
            r = c.completions.with_raw_response.create(model=MODEL, prompt="to be cleared " * 10, max_tokens=1)
            assert r.headers["x-quillcache-cached-tokens"] == "0" == str(r.parse().usage.prompt_tokens_details.cached_tokens)


def test_a_request_cancelled_before_its_first_token_leaves_no_entry():
    """A client that leaves before the first token: the engine never stores the prompt, and the gateway takes its
    speculative entries back at once (so no later store of the same chain by another scope could confirm them)."""
    import asyncio

    import aiohttp

    args = ["--fixed-ttft-ms", "500", "--model", MODEL, "--kv-events", "tcp://127.0.0.1:0"]
    with EngineSimProcess(args) as e0:
        engine = {"url": e0.url, "name": "e0", "kv_events": e0.info["kv_events"]}
        with GatewayProcess([engine], keys=KEYS, config={"speculative_ttl_s": 60}) as gw:
            async def main():
                async with aiohttp.ClientSession() as s:
                    resp = await s.post(gw.url + "/v1/completions",
                                        headers={"authorization": "Bearer sk-events-a-0001"},
                                        json={"model": MODEL, "prompt": "leave early " * 20, "stream": True})
                    assert resp.status == 200
                    seen = _residency(gw)
                    resp.close()
                    return seen

            during = asyncio.run(main())
            assert during["pending"] > 0  # speculated while in flight
            deadline = time.monotonic() + 10
            while _residency(gw)["pending"] != 0:
                assert time.monotonic() < deadline, "the cancelled request's speculation was not taken back"
                time.sleep(0.02)
            assert _residency(gw)["confirmed"] == 0
            assert parse_metrics(_get(e0.url + "/metrics"))["quillcache_sim_cached_blocks"] == 0




def test_two_replicas_share_prefix_state_through_events_and_peer_speculation():
    """Two gateway replicas, both subscribed to both engines' events and linked as peers: a conversation whose
    turns alternate between the replicas is routed to its cache by either, and each replica's header equals the
    engine's cached tokens; each replica holds the other's confirmed entries without having routed them."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    args = ["--fixed-ttft-ms", "5", "--decode-ms-per-token", "1", "--model", MODEL,
            "--kv-events", "tcp://127.0.0.1:0", "--kv-events-replay", "tcp://127.0.0.1:0"]
    with EngineSimProcess(args) as e0, EngineSimProcess(args) as e1:
        engines = [{"url": e.url, "name": n, "kv_events": e.info["kv_events"],
                    "kv_events_replay": e.info["kv_events_replay"]} for n, e in (("e0", e0), ("e1", e1))]
        p1, p2 = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
        with GatewayProcess(engines, keys=KEYS, config={"peer_bind": p1, "peers": [p2]}) as r1, \
                GatewayProcess(engines, keys=KEYS, config={"peer_bind": p2, "peers": [p1]}) as r2:
            clients = [openai.OpenAI(base_url=r.url + "/v1", api_key="sk-events-a-0001", max_retries=0)
                       for r in (r1, r2)]
            others = [openai.OpenAI(base_url=r.url + "/v1", api_key="sk-events-b-0001", max_retries=0)
                      for r in (r1, r2)]
            # a ZMQ SUB gets nothing sent before it connected: send tenant B's warm-ups through each replica
            # until the other one holds them (polling with a deadline, no fixed sleep)
            for src, dst in ((0, 1), (1, 0)):
                deadline = time.monotonic() + 15
                k = 0
                before = _residency((r1, r2)[dst])["confirmed"]
                while _residency((r1, r2)[dst])["confirmed"] <= before:
                    assert time.monotonic() < deadline, "the replicas' peer link never connected"
                    others[src].completions.create(model=MODEL, prompt=f"warm-up {src} {k} " * 8, max_tokens=1)
                    k += 1
                    time.sleep(0.05)
            convo = "System: be brief. "
            first = rng.randrange(2)
            workers = set()
            for turn in range(6):
                convo += f"User turn {turn}: tell me about block {rng.randrange(1000)}. " * 2
                c = clients[(first + turn) % 2]
                r = c.completions.with_raw_response.create(model=MODEL, prompt=convo, max_tokens=4)
                header = int(r.headers["x-quillcache-cached-tokens"])
                body = r.parse()
                assert header == body.usage.prompt_tokens_details.cached_tokens, f"seed {seed} turn {turn}"
                if turn:
                    assert header > 0, f"seed {seed} turn {turn}: the other replica's history was not used"
                workers.add(r.headers["x-quillcache-worker"])
                convo += body.choices[0].text
                for gw in (r1, r2):  # both replicas settle to the engines' state: every prompt AND decode block
                    deadline = time.monotonic() + 10  # (waiting for no pending speculation alone raced the decode
                    while True:  # blocks' events: the next turn's header was then a block short of the engine's)
                        res = _residency(gw)
                        cached = sum(parse_metrics(_get(e.url + "/metrics"))["quillcache_sim_cached_blocks"]
                                     for e in (e0, e1))
                        if res["pending"] == 0 and res["confirmed"] == cached:
                            break
                        assert time.monotonic() < deadline, f"seed {seed}: residency {res} never matched {cached}"
                        time.sleep(0.02)
            assert len(workers) == 1, f"seed {seed}: the conversation moved between engines {workers}"
            assert min(_residency(r1)["confirmed"], _residency(r2)["confirmed"]) > 0



def test_ready_waits_for_the_kv_event_catch_up():
    """``/ready`` stays 503 (naming the engine) until the start-up replay of an events engine was applied or given
    up: here the replay endpoint accepts TCP connections and never answers, so the catch-up ends only at the
    subscriber's replay timeout; then the gateway is ready and routes. (Before, ``/ready`` answered 200 after the
    first health probe, and requests were routed on a half-replayed history: a replayed ``BlockStored`` of an earlier
    identical prompt confirmed a new speculation, which the replayed reset then dropped.)"""
    import json
    import socket
    import urllib.error
    import urllib.request

    args = ["--fixed-ttft-ms", "1", "--model", MODEL, "--kv-events", "tcp://127.0.0.1:0"]
    mute = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never speaks ZMTP: no replay answer
    try:
        with EngineSimProcess(args) as e0:
            engine = {"url": e0.url, "name": "e0", "kv_events": e0.info["kv_events"],
                      "kv_events_replay": f"tcp://127.0.0.1:{mute.getsockname()[1]}"}
            with GatewayProcess([engine], keys=KEYS, wait_ready=False) as gw:
                seen: list[tuple[int, dict]] = []
                deadline = time.monotonic() + 20
                while not seen or seen[-1][0] != 200:
                    assert time.monotonic() < deadline, f"never ready: {seen[-3:]}"
                    try:
                        with urllib.request.urlopen(gw.url + "/ready", timeout=5) as r:
                            seen.append((r.status, json.loads(r.read())))
                    except urllib.error.HTTPError as e:
                        seen.append((e.code, json.loads(e.read())))
                    time.sleep(0.02)
                waiting = [b for code, b in seen if code == 503]
                assert waiting and all(b.get("catching_up_kv_events") == ["e0"] for b in waiting), seen[:3]
                c = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-events-a-0001", max_retries=0)
                assert c.completions.create(model=MODEL, prompt="after the catch-up", max_tokens=1).usage
    finally:
        mute.close()
