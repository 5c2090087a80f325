"""SIEVE's spared evictions (``quillcache.hitrate.spared``): a hand-worked trace, SIEVE's hits equal
its kernel's, and the invariant that SIEVE and in-cache LFU agree on every request up to the first
eviction of a spared block, checked on random traces and on prefix-chained ones."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.hitrate import simulate
from quillcache.hitrate.arrays import arrays_from_lists
from quillcache.hitrate.spared import sieve_spared_evictions


def test_a_lap_of_the_hand_evicts_a_spared_block_and_lfu_keeps_it():
    # cap 2: 0 and 1 in; 0 hit twice; 2 evicts 1 (never hit); at 3 the hand has cleared 0's bit and
    # comes back to it: 0 is evicted although it was hit. LFU keeps 0 (frequency 3), so the last
    # request hits under LFU and misses under SIEVE.
    arrs = arrays_from_lists([[0], [1], [0], [0], [2], [3], [4], [5], [0]])
    got = sieve_spared_evictions(arrs, 2)
    assert (got.evictions, got.spared, got.first_spared_request) == (5, 1, 5)
    assert got.spared_share == pytest.approx(1 / 5)
    assert got.hits_per_request.tolist() == [0, 0, 1, 1, 0, 0, 0, 0, 0]
    assert got.spared_resident == 0 and np.isnan(got.spared_idle_median_requests)
    assert simulate(arrs, "lfu", 2).hits_per_request.tolist() == [0, 0, 1, 1, 0, 0, 0, 0, 1]


def test_a_conversation_that_keeps_coming_back_is_never_a_spared_victim():
    # one conversation extends its chain every other request; one-off requests in between
    lists, chain = [], []
    for t in range(30):
        chain = chain + [1000 + t]
        lists.append(list(chain))
        lists.append([t])
    arrs = arrays_from_lists(lists)
    got = sieve_spared_evictions(arrs, 40)
    assert got.evictions > 0 and got.spared == 0 and got.first_spared_request == -1
    # every chain block but the newest was hit by the next turn; the last hit of each was the last turn (request 58)
    assert got.spared_resident == 29 and got.spared_idle_median_requests == 1.0
    assert np.array_equal(got.hits_per_request, simulate(arrs, "lfu", 40).hits_per_request)


@st.composite
def random_traces(draw):
    n = draw(st.integers(1, 40))
    return arrays_from_lists([draw(st.lists(st.integers(0, 25), min_size=1, max_size=6)) for _ in range(n)])


@st.composite
def chained_traces(draw):
    """Conversations that extend their own chain, a shared prompt, one-off requests."""
    n_conv = draw(st.integers(1, 5))
    chains = [[] for _ in range(n_conv)]
    lists, fresh = [], 10_000
    for _ in range(draw(st.integers(1, 40))):
        c = draw(st.integers(-1, n_conv - 1))
        prompt = [0, 1] if draw(st.booleans()) else []
        if c < 0:
            lists.append(prompt + [fresh])
            fresh += 1
            continue
        new = draw(st.integers(1, 3))
        chains[c] = chains[c] + list(range(fresh, fresh + new))
        fresh += new
        lists.append(prompt + chains[c])
    return arrays_from_lists(lists)


def _agree_until_the_first_spared_eviction(arrs, cap):
    got = sieve_spared_evictions(arrs, cap)
    sieve = simulate(arrs, "sieve", cap).hits_per_request
    lfu = simulate(arrs, "lfu", cap).hits_per_request
    assert np.array_equal(got.hits_per_request, sieve)
    upto = arrs.num_requests if got.first_spared_request < 0 else got.first_spared_request + 1
    assert np.array_equal(sieve[:upto], lfu[:upto])
    assert (got.spared == 0) == (got.first_spared_request < 0) and 0 <= got.spared <= got.evictions


@settings(max_examples=200, deadline=None)
@given(random_traces(), st.integers(1, 12))
def test_sieve_is_lfu_until_it_evicts_a_spared_block_random(arrs, cap):
    _agree_until_the_first_spared_eviction(arrs, cap)


@settings(max_examples=200, deadline=None)
@given(chained_traces(), st.integers(1, 30))
def test_sieve_is_lfu_until_it_evicts_a_spared_block_chained(arrs, cap):
    _agree_until_the_first_spared_eviction(arrs, cap)


@pytest.mark.parametrize("cap", [0, -1, 2.5, "3"])
def test_a_bad_capacity_is_refused_by_name(cap):
    with pytest.raises((ValueError, TypeError), match="capacity_blocks"):
        sieve_spared_evictions(arrays_from_lists([[0]]), cap)
