"""Regression tests for the routing / planner / allocator review findings (one test group per finding)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import quillcache.routing.dynamo as dynamo_mod
from quillcache.alloc import AllocatorError, InvalidHandleError, OffsetAllocator, PyOffsetAllocator
from quillcache.alloc._contract import NUM_TAGS, TAG_SHIFT, TagRegistry
from quillcache.identity.scope import IdentityRegistry, make_identity
from quillcache.index import ResidencyEntry, open_index
from quillcache.planner import CostModel, Planner, PlannerConfig, ReferencePlanner
from quillcache.planner.cost_model import NUM_SOURCE_KINDS
from quillcache.routing import ROUTERS, DynamoCostRouter, LoadTracker, RouteRequest, make_router
from quillcache.routing.base import MAX_ROUTE_LOAD, MAX_ROUTE_TOKENS, Router, check_route
from quillcache.routing.dynamo import _select, dynamo_logits_reference, select_reference
from quillcache.types import CacheTier

BS = 16
ME = make_identity(model="llama-3-8b", tokenizer="llama3", tenant="acme")
W = ["w0", "w1", "w2"]


def _planners(router_fast, router_ref, workers=W):
    reg = IdentityRegistry()
    reg.register(ME)
    ix = open_index("flat")
    loads = LoadTracker(workers)
    cfg = PlannerConfig(block_size_tokens=BS, seed=1)
    fast = Planner(ix, workers, router=router_fast, registry=reg, config=cfg, loads=loads)
    ref = ReferencePlanner(ix, workers, router=router_ref, registry=reg, config=cfg, loads=loads)
    return ix, fast, ref


def _put(ix, hashes, node, tier=CacheTier.GPU):
    ix.put(ResidencyEntry(int(h), node, tier, ME.digest(), 0, 0, 1 << 21) for h in hashes)


def _route(ov, isl=64, bs=16, apt=None, dec=None):
    ov = np.asarray(ov, dtype=np.int64)
    n = ov.shape[1]
    return RouteRequest(ov, isl, bs, np.zeros(n, np.int64) if apt is None else np.asarray(apt, np.int64),
                        np.zeros(n, np.int64) if dec is None else np.asarray(dec, np.int64))


# ---- 1. the fused planner reads the live router's parameters ---------------------------------------------

def test_the_fused_planner_follows_router_attribute_changes_like_the_reference():
    ix, fast, ref = _planners(DynamoCostRouter(seed=5), DynamoCostRouter(seed=5))
    req = fast.request(ME, np.arange(1, 1 + 8 * BS, dtype=np.uint32))
    _put(ix, req.block_hashes[:4], "w1")
    for pl in (fast, ref):
        pl.router.temperature = 1.0
    picks_fast = [fast.plan(req).worker for _ in range(200)]
    picks_ref = [ref.plan(req).worker for _ in range(200)]
    assert picks_fast == picks_ref and len(set(picks_fast)) == 3  # sampled, not always the cache-hot worker
    for pl in (fast, ref):  # credits and scale too: no prefill term -> the decode load alone decides
        pl.router.temperature = 0.0
        pl.router.tier_credits = (0.0, 0.0, 0.0)
        pl.router.prefill_load_scale = 0.0
    with fast.loads.track("w1", prefill_tokens=0, decode_blocks=3), fast.loads.track("w2", prefill_tokens=0,
                                                                                        decode_blocks=5):
        assert fast.plan(req).worker == ref.plan(req).worker == "w0"  # the old parameters pick w1


def test_a_dynamo_router_assigned_later_is_used_by_the_fused_path():
    ix, fast, ref = _planners("round_robin", "round_robin")
    req = fast.request(ME, np.arange(1, 1 + 8 * BS, dtype=np.uint32))
    _put(ix, req.block_hashes[:4], "w1")
    fast.router = DynamoCostRouter(temperature=0.7, seed=3)
    ref.router = DynamoCostRouter(temperature=0.7, seed=3)
    a = [fast.plan(req) for _ in range(100)]
    b = [ref.plan(req) for _ in range(100)]
    assert [(p.worker, p.reused_blocks) for p in a] == [(p.worker, p.reused_blocks) for p in b]


# ---- 2. allocator tags are unique among live allocators ---------------------------------------------------

@pytest.mark.parametrize("cls", [OffsetAllocator, PyOffsetAllocator])
def test_no_later_live_allocator_shares_a_live_allocators_tag(cls):
    a = cls(1024, 8)
    ha = a.allocate(100)
    keep = [cls(64, 2) for _ in range(50)]  # more live ones
    for _ in range(NUM_TAGS - 61):  # created and dropped: a wrapping counter would now be 10 tags before a's
        cls(64, 1)
    later = [cls(1024, 8) for _ in range(100)]  # ... so these would reach a's tag and keep's
    for _ in range(NUM_TAGS + 5):  # and once more round the whole tag space
        cls(64, 1)
    later.append(cls(1024, 8))
    tags = [x.allocate(1).handle >> TAG_SHIFT for x in keep + later] + [ha.handle >> TAG_SHIFT]
    assert len(set(tags)) == len(tags)
    for b in later:
        with pytest.raises(InvalidHandleError, match="not issued by this allocator"):
            b.free(ha.handle)
        assert b.num_live_allocations == 1
    assert a.num_live_allocations == 1
    a.free(ha)


def test_the_tag_registry_refuses_only_when_every_tag_is_live():
    reg = TagRegistry(num_tags=3, start=2)
    assert [reg.acquire() for _ in range(3)] == [3, 1, 2]
    with pytest.raises(AllocatorError, match="all 3 allocator tags are held by live allocators"):
        reg.acquire()
    reg.release(1)
    assert reg.acquire() == 1 and len(reg) == 3
    reg.release(2)
    reg.release(2)  # a second release is a no-op
    assert reg.acquire() == 2


@pytest.mark.parametrize("cls", [OffsetAllocator, PyOffsetAllocator])
def test_a_collected_allocator_gives_its_tag_back(cls):
    from quillcache.alloc import _contract

    before = len(_contract._tags)
    xs = [cls(64, 1) for _ in range(10)]
    assert len(_contract._tags) == before + 10
    del xs
    gc.collect()
    assert len(_contract._tags) == before


# ---- 3. route inputs are bounded, so the kernel never wraps int64 ---------------------------------------

@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_check_route_refuses_unbounded_lengths_and_overlaps(name):
    r = make_router(name, seed=0)
    with pytest.raises(ValueError, match="isl_tokens"):
        r.select(_route([[1, 0], [0, 0], [0, 0]], isl=2**70))
    with pytest.raises(ValueError, match="isl_tokens"):
        r.select(_route([[0, 0], [0, 0], [0, 0]], isl=MAX_ROUTE_TOKENS + 1))
    with pytest.raises(ValueError, match="block_size_tokens"):
        r.select(_route([[0, 0], [0, 0], [0, 0]], bs=MAX_ROUTE_TOKENS + 1))
    with pytest.raises(ValueError, match="overlaps of worker 0"):
        r.select(_route([[3 * 2**58, 0], [0, 0], [0, 0]], apt=[1600, 0]))
    with pytest.raises(ValueError, match="overlaps of worker 1"):  # per-value fine, sum too long (4 blocks)
        r.select(_route([[0, 2], [0, 2], [0, 1]]))
    with pytest.raises(ValueError, match="overlaps of worker 0"):  # a wrapping int64 sum is caught too
        r.select(_route([[2**62, 0], [2**62, 0], [2**62, 0]]))
    r.select(_route([[0, 2], [0, 1], [0, 1]]))  # exactly the request's blocks: fine


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_check_route_refuses_loads_that_would_wrap_the_kernel(name):
    r = make_router(name, seed=0)
    with pytest.raises(ValueError, match="active_prefill_tokens"):
        r.select(_route([[0, 0], [0, 0], [0, 0]], apt=[2**63 - 10, 0]))
    with pytest.raises(ValueError, match="decode_blocks"):
        r.select(_route([[0, 0], [0, 0], [0, 0]], dec=[0, MAX_ROUTE_LOAD + 1]))
    huge_u = RouteRequest(np.zeros((3, 2), np.int64), 64, 16, np.zeros(2, np.int64),
                          np.array([0, 2**64 - 1], np.uint64))
    with pytest.raises(ValueError, match="decode_blocks"):
        r.select(huge_u)
    r.select(_route([[0, 0], [0, 0], [0, 0]], apt=[MAX_ROUTE_LOAD, 0], dec=[0, MAX_ROUTE_LOAD]))


def test_the_kernel_equals_the_reference_at_the_load_bound():
    r = DynamoCostRouter(seed=0)
    route = _route([[4, 0], [0, 0], [0, 0]], apt=[MAX_ROUTE_LOAD, 3], dec=[5, MAX_ROUTE_LOAD])
    ref = dynamo_logits_reference([4, 0], [0, 0], [0, 0], [MAX_ROUTE_LOAD, 3], [5, MAX_ROUTE_LOAD], 64, 16)
    assert r.logits(route).tolist() == ref


@pytest.mark.parametrize("isl,bs,dev", [(MAX_ROUTE_TOKENS, 1, MAX_ROUTE_TOKENS), (MAX_ROUTE_TOKENS, MAX_ROUTE_TOKENS, 1),
                                        (MAX_ROUTE_TOKENS - 1, 3, (MAX_ROUTE_TOKENS - 1) // 3), (1, MAX_ROUTE_TOKENS, 1)])
def test_the_kernel_equals_the_reference_at_the_bounds(isl, bs, dev):
    r = DynamoCostRouter(seed=0)
    route = _route([[dev, 0], [0, 0], [0, 0]], isl=isl, bs=bs, apt=[1600, 0])
    check_route(route)
    ref = dynamo_logits_reference([dev, 0], [0, 0], [0, 0], [1600, 0], [0, 0], isl, bs)
    assert r.logits(route).tolist() == ref
    assert r.select(route) == select_reference(ref, [True, True], 0.0, 0.5)


class _CheckingRouter(Router):
    """Checks every route the planner builds, then decides as the Dynamo router."""

    name = "checking"

    def __init__(self, seed=None):
        super().__init__(seed=seed)
        self.inner = DynamoCostRouter(seed=seed)
        self.routes = 0

    def _select(self, route):
        check_route(route)
        self.routes += 1
        return self.inner._select(route)


def test_the_planners_routes_pass_the_bounds_for_fully_cached_prompts():
    ix, fast, ref = _planners(_CheckingRouter(0), _CheckingRouter(0))
    for n_tokens in (BS, 4 * BS, 4 * BS + 3):
        req = fast.request(ME, np.arange(7, 7 + n_tokens, dtype=np.uint32))
        h = req.block_hashes
        _put(ix, h, "w0")
        _put(ix, h, "w1", CacheTier.DRAM)
        _put(ix, h, "w2", CacheTier.SSD)
        for pl in (fast, ref):
            pl.plan(req)
    assert fast.router.routes == ref.router.routes == 3


# ---- 4. a subnormal temperature falls back to the temperature-0 rule ------------------------------------

def test_a_subnormal_temperature_decides_like_temperature_zero():
    r = DynamoCostRouter(temperature=5e-324, seed=0)
    route = _route([[0, 0], [0, 0], [1, 0]])  # costs differ by 0.25: (vmax - vmin) * T underflows to 0
    lg = r.logits(route).tolist()
    assert r.select(route) == 0
    assert select_reference(lg, [True, True], 5e-324, 0.5) == 0
    elig = np.ones(3, dtype=np.bool_)
    for vals in ([1.0, 1.25, 1.125], [-1e308, 1e308, 0.0]):  # scale 0 (0.25 * 5e-324), scale inf
        v = np.array(vals)
        for u in (0.0, 0.5, 0.99):
            t = 5e-324 if vals[0] == 1.0 else 1.0
            assert _select(v, elig, t, u) == select_reference(vals, [True] * 3, t, u) == 0


def test_the_planner_kernel_survives_a_subnormal_temperature():
    ix, fast, ref = _planners(DynamoCostRouter(temperature=5e-324, seed=2), DynamoCostRouter(temperature=5e-324, seed=2))
    req = fast.request(ME, np.arange(1, 1 + 6 * BS, dtype=np.uint32))
    _put(ix, req.block_hashes[:1], "w2", CacheTier.SSD)
    a, b = fast.plan(req), ref.plan(req)
    assert (a.worker, a.reused_blocks) == (b.worker, b.reused_blocks) and a.worker == "w2"


# ---- 5. a fully cached aligned prompt still computes its last block ------------------------------------

@pytest.mark.parametrize("n_tokens,reused", [(4 * BS, 3), (4 * BS + 1, 4), (BS, 0), (BS + 1, 1)])
def test_reuse_stops_before_the_last_prompt_token(n_tokens, reused):
    ix, fast, ref = _planners("dynamo", "dynamo", workers=["w0", "w1"])
    req = fast.request(ME, np.arange(100, 100 + n_tokens, dtype=np.uint32), output_tokens=8)
    _put(ix, req.block_hashes, "w1")
    for pl in (fast, ref):
        plan = pl.plan(req)
        assert plan.worker == "w1" and plan.reused_blocks == reused
        assert plan.cached_tokens == (n_tokens - 1) // BS * BS <= n_tokens - 1  # the stand-in engine's rule
        assert plan.new_prefill_tokens == n_tokens - reused * BS >= 1
        assert plan.usage() == {"prompt_tokens": n_tokens, "cached_tokens": reused * BS}
    with fast.admit(fast.plan(req)) as lease:
        assert lease.prefill_tokens == n_tokens - reused * BS
        assert fast.loads.snapshot()["w1"]["active_prefill_tokens"] == n_tokens - reused * BS


# ---- 6. the documented older form is credits (1, 0, 0) --------------------------------------------------

def test_credits_1_0_0_give_the_older_form_and_the_doc_says_so():
    route = _route([[4, 0], [0, 0], [0, 0]], isl=128, dec=[2, 1])  # worker 0 holds 4 of 8 blocks on GPU
    for w in (0.5, 1.0, 3.0):
        older = [w * (8 - 4) + 2, w * 8 + 1]  # weight * prefill_blocks + decode_blocks
        lg = DynamoCostRouter(prefill_load_scale=w, tier_credits=(1, 0, 0)).logits(route) - 8
        assert lg.tolist() == older
    # all credits 0 is NOT that form: the cache term vanishes
    assert (DynamoCostRouter(tier_credits=(0, 0, 0)).logits(route) - 8).tolist() == [8 + 2, 8 + 1]
    doc = " ".join(dynamo_mod.__doc__.split())
    assert "all tier credits 0 gives the older" not in doc
    assert "Tier credits ``(1, 0, 0)`` with ``prefill_load_scale`` as the weight give the older" in doc


# ---- 7. CostModel.fetch_s checks the source kinds -------------------------------------------------------

def test_fetch_s_refuses_kinds_outside_the_source_kinds():
    cm = CostModel()
    with pytest.raises(ValueError, match=r"kinds\[0\]=-1 is not a source kind"):
        cm.fetch_s([-1], 2 << 20)
    with pytest.raises(ValueError, match=rf"kinds\[2\]=7 is not a source kind: must be in \[0, {NUM_SOURCE_KINDS}\)"):
        cm.fetch_s([0, 1, 7], 2 << 20)
    with pytest.raises(ValueError, match="integer source kinds"):
        cm.fetch_s([1.0], 2 << 20)
    per, lat = cm.source_costs(2 << 20)
    assert cm.fetch_s([1, 1, 4], 2 << 20) == float(per[1]) + float(lat[1]) + float(per[1]) + float(per[4]) + float(lat[4])
    assert cm.fetch_s(np.array([6], dtype=np.int8), 2 << 20) == float(per[6]) + float(lat[6])
    assert cm.fetch_s([], 2 << 20) == 0.0
