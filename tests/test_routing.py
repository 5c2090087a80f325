import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache.routing import (
    ROUTERS,
    DynamoCostRouter,
    LoadTracker,
    RouteRequest,
    WorkerSpec,
    make_router,
)
from quillcache.routing.base import EngineRole
from quillcache.routing.dynamo import (
    _logits,
    _select,
    dynamo_logits_reference,
    select_reference,
)


def route(dev, host=None, disk=None, isl=64, bs=16, apt=None, dec=None, eligible=None) -> RouteRequest:
    n = len(dev)
    ov = np.array([dev, host or [0] * n, disk or [0] * n], dtype=np.int64)
    return RouteRequest(ov, isl, bs, np.array(apt or [0] * n, dtype=np.int64), np.array(dec or [0] * n, dtype=np.int64),
                        None if eligible is None else np.array(eligible, dtype=np.bool_))


def chi2(counts, probs) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


def test_dynamo_documented_example_picks_the_second_worker():
    # weight 1.0, no lower tiers: workers at 8+10, 5+5 and 2+9 blocks (prefill+decode) -> the second.
    # isl 64 tokens (4 blocks of 16); in-flight prefill 64 / 16 / 0 tokens; worker 2 holds 2 blocks on GPU:
    # adjusted prefill = (64+64)/16 = 8, (16+64)/16 = 5, 64/16 - 2 = 2
    r = route([0, 0, 2], isl=64, apt=[64, 16, 0], dec=[10, 5, 9])
    router = DynamoCostRouter(seed=0)
    lg = router.logits(r)
    assert list(lg - 4) == [8 + 10, 5 + 5, 2 + 9]  # + the new request's 4 blocks on every worker
    assert all(router.select(r) == 1 for _ in range(20))
    ref = dynamo_logits_reference([0, 0, 2], [0] * 3, [0] * 3, [64, 16, 0], [10, 5, 9], 64, 16)
    assert ref == list(lg) and select_reference(ref, [True] * 3, 0.0, 0.5) == 1


def test_tier_credits_are_1_075_025():
    r = DynamoCostRouter()
    # 8-block request; a worker with 4 blocks in host DRAM gets 0.75 * 4 = 3 blocks of credit
    lg = r.logits(route([0, 0, 0, 0], host=[0, 4, 0, 0], disk=[0, 0, 4, 0], isl=128))
    assert list(lg) == [8 + 8, 8 - 3 + 8, 8 - 1 + 8, 8 + 8]
    lg = r.logits(route([4, 2], host=[0, 2], disk=[4, 0], isl=128))
    assert list(lg) == [8 - 4 - 1 + 8, 8 - 2 - 1.5 + 8]
    # adjusted prefill never goes negative
    assert DynamoCostRouter(tier_credits=(5.0, 0, 0)).logits(route([8], isl=128))[0] == 8
    # scale 0 drops the prefill term: decode blocks only (+ the request's 4 blocks on every worker)
    assert list(DynamoCostRouter(prefill_load_scale=0.0).logits(route([3, 0], dec=[1, 2]))) == [5, 6]


def test_ties_are_broken_uniformly_at_random_and_reproducibly():
    r = route([2, 2, 2, 0], isl=64)  # workers 0-2 tie
    picks = [DynamoCostRouter(seed=11).select(r) for _ in range(3)]
    assert len(set(picks)) == 1  # same seed, same first choice
    router = DynamoCostRouter(seed=12)
    counts = np.bincount([router.select(r) for _ in range(3000)], minlength=4)
    assert counts[3] == 0
    assert chi2(counts[:3], [1 / 3] * 3) < 13.8  # chi-square, 2 dof, p = 0.001


def test_softmax_distribution_at_positive_temperature():
    r = route([0, 1, 2, 4], isl=64)
    router = DynamoCostRouter(temperature=0.5, seed=3)
    v = router.logits(r)
    p = np.exp(-(v - v.min()) / ((v.max() - v.min()) * 0.5))
    p /= p.sum()
    counts = np.bincount([router.select(r) for _ in range(6000)], minlength=4)
    assert chi2(counts, p) < 16.3  # 3 dof, p = 0.001
    # all equal at T > 0: uniform
    eq = DynamoCostRouter(temperature=1.0, seed=4)
    counts = np.bincount([eq.select(route([1, 1, 1])) for _ in range(3000)], minlength=3)
    assert chi2(counts, [1 / 3] * 3) < 13.8


def test_only_eligible_workers_are_chosen():
    router = DynamoCostRouter(seed=1, temperature=2.0)
    r = route([5, 0, 0], isl=128, eligible=[False, True, True])
    assert all(router.select(r) in (1, 2) for _ in range(200))
    with pytest.raises(ValueError, match="eligible"):
        router.select(route([1, 1], eligible=[False, False]))


@given(
    data=st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8), st.integers(0, 8), st.integers(0, 5000),
                            st.integers(0, 300), st.booleans()), min_size=1, max_size=9),
    isl=st.integers(1, 4096), bs=st.sampled_from([1, 16, 64]), temp=st.sampled_from([0.0, 0.1, 1.0, 3.0]),
    u=st.floats(0, 0.999999), scale=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
)
def test_kernel_matches_the_reference(data, isl, bs, temp, u, scale):
    dev, host, disk, apt, dec, elig = (list(x) for x in zip(*data))
    ref = dynamo_logits_reference(dev, host, disk, apt, dec, isl, bs, prefill_load_scale=scale)
    ov = np.array([dev, host, disk], dtype=np.int64)
    out = np.empty(len(dev))
    _logits(ov, np.array(apt, dtype=np.int64), np.array(dec, dtype=np.int64), isl, bs, scale, 1.0, 0.75, 0.25, out)
    assert list(out) == ref
    e = np.array(elig, dtype=np.bool_)
    if e.any():
        assert _select(out, e, temp, u) == select_reference(ref, elig, temp, u)
    else:
        assert _select(out, e, temp, u) == -1


def test_baselines():
    rr = make_router("round_robin")
    assert [rr.select(route([0, 0, 0])) for _ in range(5)] == [0, 1, 2, 0, 1]
    assert rr.select(route([0, 0, 0], eligible=[True, False, False])) == 0
    ll = make_router("least_loaded", seed=0)
    assert ll.select(route([9, 0, 0], isl=160, apt=[0, 64, 0], dec=[0, 0, 3])) == 0
    pa = make_router("prefix_affinity", seed=0)
    assert pa.select(route([1, 3, 3], host=[0, 0, 2], isl=128, apt=[0, 0, 10_000])) == 2  # ignores load
    counts = np.bincount([pa.select(route([2, 2, 0])) for _ in range(600)], minlength=3)
    assert counts[2] == 0 and min(counts[:2]) > 200


def test_registry_errors():
    assert set(ROUTERS) == {"cache_aware", "dynamo", "round_robin", "least_loaded", "prefix_affinity"}
    with pytest.raises(ValueError, match="unknown router 'nope'.*registered"):
        make_router("nope")
    with pytest.raises(TypeError, match="temperature"):
        make_router("round_robin", temperature=1.0)
    with pytest.raises(ValueError, match="temperature"):
        make_router("dynamo", temperature=-1)
    with pytest.raises(ValueError, match="tier_credits"):
        make_router("dynamo", tier_credits=(1.0, 0.5))
    with pytest.raises(ValueError, match="tier_credits"):
        make_router("dynamo", tier_credits=(1.0, math.nan, 0.2))
    with pytest.raises(ValueError, match="empty prompt"):
        make_router("dynamo").select(route([0], isl=0))
    with pytest.raises(ValueError, match="overlaps"):
        make_router("dynamo").select(RouteRequest(np.zeros((2, 3), np.int64), 16, 16, np.zeros(3), np.zeros(3)))


def test_load_tracker_acquire_release():
    t = LoadTracker(["a", WorkerSpec(name="b", role=EngineRole.DECODE)])
    lease = t.acquire("a", prefill_tokens=100, decode_blocks=7, decode_worker="b")
    assert list(t.active_prefill_tokens) == [100, 0] and list(t.decode_blocks) == [0, 7] and list(t.inflight) == [1, 1]
    lease.prefill_done()
    assert list(t.active_prefill_tokens) == [0, 0] and list(t.decode_blocks) == [0, 7]
    lease.release()
    lease.release()  # idempotent
    assert list(t.decode_blocks) == [0, 0] and list(t.inflight) == [0, 0]
    with pytest.raises(RuntimeError), t.track(0, prefill_tokens=5, decode_blocks=1):
        assert t.active_prefill_tokens[0] == 5
        raise RuntimeError("upstream failed")
    assert t.active_prefill_tokens[0] == 0 and t.inflight[0] == 0  # released on failure
    with pytest.raises(ValueError, match="unknown worker"):
        t.acquire("zz", prefill_tokens=1, decode_blocks=1)
    with pytest.raises(ValueError, match="prefill_tokens"):
        t.acquire(0, prefill_tokens=-1, decode_blocks=1)
    with pytest.raises(ValueError):
        t.active_prefill_tokens[0] = 5  # read-only view
    with pytest.raises(ValueError, match="duplicate"):
        LoadTracker(["a", "a"])


def test_a_refused_acquire_changes_no_counter_and_counters_never_wrap():
    t = LoadTracker(["w0", "w1"])
    before = t.snapshot()
    # decode_blocks does not fit: refused before the prefill counter moves (no leaked load)
    with pytest.raises(ValueError, match="decode_blocks"):
        t.acquire("w0", prefill_tokens=1000, decode_blocks=2**63)
    # each value in int64, but two of them would wrap the counter negative: refused, per lease
    with pytest.raises(ValueError, match="prefill_tokens"):
        t.acquire("w0", prefill_tokens=2**62, decode_blocks=0)
    with pytest.raises(ValueError, match="decode_blocks"):
        t.acquire("w0", prefill_tokens=0, decode_blocks=True)
    assert t.snapshot() == before
    # a counter already near the int64 limit (a long-lived tracker): the sum is checked too
    from quillcache.routing.base import MAX_LEASE_LOAD

    t._prefill[1] = 2**63 - 10
    with pytest.raises(ValueError, match="would overflow worker 'w1'"):
        t.acquire("w1", prefill_tokens=MAX_LEASE_LOAD, decode_blocks=3)
    assert int(t.decode_blocks[1]) == 0 and int(t.inflight[1]) == 0
    lease = t.acquire("w0", prefill_tokens=MAX_LEASE_LOAD, decode_blocks=MAX_LEASE_LOAD)
    lease.release()
    assert t.snapshot()["w0"] == before["w0"]


@pytest.mark.parametrize("router", sorted(ROUTERS.names()))
@pytest.mark.parametrize("field, value, message", [
    ("overlaps", np.array([[1, 2], [0, 0], [0, 0]], dtype=object), "overlaps must have an integer dtype"),
    ("overlaps", np.array([["1", "2"], ["0", "0"], ["0", "0"]]), "overlaps must have an integer dtype"),
    ("overlaps", np.array([[np.nan, 1.0], [0, 0], [0, 0]]), "overlaps must have an integer dtype"),
    ("overlaps", np.array([[-5, 1], [0, 0], [0, 0]]), "overlaps must be >= 0"),
    ("active_prefill_tokens", np.array([np.nan, 0.0]), "active_prefill_tokens must be finite"),
    ("active_prefill_tokens", np.array([-1000, 0]), "active_prefill_tokens must be >= 0"),
    ("decode_blocks", np.array([None, 1], dtype=object), "decode_blocks must have an integer or float dtype"),
    ("decode_blocks", np.array([np.inf, 1.0]), "decode_blocks must be finite"),
])
def test_select_refuses_bad_route_dtypes_and_values_naming_the_field(router, field, value, message):
    cols = {"overlaps": np.zeros((3, 2), np.int64), "active_prefill_tokens": np.zeros(2, np.int64),
            "decode_blocks": np.zeros(2, np.int64), field: value}
    r = RouteRequest(cols["overlaps"], 64, 16, cols["active_prefill_tokens"], cols["decode_blocks"])
    with pytest.raises(ValueError, match=message):
        make_router(router, seed=0).select(r)
    rt = make_router(router, seed=0)
    if router != "round_robin":  # every router with a cost validates it too
        with pytest.raises(ValueError, match=message):
            rt.loads(r) if router == "cache_aware" else rt.logits(r)
    # float loads (finite, >= 0) and unsigned overlaps stay valid
    ok = RouteRequest(np.zeros((3, 2), np.uint32), 64, 16, np.array([0.0, 1.5]), np.array([2.0, 0.0]))
    assert make_router(router, seed=0).select(ok) in (0, 1)


@pytest.mark.parametrize("name", ["é" * 101, "gpu\x00a", "\ud800", "x" * 201])
def test_worker_names_follow_the_index_node_name_rule(name):
    with pytest.raises(ValueError, match="UTF-8 bytes without NUL"):
        WorkerSpec(name=name)
    with pytest.raises(ValueError, match="UTF-8 bytes without NUL"):
        LoadTracker(["w0", name])
    assert WorkerSpec(name="é" * 100).name == "é" * 100  # 200 bytes: the index takes it


def test_live_load_spreads_traffic_instead_of_dog_piling():
    """Every request has its 8-block prefix cached on worker 0; requests stay in flight."""
    def pile(router_name: str) -> list[int]:
        router = make_router(router_name, seed=5)
        loads = LoadTracker([f"w{i}" for i in range(4)])
        held, picks = [], []
        for _ in range(12):
            r = RouteRequest(np.array([[8, 0, 0, 0], [0] * 4, [0] * 4], dtype=np.int64), 8 * 16, 16,
                             loads.active_prefill_tokens, loads.decode_blocks)
            w = router.select(r)
            picks.append(w)
            held.append(loads.acquire(w, prefill_tokens=8 * 16, decode_blocks=8))
        for lease in held:
            lease.release()
        return picks

    dyn = pile("dynamo")
    assert dyn[0] == 0 and len(set(dyn)) == 4  # the load term spreads traffic
    assert set(pile("prefix_affinity")) == {0}  # pure affinity dog-piles the cache-hot worker


# ---------------------------------------------------------------- cache_aware (SGLang's rule on exact blocks)


def _ca_route(dev, apt, dec, isl=160, bs=16, eligible=None):
    import numpy as np
    from quillcache.routing import RouteRequest

    n = len(dev)
    ov = np.zeros((3, n), dtype=np.int64)
    ov[0] = dev
    return RouteRequest(overlaps=ov, isl_tokens=isl, block_size_tokens=bs,
                        active_prefill_tokens=np.asarray(apt, dtype=np.float64),
                        decode_blocks=np.asarray(dec, dtype=np.float64),
                        eligible=None if eligible is None else np.asarray(eligible, dtype=bool))


def test_cache_aware_stays_on_the_prefix_while_balanced_and_balances_past_both_thresholds():
    from quillcache.routing import make_router

    r = make_router("cache_aware", seed=0)
    # 10-block request; worker 1 holds 8 blocks and is busier, but by fewer than 64 request-equivalents
    assert r.select(_ca_route([0, 8, 0], [0, 0, 0], [10, 300, 20])) == 1
    # Dynamo's cost leaves the prefix for the idle worker on the same loads (the difference this router exists for)
    assert make_router("dynamo", seed=0).select(_ca_route([0, 8, 0], [0, 0, 0], [10, 300, 20])) == 0
    # imbalance > 64 request-equivalents (640 blocks) and > 1.5x: the least loaded wins despite the prefix
    assert r.select(_ca_route([0, 8, 0], [0, 0, 0], [700, 1000, 20])) == 2
    # past the absolute threshold but not the relative one: still the prefix
    assert r.select(_ca_route([0, 8, 0], [0, 0, 0], [1500, 2000, 1400])) == 1


def test_cache_aware_falls_back_to_least_loaded_below_the_match_threshold_and_respects_eligibility():
    from quillcache.routing import make_router

    r = make_router("cache_aware", seed=0)
    # best match 3 of 10 blocks = 0.3, not above the 0.3 threshold: least loaded
    assert r.select(_ca_route([0, 3, 0], [0, 0, 0], [5, 1, 9])) == 1
    assert r.select(_ca_route([0, 3, 0], [0, 0, 0], [5, 9, 1])) == 2
    # equal prefixes: the less loaded of them
    assert r.select(_ca_route([6, 6, 0], [0, 0, 0], [50, 40, 0])) == 1
    # the prefix holder is not eligible: the rule runs over the others
    assert r.select(_ca_route([0, 8, 5], [0, 0, 0], [0, 0, 30], eligible=[True, False, True])) == 2
    with pytest.raises(ValueError, match="cache_threshold"):
        make_router("cache_aware", cache_threshold=1.5)
