"""Client side of the gateway study: the sessions workload as OpenAI completion bodies, and an aiohttp load
generator that times every streamed request.

Workload. ``quillcache gen-trace sessions`` (:func:`quillcache.traces.sessions.generate`, same config -> same
trace) gives multi-tenant multi-turn requests as chains of block ids (``hash_ids``, 16 tokens a block). Each
block id is rendered to 16 lowercase letters derived from the id (BLAKE2b), the last block cut to the request's
length, so that with the stand-in's byte tokenizer (one token per byte) a request's prompt is exactly
``input_length`` tokens and two requests share their first ``k`` blocks of tokens exactly when the trace says
they share ``hash_ids[:k]``. Requests keep the trace's order (a session's turns stay in order); the trace's
models all map to the engines' one base model, and a tenant with a LoRA adapter sends the adapter's name as
``model``.

Load. :func:`run_open_loop` sends requests at Poisson arrival times (seeded), never waiting for answers;
:func:`run_closed_loop` keeps ``streams`` requests in flight. Every request is streamed
(``stream_options.include_usage``) and timed on the client's monotonic clock: send, response headers, first
token (the first chunk carrying text), end; the usage chunk gives prompt, completion and cached tokens.
Several front URLs (gateway replicas) are used in turn, request ``i`` going to ``urls[i % len(urls)]``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

__all__ = ["StudyRequest", "Timing", "block_text", "percentile", "render_prompt", "render_workload",
           "run_closed_loop", "run_open_loop", "run_sequential"]

BASE_MODEL = "llama-3-8b"  # the engines' served model (the engine model profile of the stand-in too)


@dataclass(frozen=True, slots=True)
class StudyRequest:
    """One request of the workload: who sends it and the completion body's fields."""

    tenant: str
    model: str  # the base model or a LoRA adapter's name
    prompt: str
    max_tokens: int
    session_id: int = 0
    turn: int = 0

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt.encode())


@dataclass(slots=True)
class Timing:
    """One request as the client saw it; times are seconds on the client's monotonic clock."""

    index: int
    tenant: str
    url: str
    t_sched: float = math.nan  # planned send time (open loop)
    t_send: float = math.nan
    t_headers: float = math.nan
    t_first: float = math.nan
    t_end: float = math.nan
    status: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    worker: str = ""  # x-quillcache-worker when the front is the gateway
    header_cached_tokens: int = -1  # x-quillcache-cached-tokens, -1 when absent
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and not math.isnan(self.t_first)

    @property
    def ttft_s(self) -> float:
        return self.t_first - self.t_send

    @property
    def headers_s(self) -> float:
        return self.t_headers - self.t_send

    @property
    def latency_s(self) -> float:
        return self.t_end - self.t_send


def block_text(hash_id: int, n_chars: int = 16) -> str:
    """``n_chars`` lowercase letters determined by ``hash_id`` (at most 32)."""
    digest = hashlib.blake2b(hash_id.to_bytes(8, "little", signed=False), digest_size=32).digest()
    return "".join(chr(97 + b % 26) for b in digest[:n_chars])


def render_prompt(hash_ids: Sequence[int], input_length: int, block_tokens: int) -> str:
    """The prompt text of a trace request: one block of letters per id, the last one cut to the length."""
    if block_tokens > 32:
        raise ValueError(f"block_tokens={block_tokens}: at most 32 letters per block are rendered")
    parts = [block_text(h, block_tokens) for h in hash_ids]
    text = "".join(parts)[:input_length]
    if len(text) != input_length:
        raise ValueError(f"{len(hash_ids)} blocks of {block_tokens} cannot hold {input_length} tokens")
    return text


def render_workload(num_requests: int, *, seed: int = 0, max_output_tokens: int = 32, num_tenants: int = 8,
                    session_rate_per_s: float = 1.0, **sessions_kw) -> tuple[list[StudyRequest], dict]:
    """The first ``num_requests`` requests of a sessions trace as study requests, and a description.

    ``max_output_tokens`` caps each request's ``max_tokens`` at the trace's ``output_length`` (the cap keeps a
    2-core machine's client from being the bottleneck; prompts are never cut)."""
    from quillcache.traces.sessions import SessionsConfig, generate

    cfg = SessionsConfig(num_requests=num_requests, seed=seed, num_tenants=num_tenants,
                         session_rate_per_s=session_rate_per_s, **sessions_kw)
    reqs = generate(cfg)
    out = [StudyRequest(tenant=r.tenant, model=r.adapter or BASE_MODEL,
                        prompt=render_prompt(r.hash_ids, r.input_length, r.block_tokens),
                        max_tokens=max(1, min(r.output_length, max_output_tokens)), session_id=r.session_id,
                        turn=r.turn) for r in reqs]
    distinct = len({h for r in reqs for h in r.hash_ids})
    desc = {"requests": len(out), "sessions": len({r.session_id for r in reqs}),
            "tenants": len({r.tenant for r in reqs}), "adapters": sorted({r.adapter for r in reqs if r.adapter}),
            "mean_prompt_tokens": sum(r.input_length for r in reqs) / max(1, len(reqs)),
            "distinct_blocks": distinct, "block_tokens": cfg.block_tokens,
            "cli": f"quillcache gen-trace sessions --requests {num_requests} --seed {seed} --tenants {num_tenants} "
                   f"--session-rate {session_rate_per_s}"}
    return out, desc


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of the non-NaN values (NumPy's linear interpolation); NaN for none."""
    v = np.asarray(values, dtype=np.float64)
    v = v[~np.isnan(v)]
    return float(np.percentile(v, 100 * q)) if v.size else math.nan


# ----------------------------------------------------------------------------- one request

BodyFn = Callable[[int, StudyRequest], tuple[dict, dict]]  # (index, request) -> (json body, headers)


def make_body_fn(*, api_keys: dict[str, str] | None, salts: dict[str, str] | None) -> BodyFn:
    """Bodies for a front: ``api_keys`` tenant -> key (the gateway's bearer tokens), ``salts`` tenant -> the
    ``cache_salt`` the client sends itself (fronts that do not derive one: the gateway's own salt of the tenant,
    so that every front scopes the engines' caches alike)."""

    def body(i: int, r: StudyRequest) -> tuple[dict, dict]:
        b = {"model": r.model, "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0.0, "stream": True,
             "stream_options": {"include_usage": True}}
        if salts is not None:
            b["cache_salt"] = salts[r.tenant]
        h = {"Authorization": f"Bearer {api_keys[r.tenant]}"} if api_keys is not None else {}
        return b, h

    return body


async def _one(session, url: str, i: int, r: StudyRequest, body_fn: BodyFn, t_sched: float = math.nan) -> Timing:
    import aiohttp

    tm = Timing(index=i, tenant=r.tenant, url=url, t_sched=t_sched)
    body, headers = body_fn(i, r)
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **headers}
    clock = time.perf_counter
    tm.t_send = clock()
    try:
        async with session.post(url + "/v1/completions", data=data, headers=headers) as resp:
            tm.t_headers = clock()
            tm.status = resp.status
            tm.worker = resp.headers.get("x-quillcache-worker", "")
            hc = resp.headers.get("x-quillcache-cached-tokens")
            tm.header_cached_tokens = int(hc) if hc is not None and hc.isdigit() else -1
            if resp.status != 200:
                tm.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                tm.t_end = clock()
                return tm
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                if math.isnan(tm.t_first) or b'"usage":{' in payload or b'"usage": {' in payload \
                        or b'"error"' in payload:
                    now = clock()
                    d = json.loads(payload)
                    if "error" in d:
                        tm.error = f"stream error: {str(d['error'])[:200]}"
                        break
                    ch = d.get("choices") or []
                    if math.isnan(tm.t_first) and ch and ch[0].get("text"):
                        tm.t_first = now
                    u = d.get("usage")
                    if u:
                        tm.prompt_tokens = int(u.get("prompt_tokens") or 0)
                        tm.completion_tokens = int(u.get("completion_tokens") or 0)
                        tm.cached_tokens = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            tm.t_end = clock()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
        tm.error = f"{type(exc).__name__}: {exc}"[:200]
        tm.t_end = clock()
    return tm


def _session(limit: int, timeout_s: float):
    import aiohttp

    conn = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, force_close=False, ttl_dns_cache=None)
    return aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                 auto_decompress=False)


async def run_open_loop(urls: Sequence[str], reqs: Sequence[StudyRequest], rate_per_s: float, body_fn: BodyFn, *,
                        seed: int = 0, timeout_s: float = 120.0, max_connections: int = 4096) -> list[Timing]:
    """Send ``reqs`` in order at Poisson arrivals of ``rate_per_s`` (seeded); return every request's timing."""
    rng = random.Random(seed)
    async with _session(max_connections, timeout_s) as s:
        t0 = time.perf_counter() + 0.05
        t = t0
        tasks = []
        for i, r in enumerate(reqs):
            t += rng.expovariate(rate_per_s)
            delay = t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(s, urls[i % len(urls)], i, r, body_fn, t)))
        return list(await asyncio.gather(*tasks))


async def run_closed_loop(urls: Sequence[str], reqs: Sequence[StudyRequest], streams: int, duration_s: float,
                          body_fn: BodyFn, *, timeout_s: float = 120.0) -> list[Timing]:
    """``streams`` workers, each sending its next request as soon as its last one ended, until ``duration_s``
    passed (the requests in flight then are finished and kept) or the requests ran out (cycled: request ``i``
    is ``reqs[i % len(reqs)]``)."""
    out: list[Timing] = []
    counter = iter(range(1 << 62))
    async with _session(streams + 16, timeout_s) as s:
        stop = time.perf_counter() + duration_s

        async def worker() -> None:
            while time.perf_counter() < stop:
                i = next(counter)
                out.append(await _one(s, urls[i % len(urls)], i, reqs[i % len(reqs)], body_fn))

        await asyncio.gather(*(worker() for _ in range(streams)))
    return out


async def run_sequential(plan: Sequence[tuple[str, BodyFn]], reqs: Sequence[StudyRequest], *,
                         timeout_s: float = 60.0) -> list[list[Timing]]:
    """One request at a time, interleaving the fronts of ``plan`` (front ``k`` of request ``i`` in the order
    rotated by ``i``), so that each front sees the same requests under the same conditions; returns one list of
    timings per front."""
    res: list[list[Timing]] = [[] for _ in plan]
    async with _session(8, timeout_s) as s:
        for i, r in enumerate(reqs):
            for j in range(len(plan)):
                k = (i + j) % len(plan)
                url, body_fn = plan[k]
                res[k].append(await _one(s, url, i, r, body_fn))
    return res


@dataclass
class EngineCounters:
    """Prefix-cache counters summed over engines (``vllm:prefix_cache_{hits,queries}_total``, tokens)."""

    hits: float = 0.0
    queries: float = 0.0
    per_engine: dict[str, tuple[float, float]] = field(default_factory=dict)

    def minus(self, before: EngineCounters) -> EngineCounters:
        per = {k: (h - before.per_engine.get(k, (0.0, 0.0))[0], q - before.per_engine.get(k, (0.0, 0.0))[1])
               for k, (h, q) in self.per_engine.items()}
        return EngineCounters(self.hits - before.hits, self.queries - before.queries, per)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else math.nan


def metric_sum(text: str, name: str) -> float:
    """Sum of every sample of ``name`` (any labels) in a Prometheus text exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in "{ "):
            total += float(line.rpartition(" ")[2])
    return total


def scrape_counters(engine_urls: Sequence[str]) -> EngineCounters:
    import urllib.request

    c = EngineCounters()
    for u in engine_urls:
        with urllib.request.urlopen(u + "/metrics", timeout=10) as r:
            text = r.read().decode()
        h, q = metric_sum(text, "vllm:prefix_cache_hits_total"), metric_sum(text, "vllm:prefix_cache_queries_total")
        c.hits += h
        c.queries += q
        c.per_engine[u] = (h, q)
    return c
