"""Information bounds (``quillcache.hitrate.bounds``): the reuse oracle's kernel equals its
plain-Python specification hit for hit, it never admits a block without a future reference, a
noisy oracle inverts whole requests, and on the conversation trace knowing *which* blocks come
back (not when) is worth the whole LRU-to-Belady gap from 10k blocks up but not at 1k."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.hitrate import simulate
from quillcache.hitrate.arrays import arrays_from_lists
from quillcache.hitrate.bounds import flips, reuse_oracle, reuse_oracle_reference
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
