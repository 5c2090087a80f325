"""Gateway study: the QuillCache gateway against sglang-router (and vllm-router), round-robin and no router,
in front of four STAND-IN engines (``quillcache engine-sim``: engine-model timing, a real block cache, vLLM KV
events), all in the same run.

Parts (every request streamed by one aiohttp client process; :mod:`experiments.gateway_load`):

1. Overhead (one stand-in engine with a FIXED TTFT, so its cache plays no part):
   (a) gateway-added TTFT at light load: one request at a time, the fronts interleaved request by request
       (direct, gateway, sglang-router when installed); added = median TTFT through the front minus median TTFT
       direct, per repetition; acceptance: gateway p50 added <= 2 ms;
   (b) headers vs first token at a 500 ms stand-in TTFT: when the response headers (the gateway's
       ``x-quillcache-*`` decision headers) reach the client vs the first token; acceptance: <= 10 ms;
   (c) throughput at 100 concurrent streams (closed loop), through the gateway vs direct to the same engine,
       alternating per repetition; acceptance: >= 0.9x direct.
2. Routing (four stand-in engines, engine-model TTFT that grows with uncached tokens, prefills one at a time per
   engine, a small GPU cache so the working set does not fit one engine): the same sessions requests at several
   Poisson request rates through each front; client throughput, TTFT p50/p99, and the engines' prefix-cache hit
   rate from their ``vllm:prefix_cache_hits_total / queries_total`` (scraped before and after each cell; fresh
   engines for each front in the full profile, caches reset between cells with ``POST /reset_prefix_cache``).
   Fronts: the gateway (its default ``cache_aware`` router over its index fed by the engines' KV events), two
   gateway replicas sharing that view (both subscribe; requests alternate between them), the gateway with the
   planner's Dynamo cost router (``dynamo``), the gateway with the ``prefix_affinity``
   router (the same exact index, a cache-greedy policy without load terms), the gateway with its round-robin
   router (the round-robin arm: same proxy, no cache awareness), sglang-router ``cache_aware`` (one and two
   replicas), vllm-router ``cache_aware``, and direct to one engine. Every front but the gateway gets the
   tenant's ``cache_salt`` from the client (the gateway's own salt for that tenant), so the engines' caches are
   tenant-scoped alike behind every front.

The tokenizer is the stand-in's byte tokenizer (one token per character): a character-matching router (sglang's
radix tree) sees exactly the engine's token blocks here, so the comparison is kinder to it than real tokenizers.
Everything runs on one machine: the client, the fronts and the engines share its cores, and the numbers are
this machine's (the acceptance checks are computed, not asserted).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from experiments.gateway_fronts import Front, cpu_seconds, missing, start_front
from experiments.gateway_load import (BASE_MODEL, Timing, make_body_fn, percentile, render_workload, run_closed_loop,
                                      run_open_loop, run_sequential, scrape_counters)
from quillcache.results import Anchor, SummaryRow, spread, write_raw, write_summary

NAME = "gateway"
ENGINES = 4
BLOCK = 16

FULL = dict(overhead_reps=5, overhead_n=40, header_n=10, stream_reps=3, streams=100, stream_s=4.0,
            rates=(8.0, 16.0, 32.0), cell_requests=160, routing_reps=1, paired_reps=5, gpu_blocks=2048,
            workload_requests=400, max_output_tokens=32, engines_per_front=True)
QUICK = dict(overhead_reps=2, overhead_n=6, header_n=3, stream_reps=1, streams=100, stream_s=1.5,
             rates=(20.0,), cell_requests=40, routing_reps=1, paired_reps=1, gpu_blocks=2048,
             workload_requests=200, max_output_tokens=16, engines_per_front=False)

# the stand-in engine of the overhead part: a fixed, short TTFT (the added milliseconds show) and a GPU-like
# inter-token time at a batch of ~100 (~30 ms), so that at 100 streams the engine, not this machine's two cores,
# sets the pace a front must keep up with; no prefill queue.
OVERHEAD_TTFT_MS = 20.0
OVERHEAD_DECODE_MS = 30.0
OVERHEAD_TOKENS = 16  # per request at 100 streams
TTFT_TOKENS = 2  # per request where only the first token is timed (light load, headers)
HEADER_TTFT_MS = 500.0

GATEWAY = Front(kind="gateway", policy="cache_aware")  # the gateway's default router
GATEWAY_X2 = Front(kind="gateway", policy="cache_aware", replicas=2)
# the overhead part's A/B of the gateway's upstream clients: the default (native: asyncio + httptools) vs aiohttp
GATEWAY_AIOHTTP = Front(kind="gateway", policy="cache_aware", upstream="aiohttp",
                        label="quillcache gateway (aiohttp upstream)")
GATEWAY_DYN = Front(kind="gateway", policy="dynamo")  # the planner's Dynamo cost behind the same gateway
GATEWAY_RR = Front(kind="gateway", policy="round_robin", label="round-robin (quillcache gateway)")
GATEWAY_PA = Front(kind="gateway", policy="prefix_affinity")  # the exact index with a cache-greedy policy
SGLANG = Front(kind="sglang-router", policy="cache_aware")
SGLANG_X2 = Front(kind="sglang-router", policy="cache_aware", replicas=2)
VLLM = Front(kind="vllm-router", policy="cache_aware")
DIRECT = Front(kind="direct")
ROUTING_FRONTS = (GATEWAY, GATEWAY_X2, GATEWAY_DYN, GATEWAY_PA, GATEWAY_RR, SGLANG, SGLANG_X2, VLLM, DIRECT)
# the fronts of the acceptance comparisons: every one runs the same arrival seeds (0 .. paired_reps - 1), so their
# hit rates are compared seed by seed (paired differences); the other fronts run routing_reps seeds
PAIRED_FRONTS = (GATEWAY, GATEWAY_X2, SGLANG)
QUICK_FRONTS = (GATEWAY, GATEWAY_X2, SGLANG, DIRECT)
# the full profile's time (about 15 min with 5 paired seeds): arms outside the acceptance comparisons skip the
# lightest rates (direct runs the top rate only; the other gateway policies and round-robin 16 and 32 req/s); a
# front not named runs every rate
FULL["front_rates"] = {DIRECT.name: (32.0,), **{f.name: (16.0, 32.0) for f in (GATEWAY_DYN, GATEWAY_PA, GATEWAY_RR,
                                                                               SGLANG_X2, VLLM)}}

REF11 = "REFERENCE §11 (issue 16's acceptance; smg#2394 for replicas)"


@dataclass(frozen=True)
class Tenancy:
    keys: dict[str, str]  # API key -> tenant
    key_of: dict[str, str]  # tenant -> API key
    salts: dict[str, str]  # tenant -> the gateway's cache_salt of that tenant

    @classmethod
    def of(cls, tenants: Sequence[str]) -> Tenancy:
        from quillcache.gateway.tenants import salt_for

        key_of = {t: f"sk-study-{t}" for t in tenants}
        return cls({k: t for t, k in key_of.items()}, key_of, {t: salt_for(t) for t in tenants})

    def body_fn(self, front: Front):
        if front.sends_own_salt:
            return make_body_fn(api_keys=None, salts=self.salts)
        return make_body_fn(api_keys=self.key_of, salts=None)


# ----------------------------------------------------------------------------- engines


@contextlib.contextmanager
def _engines(n: int, args: Sequence[str]):
    """``n`` stand-in engines with KV events and their replay socket on; yields their ``{"url", "name",
    "kv_events", "kv_events_replay"}`` descriptions. A gateway started later replays each engine's history from
    seq 0 (so a cache reset before it started is part of what it knows)."""
    from quillcache.enginesim.process import EngineSimProcess

    with contextlib.ExitStack() as stack:
        events = ["--kv-events", "tcp://127.0.0.1:0", "--kv-events-replay", "tcp://127.0.0.1:0"]
        procs = [EngineSimProcess([*args, *events], start_timeout_s=60.0) for _ in range(n)]
        for p in procs:
            stack.callback(p.stop)
        with ThreadPoolExecutor(len(procs)) as pool:  # the interpreters start in parallel
            list(pool.map(lambda p: p.start(), procs))
        yield [{"url": p.url, "name": f"e{i}", "kv_events": p.info.get("kv_events"),
                "kv_events_replay": p.info.get("kv_events_replay"), "pid": p.pid} for i, p in enumerate(procs)]


def _engine_args(adapters: Sequence[str], *extra: str) -> list[str]:
    args = ["--model", BASE_MODEL, "--block-size", str(BLOCK), "--max-model-len", "65536"]
    for a in adapters:
        args += ["--lora", a]
    return args + list(extra)


def _reset(engines: Sequence[dict]) -> None:
    import urllib.request

    for e in engines:
        req = urllib.request.Request(e["url"] + "/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()


# ----------------------------------------------------------------------------- part 1: overhead


def _ok(ts: Sequence[Timing]) -> list[Timing]:
    return [t for t in ts if t.ok]


def _warm(plan, reqs) -> None:
    """One untimed request per (tenant, model) through every front: a front's first request of an identity
    (tokenizer, kernels, identity registration) is a start-up cost, not the per-request overhead measured here."""
    first = {}
    for r in reqs:
        first.setdefault((r.tenant, r.model), r)
    asyncio.run(run_sequential(plan, list(first.values())))


def _overhead(cfg: dict, reqs, tenancy: Tenancy, fronts: Sequence[Front], raw: list) -> list[SummaryRow]:
    rows: list[SummaryRow] = []
    adapters = sorted({r.model for r in reqs if r.model != BASE_MODEL})
    light = _engine_args(adapters, "--fixed-ttft-ms", str(OVERHEAD_TTFT_MS), "--decode-ms-per-token",
                         str(OVERHEAD_DECODE_MS), "--prefill-concurrency", "0")
    short = [dataclasses.replace(r, max_tokens=OVERHEAD_TOKENS) for r in reqs]
    tiny = [dataclasses.replace(r, max_tokens=TTFT_TOKENS) for r in reqs]
    names = [DIRECT.name] + [f.name for f in fronts]
    with _engines(1, light) as engines, contextlib.ExitStack() as stack:
        running = [stack.enter_context(start_front(f, engines, keys=tenancy.keys, model=BASE_MODEL)) for f in fronts]
        plan = [(engines[0]["url"], tenancy.body_fn(DIRECT))] + [(rf.urls[0], tenancy.body_fn(rf.front))
                                                                 for rf in running]
        _warm(plan, tiny)
        # (a) light load: one request at a time, interleaved
        added: dict[str, list[float]] = {n: [] for n in names[1:]}
        ttft: dict[str, list[float]] = {n: [] for n in names}
        hdr: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(cfg["overhead_reps"]):
            sample = tiny[rep * cfg["overhead_n"]:(rep + 1) * cfg["overhead_n"]] or tiny[:cfg["overhead_n"]]
            res = asyncio.run(run_sequential(plan, sample))
            med = {}
            for n, ts in zip(names, res):
                good = _ok(ts)
                med[n] = percentile([t.ttft_s for t in good], 0.5)
                ttft[n].append(med[n])
                hdr[n].append(percentile([t.headers_s for t in good], 0.5))
                raw.extend(("light", n, rep, t.index, t.ttft_s, t.headers_s, t.latency_s, t.status, t.error)
                           for t in ts)
            for n in names[1:]:
                added[n].append(med[n] - med[DIRECT.name])
        for n in names:
            p = {"part": "overhead_light", "engines": 1, "stand_in_ttft_ms": OVERHEAD_TTFT_MS,
                 "stand_in_decode_ms": OVERHEAD_DECODE_MS, "max_tokens": TTFT_TOKENS}
            note = (f"one request at a time, fronts interleaved; median of {cfg['overhead_reps']} repetitions of "
                    f"{cfg['overhead_n']} requests each; stand-in fixed TTFT {OVERHEAD_TTFT_MS:g} ms")
            rows.append(SummaryRow.from_spread(spread([x * 1e3 for x in ttft[n]]), metric="ttft_p50_ms", subject=n,
                                               unit="ms", n=cfg["overhead_reps"], params=p, notes=note))
            rows.append(SummaryRow.from_spread(spread([x * 1e3 for x in hdr[n]]), metric="headers_p50_ms",
                                               subject=n, unit="ms", n=cfg["overhead_reps"], params=p, notes=note))
            if n in added:
                s = spread([x * 1e3 for x in added[n]])
                rows.append(SummaryRow.from_spread(s, metric="added_ttft_p50_ms", subject=n, unit="ms",
                                                   baseline=DIRECT.name, n=cfg["overhead_reps"], params=p,
                                                   notes=note + "; TTFT p50 through the front minus direct"))
        # (c) 100 concurrent streams, closed loop, alternating order per repetition
        tput: dict[str, list[float]] = {n: [] for n in names}
        toks: dict[str, list[float]] = {n: [] for n in names}
        cpu_front: dict[str, list[float]] = {n: [] for n in names}
        cpu_engine: dict[str, list[float]] = {n: [] for n in names}
        errs: dict[str, int] = {n: 0 for n in names}
        procs = [None, *running]
        for rep in range(cfg["stream_reps"]):
            order = list(range(len(plan))) if rep % 2 == 0 else list(reversed(range(len(plan))))
            for k in order:
                url, body_fn = plan[k]
                c0 = procs[k].cpu_s() if procs[k] else 0.0
                e0 = cpu_seconds(engines[0]["pid"])
                ts = asyncio.run(run_closed_loop([url], short, cfg["streams"], cfg["stream_s"], body_fn))
                good = _ok(ts)
                errs[names[k]] += len(ts) - len(good)
                window = max(t.t_end for t in ts) - min(t.t_send for t in ts)
                tput[names[k]].append(len(good) / window)
                toks[names[k]].append(sum(t.completion_tokens for t in good) / window)
                cpu_front[names[k]].append(((procs[k].cpu_s() if procs[k] else 0.0) - c0) * 1e3 / max(1, len(good)))
                cpu_engine[names[k]].append((cpu_seconds(engines[0]["pid"]) - e0) * 1e3 / max(1, len(good)))
        for n in names:
            p = {"part": "overhead_streams", "engines": 1, "stand_in_ttft_ms": OVERHEAD_TTFT_MS,
                 "stand_in_decode_ms": OVERHEAD_DECODE_MS, "max_tokens": OVERHEAD_TOKENS, "streams": cfg["streams"]}
            ideal = cfg["streams"] / ((OVERHEAD_TTFT_MS + (OVERHEAD_TOKENS - 1) * OVERHEAD_DECODE_MS) / 1e3)
            note = (f"closed loop, {cfg['streams']} concurrent streams for {cfg['stream_s']:g} s per repetition "
                    f"(requests in flight at the end finished and counted); the stand-in alone would allow "
                    f"{ideal:.0f} req/s; {errs[n]} failed requests")
            base = spread(tput[DIRECT.name])["median"]
            rows.append(SummaryRow.from_spread(spread(tput[n]), metric="throughput_rps", subject=n, unit="req/s",
                                               baseline="" if n == DIRECT.name else DIRECT.name,
                                               baseline_value=math.nan if n == DIRECT.name else base,
                                               n=cfg["stream_reps"], params=p, notes=note))
            rows.append(SummaryRow.from_spread(spread(toks[n]), metric="throughput_tokens_per_s", subject=n,
                                               unit="tokens/s", n=cfg["stream_reps"], params=p, notes=note))
            if n != DIRECT.name:
                rows.append(SummaryRow.from_spread(spread(cpu_front[n]), metric="front_cpu_ms_per_request", subject=n,
                                                   unit="ms", n=cfg["stream_reps"], params=p,
                                                   notes=note + "; user+system CPU of the front's process per request"))
            rows.append(SummaryRow.from_spread(spread(cpu_engine[n]), metric="engine_cpu_ms_per_request", subject=n,
                                               unit="ms", n=cfg["stream_reps"], params=p,
                                               notes=note + "; user+system CPU of the stand-in engine per request"))
    # (b) decision headers vs first token at a 500 ms stand-in TTFT (the upstream A/B arm is left out here)
    fronts = [f for f in fronts if not f.upstream]
    names = [DIRECT.name] + [f.name for f in fronts]
    slow = _engine_args(adapters, "--fixed-ttft-ms", str(HEADER_TTFT_MS), "--prefill-concurrency", "0")
    with _engines(1, slow) as engines, contextlib.ExitStack() as stack:
        running = [stack.enter_context(start_front(f, engines, keys=tenancy.keys, model=BASE_MODEL)) for f in fronts]
        plan = [(engines[0]["url"], tenancy.body_fn(DIRECT))] + [(rf.urls[0], tenancy.body_fn(rf.front))
                                                                 for rf in running]
        _warm(plan, tiny)
        res = asyncio.run(run_sequential(plan, tiny[:cfg["header_n"]]))
        for n, ts in zip(names, res):
            good = _ok(ts)
            raw.extend(("slow", n, 0, t.index, t.ttft_s, t.headers_s, t.latency_s, t.status, t.error) for t in ts)
            p = {"part": "headers_slow", "engines": 1, "stand_in_ttft_ms": HEADER_TTFT_MS,
                 "max_tokens": TTFT_TOKENS}
            note = f"{len(good)} sequential requests; stand-in fixed TTFT {HEADER_TTFT_MS:g} ms"
            h = spread([t.headers_s * 1e3 for t in good])
            f = spread([t.ttft_s * 1e3 for t in good])
            rows.append(SummaryRow.from_spread(h, metric="headers_ms", subject=n, unit="ms", n=len(good), params=p,
                                               notes=note + "; request sent -> response headers"))
            rows.append(SummaryRow.from_spread(f, metric="ttft_ms", subject=n, unit="ms", n=len(good), params=p,
                                               notes=note + "; request sent -> first token"))
    return rows


# ----------------------------------------------------------------------------- part 2: routing


def _routing_cell(front: Front, engines, reqs, rate: float, tenancy: Tenancy, seed: int) -> tuple[list[Timing], dict]:
    _reset(engines)
    with start_front(front, engines, keys=tenancy.keys, model=BASE_MODEL) as rf:
        urls = [e["url"] for e in engines]
        before = scrape_counters(urls)
        # after the start-up catch-up (the front is ready only then): the engines' earlier cells replayed to a
        # new gateway are stores no speculation of this cell explains; only this cell's outcomes count
        start_outcomes = _residency_outcomes(rf.urls) if front.kind == "gateway" else {}
        t0 = time.perf_counter()
        ts = asyncio.run(run_open_loop(rf.urls, reqs, rate, tenancy.body_fn(front), seed=seed))
        wall = time.perf_counter() - t0
        after = scrape_counters(urls)
        outcomes = _residency_outcomes(rf.urls) if front.kind == "gateway" else {}
        outcomes = {k: v - start_outcomes.get(k, 0.0) for k, v in outcomes.items()}
    d = after.minus(before)
    good = _ok(ts)
    window = max(t.t_end for t in ts) - min(t.t_send for t in ts)
    per_engine = [q for _, q in d.per_engine.values()]
    return ts, {"hit_rate": d.hit_rate, "hits": d.hits, "queries": d.queries, "ok": len(good),
                "failed": len(ts) - len(good),
                "rps": len(good) / window, "tokens_per_s": sum(t.completion_tokens for t in good) / window,
                "ttft_p50_s": percentile([t.ttft_s for t in good], 0.5),
                "ttft_p99_s": percentile([t.ttft_s for t in good], 0.99),
                "client_cached_frac": sum(t.cached_tokens for t in good) / max(1, sum(t.prompt_tokens for t in good)),
                "engine_share_max": max(per_engine) / max(1.0, sum(per_engine)), "wall_s": wall,
                "send_lag_p99_s": percentile([t.t_send - t.t_sched for t in ts], 0.99),
                "version": rf.versions, **_attribution_shares(outcomes)}


def _residency_outcomes(gateway_urls) -> dict[str, float]:
    """The gateways' ``quillcache_gateway_residency_outcomes_total`` by outcome, summed over replicas (each
    replica applies every engine's events itself), since the front started."""
    import urllib.request

    out: dict[str, float] = {}
    pre = 'quillcache_gateway_residency_outcomes_total{outcome="'
    for u in gateway_urls:
        with urllib.request.urlopen(u + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(pre):
                    key, _, value = line[len(pre):].partition('"} ')
                    out[key] = out.get(key, 0.0) + float(value)
    return out


def _attribution_shares(outcomes: dict[str, float]) -> dict[str, float]:
    """Of the blocks the engines stored: the share the gateway refused as ambiguous roots when they were stored
    (several scopes could have caused them), the share it could not attribute when stored (the ambiguous roots,
    their descendants, and stores no speculation explained), the share of those it credited later through a
    descendant's scope (``quillcache.gateway.residency``, rule 3), and what was never attributed."""
    stored = outcomes.get("confirmed", 0.0) + outcomes.get("unattributed", 0.0)
    if not stored:
        return {}
    unattributed, resolved = outcomes.get("unattributed", 0.0), outcomes.get("resolved", 0.0)
    return {"ambiguous_share": outcomes.get("ambiguous", 0.0) / stored,
            "unattributed_share": unattributed / stored, "resolved_share": resolved / stored,
            "never_attributed_share": (unattributed - resolved) / stored}


def _routing_front(front: Front, engines, cfg: dict, cell, tenancy: Tenancy, raw: list,
                   per_seed: dict) -> list[SummaryRow]:
    """Every request rate of ``cfg`` through ``front`` (repetitions: ``routing_reps``, or ``paired_reps`` for
    :data:`PAIRED_FRONTS`; repetition ``k`` draws its Poisson arrivals with seed ``k`` behind every front).
    ``per_seed[(front name, rate)]`` receives the hit rate of each seed, in seed order."""
    rows: list[SummaryRow] = []
    for rate in cfg.get("front_rates", {}).get(front.name, cfg["rates"]):
        n_reps = cfg["routing_reps"]
        if front in PAIRED_FRONTS:
            n_reps = max(n_reps, cfg["paired_reps"])
        got = []
        for rep in range(n_reps):
            ts, m = _routing_cell(front, engines, cell, rate, tenancy, seed=rep)
            got.append(m)
            per_seed.setdefault((front.name, rate), []).append(m["hit_rate"])
            raw.extend((front.name, rate, rep, t.index, t.tenant, t.worker, t.t_send - ts[0].t_send, t.headers_s,
                        t.ttft_s, t.latency_s, t.prompt_tokens, t.cached_tokens, t.completion_tokens, t.status,
                        t.error) for t in ts)
            print(f"  {front.name:<40} rate {rate:5.1f}/s rep {rep}: hit {m['hit_rate']:.3f}  "
                  f"TTFT p50 {m['ttft_p50_s'] * 1e3:7.1f} ms p99 {m['ttft_p99_s'] * 1e3:7.1f} ms  "
                  f"{m['rps']:.1f} req/s  failed {m['failed']}  ({m['wall_s']:.1f} s)", flush=True)
        p = {"part": "routing", "engines": 1 if front.kind == "direct" else ENGINES, "rate_per_s": rate,
             "requests": len(cell), "gpu_blocks": cfg["gpu_blocks"], "replicas": front.replicas,
             "front_kind": front.kind, "policy": front.policy or "none"}
        failed = sum(m["failed"] for m in got)
        note = (f"{len(cell)} sessions requests at Poisson {rate:g} req/s, {n_reps} repetition(s), {failed} failed; "
                f"{got[0]['version']}")
        for metric, key, unit, scale in (("hit_rate", "hit_rate", "fraction", 1.0),
                                         ("throughput_rps", "rps", "req/s", 1.0),
                                         ("throughput_tokens_per_s", "tokens_per_s", "tokens/s", 1.0),
                                         ("ttft_p50_ms", "ttft_p50_s", "ms", 1e3),
                                         ("ttft_p99_ms", "ttft_p99_s", "ms", 1e3),
                                         ("max_engine_share", "engine_share_max", "fraction", 1.0),
                                         ("client_send_lag_p99_ms", "send_lag_p99_s", "ms", 1e3)):
            rows.append(SummaryRow.from_spread(spread([m[key] * scale for m in got]), metric=metric,
                                               subject=front.name, unit=unit, n=n_reps, params=p, notes=note))
        for metric, key in (("stored_blocks_refused_ambiguous", "ambiguous_share"),
                            ("stored_blocks_unattributed", "unattributed_share"),
                            ("stored_blocks_resolved", "resolved_share"),
                            ("stored_blocks_never_attributed", "never_attributed_share")):
            if all(key in m for m in got):
                rows.append(SummaryRow.from_spread(
                    spread([m[key] for m in got]), metric=metric, subject=front.name, unit="fraction", n=n_reps,
                    params=p, notes=note + "; of the blocks the engines stored, from the gateway's "
                    "quillcache_gateway_residency_outcomes_total (ambiguous: root stores refused because several "
                    "scopes could have caused them; unattributed: those, their descendants and unexplained stores, "
                    "when stored; resolved: unattributed blocks credited later through a descendant's scope; never "
                    "attributed: unattributed minus resolved)"))
    return rows


def _routing(cfg: dict, reqs, tenancy: Tenancy, fronts: Sequence[Front], raw: list,
             per_seed: dict) -> list[SummaryRow]:
    """Part 2 (module doc). The full profile starts fresh engines for each front, so the history a gateway replays
    from the engines' replay sockets at its start stays short; the quick profile (one short cell per front) keeps
    one set."""
    rows: list[SummaryRow] = []
    adapters = sorted({r.model for r in reqs if r.model != BASE_MODEL})
    args = _engine_args(adapters, "--gpu-blocks", str(cfg["gpu_blocks"]), "--prefill-concurrency", "1")
    cell = list(reqs[:cfg["cell_requests"]])
    if cfg["engines_per_front"]:
        for front in fronts:
            with _engines(ENGINES, args) as engines:
                rows += _routing_front(front, engines, cfg, cell, tenancy, raw, per_seed)
    else:
        with _engines(ENGINES, args) as engines:
            for front in fronts:
                rows += _routing_front(front, engines, cfg, cell, tenancy, raw, per_seed)
    return rows


def hit_rate_ceiling(cell, block: int = BLOCK) -> float:
    """The hit rate of one unbounded cache per (tenant, model) that finished every request before the next one
    arrived: per request, its longest prefix of full blocks some earlier request of that scope held, at most
    ``(prompt - 1) // block`` blocks (an engine recomputes at least the last token), over all prompt tokens. No
    router in front of engines can exceed it on ``cell``; what a router loses below it is splits and timing."""
    seen: set = set()
    hit = total = 0
    for r in cell:
        p, n = r.prompt, len(r.prompt)
        k = 0
        while k < (n - 1) // block and (r.tenant, r.model, p[:(k + 1) * block]) in seen:
            k += 1
        hit += k * block
        total += n
        seen.update((r.tenant, r.model, p[:j * block]) for j in range(1, n // block + 1))
    return hit / total if total else math.nan


def _paired(per_seed: dict, rates: Sequence[float]) -> list[SummaryRow]:
    """Per rate, the hit rate of each front minus a baseline's on the SAME arrival seeds (points): the gateway
    fronts against sglang-router cache_aware, and two gateway replicas against one. Median over the seeds both ran,
    p10-p90 across them."""
    rows = []
    pairs = [(f, SGLANG) for f in (GATEWAY, GATEWAY_X2, GATEWAY_DYN, GATEWAY_PA)] + [(GATEWAY_X2, GATEWAY)]
    for rate in rates:
        for front, base in pairs:
            mine, theirs = per_seed.get((front.name, rate)), per_seed.get((base.name, rate))
            if not mine or not theirs:
                continue
            diffs = [100.0 * (a - b) for a, b in zip(mine, theirs)]  # seed k against seed k
            rows.append(SummaryRow.from_spread(
                spread(diffs), metric="hit_rate_paired_diff_points", subject=front.name, unit="points",
                baseline=base.name, n=len(diffs),
                params={"part": "routing_paired", "rate_per_s": rate, "seeds": len(diffs)},
                notes=f"hit rate of {front.name} minus {base.name}, seed by seed (arrival seeds 0..{len(diffs) - 1}); "
                      f"per seed: {', '.join(f'{d:+.2f}' for d in diffs)}"))
    return rows


def _acceptance(rows: list[SummaryRow]) -> list[SummaryRow]:
    """The issue's acceptance figures, computed from the measured rows (not asserted)."""
    def get(metric, subject, **params):
        for r in rows:
            if r.metric == metric and r.subject == subject and all(r.params.get(k) == v for k, v in params.items()):
                return r
        return None

    out = []
    gw = GATEWAY.name
    a = get("added_ttft_p50_ms", gw)
    if a is not None:
        out.append(SummaryRow(metric="accept_added_ttft_p50_ms", subject=gw, value=a.value, unit="ms",
                              params={"limit": 2.0, "holds": bool(a.value <= 2.0)},
                              notes="gateway-added TTFT p50 at light load; acceptance <= 2 ms"))
    t = get("throughput_rps", gw, part="overhead_streams")
    if t is not None:
        out.append(SummaryRow(metric="accept_streams_throughput_ratio", subject=gw, value=t.ratio, unit="x",
                              params={"limit": 0.9, "holds": bool(t.ratio >= 0.9)},
                              notes="throughput at 100 concurrent streams / direct; acceptance >= 0.9"))
    h = get("headers_ms", gw)
    if h is not None:
        out.append(SummaryRow(metric="accept_headers_ms", subject=gw, value=h.value, unit="ms",
                              params={"limit": 10.0, "holds": bool(h.value <= 10.0)},
                              notes=f"decision headers after the request at a {HEADER_TTFT_MS:g} ms stand-in TTFT "
                                    f"(median); acceptance <= 10 ms"))
    rates = sorted({r.params["rate_per_s"] for r in rows if r.params.get("part") == "routing"})
    for rate in rates:
        for front in (GATEWAY, GATEWAY_DYN, GATEWAY_PA):  # the default router, Dynamo's cost, the greedy policy
            p = get("hit_rate_paired_diff_points", front.name, rate_per_s=rate)
            if p is not None and p.baseline == SGLANG.name:
                out.append(SummaryRow(metric="accept_hit_rate_vs_sglang_points", subject=front.name, value=p.value,
                                      unit="points", baseline=SGLANG.name, n=p.n, p10=p.p10, p90=p.p90,
                                      params={"rate_per_s": rate, "seeds": p.n, "holds": bool(p.value >= 0)},
                                      notes=f"engine prefix-cache hit rate, ours minus sglang-router cache_aware on "
                                            f"the same arrival seeds: median of {p.n} paired per-seed differences; "
                                            f"acceptance >= 0"))
        x2 = [r for r in rows if r.metric == "hit_rate_paired_diff_points" and r.subject == GATEWAY_X2.name
              and r.baseline == gw and r.params.get("rate_per_s") == rate]
        if x2:
            d = x2[0]
            out.append(SummaryRow(metric="accept_two_replicas_points", subject=GATEWAY_X2.name, value=d.value,
                                  unit="points", baseline=gw, n=d.n, p10=d.p10, p90=d.p90,
                                  params={"rate_per_s": rate, "seeds": d.n, "holds": bool(abs(d.value) <= 2.0)},
                                  notes="hit rate with two replicas minus one replica, median of paired per-seed "
                                        "differences; acceptance within 2 points"))
    return out


def anchors() -> list[Anchor]:
    return [Anchor(metric="hit_rate", subject="sglang model gateway, 8 replicas, approximate trees", value=0.66,
                   unit="fraction", source=REF11, params={"replicas": 8}),
            Anchor(metric="hit_rate", subject="sglang model gateway, 8 replicas, shared index", value=0.95,
                   unit="fraction", source=REF11, params={"replicas": 8}),
            Anchor(metric="headers_ms", subject="prototype gateway (StreamingResponse)", value=37.0, unit="ms",
                   source="REFERENCE §11, decision headers against a 500 ms TTFT", params={"stand_in_ttft_ms": 500.0})]


def run(quick: bool = False, results_root: str | None = None) -> list[SummaryRow]:
    cfg = QUICK if quick else FULL
    t_start = time.monotonic()
    reqs, desc = render_workload(cfg["workload_requests"], seed=1, max_output_tokens=cfg["max_output_tokens"])
    tenancy = Tenancy.of(sorted({r.tenant for r in reqs}))
    wanted = QUICK_FRONTS if quick else ROUTING_FRONTS
    skipped = {f.name: missing(f.kind) for f in wanted if missing(f.kind)}
    fronts = [f for f in wanted if f.name not in skipped]
    for name, why in skipped.items():
        print(f"  skipped {name}: {why}", flush=True)
    overhead_fronts = [f for f in (GATEWAY, GATEWAY_AIOHTTP, SGLANG) if f.name not in skipped]
    raw_o: list = []
    raw_r: list = []
    t = time.monotonic()
    rows = _overhead(cfg, reqs, tenancy, overhead_fronts, raw_o)
    print(f"  overhead part: {time.monotonic() - t:.1f} s", flush=True)
    t = time.monotonic()
    per_seed: dict = {}
    rows += _routing(cfg, reqs, tenancy, fronts, raw_r, per_seed)
    rows += _paired(per_seed, cfg["rates"])
    rows.append(SummaryRow(metric="hit_rate_ceiling", subject="one unbounded cache per scope, sequential",
                           value=hit_rate_ceiling(reqs[:cfg["cell_requests"]]), unit="fraction",
                           params={"part": "routing_ceiling", "requests": cfg["cell_requests"]},
                           notes="computed from the workload (no engines): the most any router could reach on "
                                 "these requests"))
    print(f"  routing part: {time.monotonic() - t:.1f} s", flush=True)
    rows += _acceptance(rows)
    for name, why in skipped.items():
        rows.append(SummaryRow(metric="skipped", subject=name, value=1.0, unit="bool", notes=why))
    rows.append(SummaryRow(metric="workload_requests", subject="sessions trace", value=float(desc["requests"]),
                           unit="count", params={"tenants": desc["tenants"], "sessions": desc["sessions"],
                                                 "mean_prompt_tokens": round(desc["mean_prompt_tokens"], 1),
                                                 "block_tokens": desc["block_tokens"]},
                           notes=f"{desc['cli']}; LoRA adapters: {', '.join(desc['adapters']) or 'none'}; prompts "
                                 f"rendered to text (1 token = 1 byte, the stand-in's tokenizer); max_tokens capped at "
                                 f"{cfg['max_output_tokens']}"))
    write_summary(NAME, rows, results_root, profile="quick" if quick else "full", started_at=t_start,
                  anchors=anchors())
    write_raw(NAME, "overhead_requests.csv", ["part", "front", "rep", "index", "ttft_s", "headers_s", "latency_s",
                                              "status", "error"], raw_o, results_root)
    write_raw(NAME, "routing_requests.csv", ["front", "rate_per_s", "rep", "index", "tenant", "worker", "t_send_s",
                                             "headers_s", "ttft_s", "latency_s", "prompt_tokens", "cached_tokens",
                                             "completion_tokens", "status", "error"], raw_r, results_root)
    for r in rows:
        if r.metric.startswith("accept_") or r.metric in ("added_ttft_p50_ms", "headers_ms"):
            print(f"{r.metric:<36} {r.subject:<40} {r.value:9.3f} {r.unit} {dict(r.params)}")
    return rows


def plot(results_root: str | None = None, out_dir: str = "paper/figures"):
    """``gateway.png``: per front and request rate, the engines' prefix-cache hit rate and the client's TTFT p50
    (p99 dashed); the front-added TTFT at light load; throughput at 100 streams against direct."""
    from experiments.plotstyle import BASELINE, OURS, PALETTE, figure, save, style_axes
    from quillcache.results import read_summary

    df = read_summary(NAME, results_root)
    rt = df[df["part"] == "routing"]
    fig, axes = figure(13.0, 4.3, ncols=4)
    for i, subject in enumerate(dict.fromkeys(rt["subject"])):
        color = PALETTE[i % len(PALETTE)]
        for ax, metric, ls in ((axes[0], "hit_rate", "-"), (axes[1], "ttft_p50_ms", "-"),
                               (axes[1], "ttft_p99_ms", ":")):
            part = rt[(rt["subject"] == subject) & (rt["metric"] == metric)].sort_values("rate_per_s")
            err = [part["value"] - part["p10"], part["p90"] - part["value"]]
            ax.errorbar(part["rate_per_s"], part["value"], yerr=err,
                        marker="o", ms=3, lw=1.2, ls=ls, color=color, capsize=2,
                        label=subject if metric != "ttft_p99_ms" else None)
    style_axes(axes[0], xlabel="request rate (req/s)", ylabel="engine prefix-cache hit rate",
               title="hit rate, 4 stand-in engines")
    style_axes(axes[1], xlabel="request rate (req/s)", ylabel="TTFT (ms)", title="client TTFT p50 (p99 dotted)")
    axes[1].set_yscale("log")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=4, fontsize=7, frameon=False)
    for ax, metric, part, title, ylabel, limit in (
            (axes[2], "added_ttft_p50_ms", "overhead_light", "added TTFT p50, light load", "ms over direct", 2.0),
            (axes[3], "throughput_rps", "overhead_streams", "100 concurrent streams", "req/s", None)):
        sub = df[(df["metric"] == metric) & (df["part"] == part)]
        colors = [BASELINE if s.startswith("direct") else OURS if s.startswith("quillcache") else PALETTE[2]
                  for s in sub["subject"]]
        ax.bar(range(len(sub)), sub["value"], color=colors, capsize=3,
               yerr=[sub["value"] - sub["p10"], sub["p90"] - sub["value"]])
        if limit is not None:
            ax.axhline(limit, color="#000000", lw=0.8, ls="--")
        ax.set_xticks(range(len(sub)))
        ax.set_xticklabels([s.replace(" ", "\n", 1) for s in sub["subject"]], fontsize=7)
        style_axes(ax, ylabel=ylabel, title=title)
    return save(fig, Path(out_dir) / "gateway.png")


def main(argv: list[str] | None = None) -> None:
    from experiments.microbench import bench_main

    bench_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
