"""The discrete-event replay over the real planner, router, index and store tiers."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from quillcache.harness import ReplayConfig, replay
from quillcache.hitrate import simulate
from quillcache.store import StoreKey
from quillcache.traces.loader import TraceRequest
from quillcache.types import CacheTier

BS = 16
MODEL = "llama-3.2-1b"  # 32 KiB/token -> 512 KiB per 16-token block


def make_trace(*, convs: int = 6, turns: int = 4, gap_ms: int = 10_000, shared: int = 2, seed: int = 0) -> list[TraceRequest]:
    """Multi-turn conversations behind a shared system prompt (ids 0..shared-1); turns interleave.
    Every prompt is whole blocks, so the hit-rate kernels see exactly the replay's full blocks."""
    rng = random.Random(seed)
    nxt = shared
    hist = [list(range(shared)) for _ in range(convs)]
    out = []
    for t in range(turns):
        for c in range(convs):
            new = rng.randint(1, 4)
            ids = hist[c] + list(range(nxt, nxt + new))
            nxt += new
            hist[c] = ids
            out.append(ids)
    return [TraceRequest(i * gap_ms, len(ids) * BS, rng.randint(1, 40), tuple(ids), block_tokens=BS)
            for i, ids in enumerate(out)]


def cfg(**kw) -> ReplayConfig:
    base = {"model": MODEL, "engines": 1, "gpu_capacity_blocks": 10_000, "dram_capacity_blocks": 64,
            "ssd_capacity_blocks": 0, "account_bytes": False, "seed": 1}
    base.update(kw)
    return ReplayConfig(**base)


def test_hit_rate_matches_kernel_on_one_engine_with_room() -> None:
    trace = make_trace()
    res = replay(trace, cfg())
    want = simulate(trace, "lru", None)
    s = res.summary
    assert sum(r.hit_blocks for r in res.rows) == want.hit_blocks
    assert [r.hit_blocks for r in res.rows] == want.hits_per_request.tolist()
    assert s.full_blocks == want.total_blocks
    assert s.block_hit_rate == pytest.approx(want.hit_rate)
    assert s.block_hit_rate_gpu == pytest.approx(want.hit_rate)  # everything fits the GPU
    assert res.verify_failures == 0 and not res.account_bytes


def _largest_prompt_blocks(trace) -> int:
    return max(len(r.hash_ids) for r in trace)


def test_gpu_pressure_offloads_to_dram_and_hits_are_kept() -> None:
    trace = make_trace()
    # the GPU holds the largest prompt (an engine cannot prefill more) but far from every conversation
    res = replay(trace, cfg(gpu_capacity_blocks=_largest_prompt_blocks(trace), dram_capacity_blocks=512))
    want = simulate(trace, "lru", None)
    s = res.summary
    # every block evicted from the small GPU is still on the node (DRAM): the same hits, by tier
    assert [r.hit_blocks for r in res.rows] == want.hits_per_request.tolist()
    assert s.block_hit_rate_dram > 0 and s.block_hit_rate_gpu > 0
    assert s.bytes_offloaded_gpu_to_dram > 0 and s.bytes_fetched_dram > 0
    assert res.verify_failures == 0


def test_small_gpu_alone_matches_lru_kernel_gpu_hits_bound() -> None:
    trace = make_trace(convs=8, turns=5)
    gpu = max(12, _largest_prompt_blocks(trace))
    res = replay(trace, cfg(gpu_capacity_blocks=gpu, dram_capacity_blocks=1))
    lru12 = simulate(trace, "lru", gpu).hit_blocks
    # GPU hits can only exceed the kernel's leading-prefix hits where DRAM filled a gap
    assert sum(r.hit_gpu for r in res.rows) >= lru12 - sum(r.hit_dram for r in res.rows)
    assert sum(r.hit_blocks for r in res.rows) <= simulate(trace, "lru", None).hit_blocks


def run_busy(**kw):
    trace = make_trace(convs=10, turns=4, gap_ms=5)  # arrivals far faster than prefill: queues, overlap
    return trace, replay(trace, cfg(engines=3, gpu_capacity_blocks=20, dram_capacity_blocks=16,
                                    ssd_capacity_blocks=32, **kw), keep_open=True)


def test_conservation_ttft_and_index_residency_under_load() -> None:
    trace, res = run_busy()
    try:
        rows = res.rows
        assert sorted(r.request_id for r in rows) == list(range(len(trace)))
        assert all(math.isfinite(r.finish_s) for r in rows)
        em = res.engine_model
        for r in rows:
            assert r.hit_blocks + r.recompute_blocks == r.full_blocks
            want_prefill = em.prefill_s(r.input_tokens - r.cached_tokens, r.cached_tokens)
            assert r.prefill_s == pytest.approx(want_prefill)
            assert r.ttft_s >= want_prefill - 1e-12
            assert r.finish_s == pytest.approx(r.arrival_s + r.ttft_s + r.decode_s)
            assert r.queue_s >= -1e-12
        assert {r.engine for r in rows} > {"engine-0"}  # the load spread requests over engines
        assert res.summary.requests == len(trace)
        for name, dp in res.planes.items():
            mine = {dataclasses.astuple(e) for e in dp.residency()}
            indexed = {dataclasses.astuple(e) for e in res.index.entries_on_node(name)}
            assert mine == indexed, name
            assert all(dp.in_use_reason(k) is None for k in dp)  # every pin released
            assert len([k for k in dp if CacheTier.GPU in dp.tiers_of(k)]) <= 20
        assert res.verify_failures == 0
    finally:
        res.close()


def test_deterministic_and_real_bytes_equal_accounted_bytes() -> None:
    _, a = run_busy()
    _, b = run_busy()
    _, c = run_busy(account_bytes=True)
    try:
        def key(r):
            return r.as_dict()

        assert [key(r) for r in a.rows] == [key(r) for r in b.rows]
        # accounting mode runs the same code path: the same decisions and offsets
        assert [key(r) for r in a.rows] == [key(r) for r in c.rows]
        sa, sc = a.summary.as_dict(), c.summary.as_dict()
        for d in (sa, sc):
            d.pop("wall_s"), d.pop("account_bytes")
        assert sa == sc
        assert c.account_bytes and not a.account_bytes
        ra = {dataclasses.astuple(e) for dp in a.planes.values() for e in dp.residency()}
        rc = {dataclasses.astuple(e) for dp in c.planes.values() for e in dp.residency()}
        assert ra == rc
        assert a.summary.block_hit_rate_ssd > 0 or a.summary.bytes_dram_to_ssd > 0  # the SSD tier was used
    finally:
        for r in (a, b, c):
            r.close()


def test_real_bytes_reach_the_reader() -> None:
    _, res = run_busy()
    try:
        dp = res.planes["engine-0"]
        keys = [k for k in dp if k in dp.dram]
        assert keys
        for k in keys[:5]:
            assert bytes(dp.get(k)[:24]) == k.to_bytes()
        assert isinstance(keys[0], StoreKey)
    finally:
        res.close()


def test_router_choice_changes_placement_not_conservation() -> None:
    trace = make_trace(convs=6, turns=3, gap_ms=50)
    engines, gpu_held, hits = {}, {}, {}
    for router in ("round_robin", "least_loaded", "prefix_affinity", "dynamo"):
        res = replay(trace, cfg(engines=2, router=router), keep_open=True)
        try:
            assert sorted(r.request_id for r in res.rows) == list(range(len(trace)))  # conservation
            engines[router] = [r.engine for r in res.rows]
            gpu_held[router] = {(name, k.block_hash) for name, dp in res.planes.items() for k in dp
                                if CacheTier.GPU in dp.tiers_of(k)}
            hits[router] = (sum(r.hit_gpu for r in res.rows), sum(r.hit_peer for r in res.rows))
        finally:
            res.close()
    assert engines["round_robin"][:4] == ["engine-0", "engine-1", "engine-0", "engine-1"]
    # the placement differs: which engine served each request, and which engine's GPU holds which blocks
    assert engines["round_robin"] != engines["prefix_affinity"] != engines["least_loaded"] != engines["round_robin"]
    assert gpu_held["round_robin"] != gpu_held["prefix_affinity"]
    # every conversation shares the system prompt: affinity keeps them on the engine holding it (no peer
    # fetches), round robin splits them, so some reuse must come from the other engine
    assert len(set(engines["prefix_affinity"])) == 1 and hits["prefix_affinity"][1] == 0
    assert set(engines["round_robin"]) == {"engine-0", "engine-1"}
    assert hits["round_robin"][0] < hits["prefix_affinity"][0]


@pytest.mark.parametrize("kw, match", [
    ({"policy": "belady"}, "belady needs the future"),
    ({"policy": "lookahead"}, "semi-online policy of quillcache.hitrate"),
    ({"policy": "nope"}, "unknown policy 'nope'"),
    ({"router": "nope"}, "unknown router"),
    ({"dram_capacity_blocks": 0}, "dram_capacity_blocks=0"),
    ({"engines": 0}, "engines=0"),
    ({"model": "gpt-9"}, "unknown model"),
    ({"ttft_slo_s": -1.0}, "ttft_slo_s"),
])
def test_bad_config_is_refused(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ReplayConfig(**kw)


def test_bad_requests_are_refused() -> None:
    t = make_trace(convs=2, turns=2)
    with pytest.raises(ValueError, match="sorted by arrival"):
        replay([t[1], t[0]], cfg())
    with pytest.raises(ValueError, match="no requests"):
        replay([], cfg())
    with pytest.raises(TypeError, match="TraceRequest"):
        replay([{"timestamp": 0}], cfg())  # type: ignore[list-item]
    with pytest.raises(TypeError, match="ReplayConfig"):
        replay(t, {"engines": 1})  # type: ignore[arg-type]


def test_a_prompt_larger_than_the_gpu_kv_is_refused_or_skipped_not_replayed() -> None:
    """A 32,000-block prompt on an engine with 833 GPU blocks used to 'replay' with a TTFT of days."""
    from quillcache.harness.replay import RequestTooLargeError

    trace = make_trace(convs=2, turns=2)
    big = TraceRequest(trace[-1].timestamp_ms + 1, 100 * BS, 1, tuple(range(10_000, 10_100)), block_tokens=BS)
    trace = [*trace, big]
    with pytest.raises(RequestTooLargeError, match=r"request 4 .* needs 100 KV blocks .* GPU holds 50"):
        replay(trace, cfg(gpu_capacity_blocks=50))
    res = replay(trace, cfg(gpu_capacity_blocks=50, on_oversize="skip"))
    assert res.skipped_oversize == 1 and res.summary.requests == len(trace) - 1
    with pytest.raises(ValueError, match="on_oversize='drop' must be 'stop' or 'skip'"):
        cfg(on_oversize="drop")


def test_real_bytes_beyond_this_machines_ram_are_refused_before_allocating(monkeypatch) -> None:
    import importlib

    R = importlib.import_module("quillcache.harness.replay")  # the module (the package re-exports the function)
    monkeypatch.setattr(R, "available_ram_bytes", lambda: 16 << 20)  # a 16 MiB machine
    with pytest.raises(R.ReplayResourceError, match=r"real bytes need [\d.]+ GiB of DRAM \(1 engines x \d+ blocks "
                                                    r"x 2 MiB\) but this machine has [\d.]+ GiB available"):
        replay(make_trace(), cfg(model="llama-3-8b", dram_capacity_blocks=64, account_bytes=False))


def test_result_is_a_context_manager_and_a_frame() -> None:
    trace = make_trace(convs=2, turns=2)
    with replay(trace, cfg(), keep_open=True) as res:
        assert res.index is not None
        df = res.to_frame()
        assert len(df) == len(trace) and list(df.columns)[0] == "request_id"
    assert res.index is not None  # closed, not dropped


def test_simulated_time_starts_at_the_first_arrival() -> None:
    """A trace shifted late (timestamps near 10**12 ms) replays exactly like the same trace at 0."""
    trace = make_trace(convs=2, turns=2)
    late = [dataclasses.replace(r, timestamp_ms=r.timestamp_ms + 10**12) for r in trace]
    a, b = replay(trace, cfg()), replay(late, cfg())
    assert [r.ttft_s for r in a.rows] == [r.ttft_s for r in b.rows]
    with pytest.raises(ValueError, match=r"time_scale=1e-06 stretches .* past 4.29e\+09 s"):
        replay([trace[0], dataclasses.replace(trace[1], timestamp_ms=10**12)], cfg(time_scale=1e-6))


# ---- quantized host tiers (ReplayConfig.kv_codec) --------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    ({"kv_codec": "int9"}, r"kv_codec='int9' is not a KV codec; known: fp16, int8, fp8_e4m3, int4, int2"),
    ({"kv_codec": None}, "is not a KV codec"),
    ({"kv_codec": "int8", "kv_dtype": "float32"}, "quantizes 16-bit KV"),
    ({"dram_capacity_bytes": 0}, "dram_capacity_bytes=0"),
    ({"ssd_capacity_bytes": -1}, "ssd_capacity_bytes=-1"),
    ({"dequant_hbm_share": 0.0}, "dequant_hbm_share"),
])
def test_bad_codec_config_is_refused(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ReplayConfig(**kw)


def test_every_kvquant_codec_is_a_tier_codec() -> None:
    from quillcache.kvquant import CODECS

    for name in ("fp16", *CODECS.names()):
        assert ReplayConfig(kv_codec=name).kv_codec == name


def test_a_budget_that_holds_no_block_is_refused() -> None:
    with pytest.raises(ValueError, match="holds no block"):
        replay(make_trace(convs=2, turns=2), cfg(kv_codec="int8", dram_capacity_bytes=4096))


def _pressured(**kw) -> ReplayConfig:
    trace = make_trace(convs=12, turns=6)
    return trace, cfg(gpu_capacity_blocks=_largest_prompt_blocks(trace), dram_capacity_blocks=20,
                      account_bytes=True, **kw)


def test_a_quantized_tier_holds_more_blocks_in_the_same_bytes_and_hits_at_least_as_often() -> None:
    from quillcache.kvquant.block import HEADER_BYTES
    from quillcache.store.tier_codec import TierCodec

    trace, _ = _pressured()
    runs = {c: replay(trace, _pressured(kv_codec=c)[1]).summary for c in ("fp16", "int8", "fp8_e4m3", "int4", "int2")}
    f = runs["fp16"]
    assert f.kv_codec == "fp16" and f.dram_capacity_blocks == 20 and f.tier_block_bytes == 512 << 10
    for c, s in runs.items():
        assert s.kv_codec == c
        assert s.dram_capacity_bytes == f.dram_capacity_bytes == 20 * (512 << 10)  # equal tier bytes
        if c == "fp16":
            continue
        # bytes per block from the codec itself: fp16 bytes x its bytes per element / 2, plus two
        # self-describing block headers and crc32cs (K and V)
        tc = TierCodec(c, tokens=BS, layers=16, kv_heads=8, head_dim=64)
        want = f.tier_block_bytes * tc.bytes_per_element / 2 + 2 * (HEADER_BYTES + 4)
        assert s.tier_block_bytes == tc.block_bytes == pytest.approx(want, abs=1e-6)
        assert s.dram_capacity_blocks == f.dram_capacity_bytes // (-(-tc.block_bytes // 4096) * 4096) > 20
        assert s.block_hit_rate >= f.block_hit_rate
        # every host-tier byte moved is quantized: fewer bytes per offloaded block
        assert s.bytes_offloaded_gpu_to_dram % s.tier_block_bytes == 0
    assert runs["int8"].block_hit_rate > f.block_hit_rate  # this trace's DRAM is too small for fp16
    assert runs["int2"].dram_capacity_blocks > runs["int4"].dram_capacity_blocks >= runs["int8"].dram_capacity_blocks


def test_explicit_byte_budgets_override_block_counts() -> None:
    trace, c = _pressured(kv_codec="int8")
    s = replay(trace, dataclasses.replace(c, dram_capacity_bytes=40 << 20, ssd_capacity_bytes=0)).summary
    assert s.dram_capacity_bytes == 40 << 20 and s.ssd_capacity_bytes == 0 and s.ssd_capacity_blocks == 0
    assert s.dram_capacity_blocks == (40 << 20) // (-(-s.tier_block_bytes // 4096) * 4096)


def test_fetch_time_charges_quantized_bytes_and_a_dequantize_per_block() -> None:
    trace, c = _pressured()
    f = replay(trace, c).engine_model
    q = replay(trace, dataclasses.replace(c, kv_codec="int8")).engine_model
    assert f.dequantize_block_s == 0.0 and f.fetch_s([1, 1]) == f.cost_model.fetch_s([1, 1], f.block_bytes)
    hbm = q.cost_model.gpu.hbm_bytes_per_s
    assert q.dequantize_block_s == pytest.approx((q.tier_block_bytes + q.block_bytes) / (hbm * 0.7))
    host = q.cost_model.fetch_s([1, 2], q.tier_block_bytes) + 2 * q.dequantize_block_s
    assert q.fetch_s([1, 2]) == pytest.approx(host)
    assert q.fetch_s([3]) == f.fetch_s([3])  # a peer GPU's block stays 16-bit, nothing to dequantize
    assert q.fetch_s([1]) < f.fetch_s([1])  # half the PCIe bytes outweigh the dequantize


def test_real_bytes_quantize_on_offload_and_dequantize_on_fetch_like_accounting() -> None:
    trace = make_trace(convs=6, turns=4, gap_ms=5)
    kw = dict(engines=2, gpu_capacity_blocks=_largest_prompt_blocks(trace), dram_capacity_blocks=6,
              ssd_capacity_blocks=8, kv_codec="int8")
    real = replay(trace, cfg(**kw), keep_open=True)
    acct = replay(trace, cfg(account_bytes=True, **kw))
    try:
        assert not real.account_bytes and real.verify_failures == 0 and real.dequantized_blocks > 0
        sr, sa = real.summary.as_dict(), acct.summary.as_dict()
        for d in (sr, sa):
            d.pop("wall_s"), d.pop("account_bytes")
        assert sr == sa  # the same decisions and bytes whether the payloads exist or not
        assert real.summary.bytes_fetched_dram + real.summary.bytes_fetched_ssd > 0
        from quillcache.harness.replay import _block_kv
        from quillcache.store.tier_codec import TierCodec

        tc = TierCodec("int8", tokens=BS, layers=16, kv_heads=8, head_dim=64)
        dp = real.planes["engine-0"]
        checked = 0
        for key in list(dp):  # the stored bytes are the codec's blocks of the key's K/V
            if key in dp.dram:  # (a read of an SSD block promotes it and may evict another)
                k2, _ = tc.decode(dp.get(key))
                k, _ = _block_kv(key, tc.shape)
                assert float(abs(k2.astype("f4") - k.astype("f4")).max()) < 0.05
                checked += 1
        assert checked
    finally:
        real.close()
