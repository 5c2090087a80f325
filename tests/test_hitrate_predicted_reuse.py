"""LRU driven by a per-request reuse prediction (``quillcache.hitrate.predicted_reuse``): the
kernel equals its plain-Python specification hit for hit, every bit set is LRU, predicted-dead
blocks are admitted but evicted first and keep their list when touched, and bad bits are refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.hitrate import simulate
from quillcache.hitrate.arrays import arrays_from_lists
from quillcache.hitrate.predicted_reuse import predicted_reuse_lru, predicted_reuse_lru_reference
from tests.test_hitrate import conversation_traces


@given(arrs=conversation_traces(), cap=st.integers(1, 24), data=st.data())
@settings(max_examples=200)
def test_kernel_agrees_with_the_reference(arrs, cap, data):
    bits = np.array(data.draw(st.lists(st.booleans(), min_size=arrs.num_requests, max_size=arrs.num_requests)),
                    np.bool_)
    fast = predicted_reuse_lru(arrs, cap, bits)
    assert fast.tolist() == predicted_reuse_lru_reference(arrs, cap, bits), (cap, bits.tolist())


@given(arrs=conversation_traces(), cap=st.integers(1, 24))
@settings(max_examples=100)
def test_every_bit_set_is_lru(arrs, cap):
    ones = np.ones(arrs.num_requests, np.bool_)
    assert np.array_equal(predicted_reuse_lru(arrs, cap, ones), simulate(arrs, "lru", cap).hits_per_request)
    # every bit clear is LRU too: one list, the same order
    assert np.array_equal(predicted_reuse_lru(arrs, cap, ~ones), simulate(arrs, "lru", cap).hits_per_request)


def test_hand_made_trace_dead_blocks_go_first_and_keep_their_list():
    # requests: a b (live) | c (dead) | d (live) | a b | c, cap 3
    arrs = arrays_from_lists([[0, 1], [2], [3], [0, 1], [2]])
    bits = np.array([True, False, True, True, True])
    # d evicts dead c, not the older live a: request 3 hits a b; c was evicted, so request 4 misses
    assert predicted_reuse_lru(arrs, 3, bits).tolist() == [0, 0, 0, 2, 0]
    assert simulate(arrs, "lru", 3).hits_per_request.tolist() == [0, 0, 0, 0, 0]  # LRU loses a to d
    # a block keeps the prediction it entered with: a (dead) | b (live) | a (a live request touches
    # a: still dead) | c | b, cap 2: c evicts a, the dead one, though b is older, so b hits at the end
    arrs = arrays_from_lists([[0], [1], [0], [2], [1]])
    assert predicted_reuse_lru(arrs, 2, np.array([False, True, True, True, True])).tolist() == [0, 0, 1, 0, 1]
    assert simulate(arrs, "lru", 2).hits_per_request.tolist() == [0, 0, 1, 0, 0]  # LRU evicts b


def test_bad_bits_are_refused():
    arrs = arrays_from_lists([[0, 1], [0, 1]])
    with pytest.raises(TypeError, match="bool"):
        predicted_reuse_lru(arrs, 2, np.array([1, 1]))
    with pytest.raises(ValueError, match="one bit per request"):
        predicted_reuse_lru(arrs, 2, np.array([True]))
    with pytest.raises(ValueError, match="capacity_blocks"):
        predicted_reuse_lru(arrs, 0, np.array([True, True]))
