"""Information bounds (``quillcache.hitrate.bounds``): the reuse oracle's kernel equals its
plain-Python specification hit for hit, it never admits a block without a future reference, a
noisy oracle inverts whole requests, and on the conversation trace knowing *which* blocks come
back (not when) is worth the whole LRU-to-Belady gap from 10k blocks up but not at 1k; the timing
oracle's keys equal their plain-Python specification, scale a whole request's next uses together,
and at ``sigma = 0`` make it Belady hit for hit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.hitrate import simulate
from quillcache.hitrate.arrays import arrays_from_lists
from quillcache.hitrate.bounds import (NEVER, flips, noisy_next_use, noisy_next_use_reference, reuse_oracle,
                                       reuse_oracle_reference, timing_factors, timing_oracle)
from tests.test_hitrate import conversation_traces


@given(arrs=conversation_traces(), cap=st.integers(1, 24), flip_rate=st.sampled_from([0.0, 0.2, 0.5, 1.0]),
       seed=st.integers(0, 3))
@settings(max_examples=200)
def test_kernel_agrees_with_the_reference(arrs, cap, flip_rate, seed):
    fast = reuse_oracle(arrs, cap, flip_rate, seed)
    assert np.array_equal(fast, reuse_oracle_reference(arrs, cap, flip_rate, seed)), (cap, flip_rate, seed)


@given(arrs=conversation_traces(), cap=st.integers(1, 24))
@settings(max_examples=100)
def test_an_exact_oracle_never_loses_to_lru_and_unlimited_room_gives_every_reuse(arrs, cap):
    ours = int(reuse_oracle(arrs, cap).sum())
    assert ours >= simulate(arrs, "lru", cap).hit_blocks  # LRU with dead blocks out of the way
    big = max(arrs.num_unique, 1)
    assert int(reuse_oracle(arrs, big).sum()) == simulate(arrs, "lru", None).hit_blocks


def test_hand_made_trace_dead_blocks_are_not_admitted_and_go_first():
    # requests: a b | c (never again) | a b d | a b d
    arrs = arrays_from_lists([[0, 1], [2], [0, 1, 3], [0, 1, 3]])
    # cap 2: LRU loses a and b to c. The oracle never admits c; at request 2, d is live and the dead
    # list is empty, so d evicts the least recent live block (a) and request 3 misses at once.
    assert reuse_oracle(arrs, 2).tolist() == [0, 0, 2, 0]
    assert simulate(arrs, "lru", 2).hits_per_request.tolist() == [0, 0, 0, 0]
    assert reuse_oracle(arrs, 3).tolist() == [0, 0, 2, 3]  # room for a b d: request 3 hits all three
    # a block whose last reference has passed moves to the dead list and is evicted before any
    # live block, however recent: requests a b | c | a b (their last) | d | c | d, cap 3
    arrs = arrays_from_lists([[0, 1], [2], [0, 1], [3], [2], [3]])
    assert reuse_oracle(arrs, 3).tolist() == [0, 0, 2, 0, 1, 1]  # d displaces dead a, c survives
    assert simulate(arrs, "lru", 3).hits_per_request.tolist() == [0, 0, 2, 0, 0, 1]  # d displaces c


def test_flips_are_seeded_whole_requests_and_checked():
    f = flips(1000, 0.25, 7)
    assert f.dtype == np.bool_ and np.array_equal(f, flips(1000, 0.25, 7)) and 150 < f.sum() < 350
    assert not flips(10, 0.0, 0).any() and flips(10, 1.0, 0).all()
    arrs = arrays_from_lists([[0, 1], [0, 1]])
    assert reuse_oracle(arrs, 4, 1.0).tolist() == [0, 0]  # every bit inverted: live blocks never admitted
    with pytest.raises(ValueError, match="flip_rate"):
        reuse_oracle(arrs, 4, 1.5)
    with pytest.raises(ValueError, match="capacity_blocks"):
        reuse_oracle(arrs, 0)
    with pytest.raises((TypeError, ValueError), match="seed"):
        reuse_oracle(arrs, 4, 0.1, -1)


def test_conversation_trace_the_gap_is_which_sessions_return(trace_path):
    from quillcache.hitrate.arrays import load_arrays

    arrs = load_arrays(trace_path)
    for cap, share in ((1000, (0.1, 0.3)), (10000, (0.999, 1.001))):
        lru, bel = simulate(arrs, "lru", cap).hit_rate, simulate(arrs, "belady", cap).hit_rate
        who = reuse_oracle(arrs, cap).sum() / arrs.num_refs
        assert share[0] <= (who - lru) / (bel - lru) <= share[1], (cap, lru, who, bel)


@given(arrs=conversation_traces(), sigma=st.sampled_from([0.0, 0.3, 1.0, 2.5]), seed=st.integers(0, 3))
@settings(max_examples=150)
def test_timing_keys_agree_with_the_reference_and_are_always_in_the_future(arrs, sigma, seed):
    keys = noisy_next_use(arrs, sigma, seed)
    assert keys.tolist() == noisy_next_use_reference(arrs, sigma, seed)
    n = arrs.num_refs
    pos = np.arange(n)
    assert np.array_equal(keys == NEVER, arrs.next_use >= n)  # exactly the blocks never referenced again
    assert (keys > pos).all()
    if sigma == 0.0:
        assert np.array_equal(keys[keys != NEVER], arrs.next_use[keys != NEVER])


@given(arrs=conversation_traces(), cap=st.integers(1, 24))
@settings(max_examples=100)
def test_an_exact_timing_oracle_is_belady(arrs, cap):
    assert np.array_equal(timing_oracle(arrs, cap, 0.0), simulate(arrs, "belady", cap).hits_per_request)


def test_timing_errors_stretch_a_whole_request_together_and_are_checked():
    # request 2 holds the next use of every block of requests 0 and 1: one factor stretches them all
    arrs = arrays_from_lists([[0, 1], [0, 1, 2], [0, 1, 2, 3]])
    f = timing_factors(arrs.num_requests, 1.0, 5)
    assert np.array_equal(f, timing_factors(3, 1.0, 5)) and not np.allclose(f, 1.0)
    keys = noisy_next_use(arrs, 1.0, 5)
    nu = arrs.next_use
    for p in range(2, 5):  # request 1's references: next uses at positions 5, 6, 7 of request 2
        assert keys[p] == p + max(1, round((nu[p] - p) * f[2]))
    assert (keys[5:] == NEVER).all()
    with pytest.raises(ValueError, match="sigma"):
        timing_oracle(arrs, 2, -0.5)
    with pytest.raises(ValueError, match="capacity_blocks"):
        timing_oracle(arrs, 0, 1.0)
    with pytest.raises((TypeError, ValueError), match="seed"):
        noisy_next_use(arrs, 1.0, -1)


def test_conversation_trace_knowing_which_is_most_of_the_gap_when_is_the_rest(trace_path):
    from quillcache.hitrate.arrays import load_arrays

    arrs = load_arrays(trace_path)
    for cap, share in ((1000, (0.5, 0.9)), (10000, (0.999, 1.001))):
        lru, bel = simulate(arrs, "lru", cap).hit_rate, simulate(arrs, "belady", cap).hit_rate
        late = timing_oracle(arrs, cap, 1.5).sum() / arrs.num_refs  # when, wrong by e**1.5 at one sigma
        assert share[0] <= (late - lru) / (bel - lru) <= share[1], (cap, lru, late, bel)
