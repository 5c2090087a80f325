"""The cache_aware rule's branches (quillcache.routing.cache_aware): balanced prefix, imbalance (the best prefix
among the workers that are not overloaded, or SGLang's least-loaded), the low-match fallback (least loaded, or
the fewest resident blocks when asked), eligibility, options, and the gateway's wiring of residency counts and
whole-prompt speculation."""

from __future__ import annotations

import numpy as np
import pytest

from quillcache.routing import RouteRequest, make_router


def route(dev, dec, isl=160, bs=16, eligible=None, host=None):
    """Workers' device prefix (blocks) and decode blocks; a 10-block request (load = decode blocks / 10)."""
    n = len(dev)
    ov = np.zeros((3, n), dtype=np.int64)
    ov[0] = dev
    if host is not None:
        ov[1] = host
    return RouteRequest(overlaps=ov, isl_tokens=isl, block_size_tokens=bs,
                        active_prefill_tokens=np.zeros(n), decode_blocks=np.asarray(dec, dtype=np.float64),
                        eligible=None if eligible is None else np.asarray(eligible, dtype=bool))


# loads 100, 30, 2 request-equivalents: imbalanced (98 > 64 and 100 > 1.5 x 2); only worker 0 is overloaded
IMBALANCED = [1000, 300, 20]


def test_under_imbalance_the_best_prefix_among_the_workers_that_are_not_overloaded():
    r = make_router("cache_aware", seed=0)
    assert r.select(route([9, 6, 0], IMBALANCED)) == 1  # the overloaded holder of 9 blocks is out; 6 of 10 remain
    sglang = make_router("cache_aware", imbalance="least_loaded", seed=0)
    assert sglang.select(route([9, 6, 0], IMBALANCED)) == 2  # SGLang's rule: the least loaded, whatever it holds
    # the overloaded worker is never taken, however long its prefix
    assert r.select(route([10, 0, 0], IMBALANCED)) == 2
    # no candidate above the match threshold: the least loaded candidate
    assert r.select(route([9, 3, 1], IMBALANCED)) == 2
    # balanced again (below the absolute threshold): the longest prefix, on the busiest worker too
    assert r.select(route([9, 6, 0], [600, 300, 20])) == 0


def test_imbalance_respects_eligibility_and_host_tier_prefixes():
    r = make_router("cache_aware", seed=0)
    assert r.select(route([9, 6, 5], IMBALANCED, eligible=[True, False, True])) == 2
    # equal device prefixes: the host tier beyond them decides, then load
    assert r.select(route([0, 4, 4], IMBALANCED, host=[0, 0, 3])) == 2
    assert r.select(route([0, 4, 4], IMBALANCED, host=[0, 3, 0])) == 1


def test_low_match_fallback_least_loaded_by_default_and_most_free_when_asked():
    r = make_router("cache_aware", seed=0)
    r.resident_blocks = lambda: np.array([0, 500, 900])  # ignored unless low_match="most_free"
    assert r.select(route([0, 2, 0], [50, 40, 10])) == 2
    free = make_router("cache_aware", low_match="most_free", seed=0)
    assert free.select(route([0, 2, 0], [50, 40, 10])) == 2  # no residency source: least loaded
    free.resident_blocks = lambda: np.array([700, 500, 900])
    assert free.select(route([0, 2, 0], [50, 40, 10])) == 1  # the fewest resident blocks
    free.resident_blocks = lambda: np.array([500, 500, 900])
    assert free.select(route([0, 2, 0], [50, 40, 10])) == 1  # equal counts: the less loaded of them
    assert free.select(route([0, 2, 0], [50, 40, 10], eligible=[True, False, True])) == 0
    free.resident_blocks = lambda: np.array([1, 2])  # a source of the wrong shape is refused, naming it
    with pytest.raises(ValueError, match="resident_blocks"):
        free.select(route([0, 2, 0], [50, 40, 10]))
    # above the match threshold the prefix wins whatever the residency
    free.resident_blocks = lambda: np.array([0, 5000, 0])
    assert free.select(route([0, 8, 0], [0, 0, 0])) == 1


def test_options_are_checked_and_clone_keeps_them():
    with pytest.raises(ValueError, match="imbalance="):
        make_router("cache_aware", imbalance="random")
    with pytest.raises(ValueError, match="low_match="):
        make_router("cache_aware", low_match="smallest")
    r = make_router("cache_aware", cache_threshold=0.5, balance_abs_threshold=8.0, imbalance="least_loaded",
                    low_match="most_free", seed=1)
    c = r.clone(3)
    assert (c.cache_threshold, c.balance_abs_threshold, c.imbalance, c.low_match) == (0.5, 8.0, "least_loaded",
                                                                                        "most_free")
    assert c.rng is not r.rng


def _decider(router_options=None):
    from quillcache.gateway.decision import Decider
    from quillcache.gateway.residency import ResidencyTracker
    from quillcache.index import open_index

    index = open_index("flat")
    names = ["e0", "e1", "e2"]
    tr = ResidencyTracker(index, {w: "events" for w in names})
    return Decider(index, names, tr, block_size_tokens=4, seed=7, router="cache_aware",
                   router_options=router_options or {}), tr


def _ident(tenant):
    from quillcache.identity.scope import make_identity
    from quillcache.types import KvLayout

    return make_identity(model="m", tenant=tenant, layout=KvLayout(block_size_tokens=4))


def test_the_gateway_speculates_the_whole_prompt_and_feeds_residency_counts():
    from quillcache.gateway.residency import EntryState

    dec, tr = _decider({"low_match": "most_free"})
    tokens = list(range(1, 4 * 40 + 2))  # 40 full blocks
    d = dec.decide(_ident("a"), tokens, 0)
    assert tr.count(d.worker, EntryState.PENDING) == 40  # every block, not a capped prefix
    # the router reads the tracker's live entries per engine, in worker order
    counts = dec.planner.router.resident_blocks()
    assert list(counts) == [40 if n == d.worker else 0 for n in dec.names]
    # a low-match request of another tenant avoids the engine that holds the 40 blocks (most free cache)
    e = dec.decide(_ident("b"), list(range(500, 520)), 0)
    assert e.worker != d.worker
    # the same conversation's next turn finds its whole prompt on its engine before any event arrived
    f = dec.decide(_ident("a"), tokens + list(range(900, 920)), 0)
    assert f.worker == d.worker and f.cached_tokens == 40 * 4
    for x in (d, e, f):
        x.lease.release()
    tr.check()


def _reference_select(r, route):
    """The rule written with numpy arrays and ``pick_min`` (the router's per-request path is plain Python)."""
    from quillcache.routing.base import pick_min

    load = r.loads(route)
    elig = route.eligible
    live = load if elig is None else load[elig]
    lo, hi = float(live.min()), float(live.max())
    cand = elig
    if hi - lo > r.balance_abs_threshold and hi > r.balance_rel_threshold * lo:
        if r.imbalance == "least_loaded":
            return pick_min(load, elig, r.rng)
        over = (load - lo > r.balance_abs_threshold) & (load > r.balance_rel_threshold * lo)
        cand = ~over if elig is None else elig & ~over
    ov = route.overlaps.astype(np.float64)
    n_blocks = -(-route.isl_tokens // route.block_size_tokens)
    if np.where(cand if cand is not None else True, ov[0], -1.0).max() / n_blocks > r.cache_threshold:
        scale = float(ov.max()) + 1.0
        return pick_min(-(ov[0] * scale * scale + ov[1] * scale + ov[2]) * 1e6 + load, cand, r.rng)
    if r.resident_blocks is not None and r.low_match == "most_free":
        return pick_min(np.asarray(r.resident_blocks(), dtype=np.float64) * 1e6 + load, cand, r.rng)
    return pick_min(load, cand, r.rng)


@pytest.mark.parametrize("options", [{}, {"imbalance": "least_loaded"}, {"low_match": "most_free"},
                                     {"balance_abs_threshold": 2.0, "cache_threshold": 0.1}])
def test_the_plain_python_rule_equals_a_numpy_reference_on_random_routes(options):
    rng = np.random.default_rng(11)
    fast = make_router("cache_aware", seed=5, **options)
    ref = make_router("cache_aware", seed=5, **options)
    for case in range(400):
        n = int(rng.integers(1, 6))
        isl = int(rng.integers(1, 400))
        nb = -(-isl // 16)
        dev = rng.integers(0, nb + 1, n)
        ov = np.stack([dev, rng.integers(0, 3, n) * (rng.random(n) < 0.3), np.zeros(n, dtype=np.int64)])
        ov[1] = np.minimum(ov[1], nb - dev)  # a prefix overlap is never longer than the prompt (check_route)
        dec = rng.integers(0, 4, n) * rng.choice([1, 10, 300], n)
        apt = rng.integers(0, 3, n) * 160
        elig = rng.random(n) < 0.8
        if not elig.any():
            elig[int(rng.integers(0, n))] = True
        route = RouteRequest(overlaps=ov.astype(np.int64), isl_tokens=isl, block_size_tokens=16,
                             active_prefill_tokens=apt.astype(np.int64), decode_blocks=dec.astype(np.int64),
                             eligible=None if case % 5 == 0 else elig)
        resident = rng.integers(0, 3, n) * 100
        fast.resident_blocks = ref.resident_blocks = (lambda res=resident: res)
        assert fast.select(route) == _reference_select(ref, route), (case, options)
