"""Conversation turns (``quillcache.hitrate.turns``): previous turns of hand-made traces (a
request that only ends on a shared prompt is nobody's previous turn), the gap ratios they give,
and the robust sigma."""

from __future__ import annotations

import math

import numpy as np

from quillcache.hitrate.arrays import arrays_from_lists
from quillcache.hitrate.turns import last_full_positions, previous_turns, robust_sigma, turn_gap_log_ratios


def test_previous_turns_and_gap_ratios_of_hand_made_traces():
    # dense ids s=0 a=1 b=2 tail=3 c=4 d=5 e=6; request 1 ends in a partial block (its last full
    # one is b); request 2 extends request 0 (which created a and ended on it), request 3 extends
    # request 2 (c); c comes back in request 3, d never does
    lists = [[0, 1], [0, 2, 9], [0, 1, 3], [0, 1, 3, 4], [0, 5]]
    arrs = arrays_from_lists(lists, input_tokens=[1024, 2 * 512 + 100, 1536, 2048, 1024])
    assert last_full_positions(arrs).tolist() == [1, 3, 7, 11, 13]
    assert previous_turns(arrs).tolist() == [-1, -1, 0, 2, -1]
    assert np.allclose(turn_gap_log_ratios(arrs), [math.log((3 - 2) / (2 - 0))])
    # request 1 only ends on the shared prompt s (created by request 0): not a previous turn of
    # request 2, which starts on s; request 3 extends request 2
    arrs = arrays_from_lists([[0, 1], [0], [0, 2], [0, 2, 3], [0, 2, 3, 4]], input_tokens=[1024, 512, 1024, 1536, 2048])
    assert previous_turns(arrs).tolist() == [-1, -1, -1, 2, 3]
    assert np.allclose(turn_gap_log_ratios(arrs), [math.log((4 - 3) / (3 - 2))])
    assert len(turn_gap_log_ratios(arrays_from_lists([[0, 1], [2, 3]]))) == 0


def test_robust_sigma_of_a_normal_sample_and_of_nothing():
    x = np.random.default_rng(3).normal(0.0, 1.7, 20000)
    assert abs(robust_sigma(x) - 1.7) < 0.05
    assert math.isnan(robust_sigma(np.array([])))
