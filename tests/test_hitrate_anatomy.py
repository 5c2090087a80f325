"""Anatomy of two policies' hits (``quillcache.hitrate.anatomy``): the cells of a hand-made trace,
the vectorised version against the one-reference-at-a-time specification on random traces and
hit counts, and bad hit counts refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.hitrate import simulate
from quillcache.hitrate.anatomy import anatomy, anatomy_reference, hit_mask
from quillcache.hitrate.arrays import arrays_from_lists


def test_cells_of_a_hand_made_trace():
    # block 0 is a prompt used by every request; 1 comes back after 2 requests; 2, 3, 4, 5 are used once
    arrs = arrays_from_lists([[0, 1], [0, 2], [0, 3], [0, 1, 4], [0, 5]])
    a = np.array([0, 1, 1, 2, 1])  # hits the prompt every time after the first, and block 1 when it comes back
    b = np.array([0, 1, 1, 1, 0])  # hits the prompt three times only
    assert hit_mask(arrs, a).tolist() == [False, False, True, False, True, False, True, True, False, True, False]
    cells = {(c.uses, c.previous_use): c for c in anatomy(arrs, a, b)}
    assert set(cells) == {("4-7", "first"), ("4-7", "1-9"), ("2", "first"), ("2", "1-9"), ("1", "first")}
    prompt_first, prompt_again = cells[("4-7", "first")], cells[("4-7", "1-9")]
    assert (prompt_first.references, prompt_first.a_hits, prompt_first.b_hits) == (1, 0, 0)
    assert (prompt_again.references, prompt_again.a_hits, prompt_again.b_hits) == (4, 4, 3)
    assert (prompt_again.a_only, prompt_again.b_only) == (1, 0)
    back = cells[("2", "1-9")]
    assert (back.references, back.a_only, back.b_only) == (1, 1, 0)
    assert cells[("1", "first")].references == 4
    assert cells[("2", "first")].references == 1
    assert sum(c.references for c in cells.values()) == arrs.num_refs


def test_previous_use_buckets_and_a_block_twice_in_one_request():
    lists = [[7]] + [[100 + i] for i in range(12)] + [[7, 8, 7]]
    arrs = arrays_from_lists(lists)
    zeros = np.zeros(arrs.num_requests, np.int64)
    cells = {(c.uses, c.previous_use): c.references for c in anatomy(arrs, zeros, zeros)}
    assert cells[("3", "first")] == 1 and cells[("3", "10-99")] == 1 and cells[("3", "same")] == 1


@st.composite
def traces_and_hits(draw):
    n = draw(st.integers(1, 25))
    lists = [draw(st.lists(st.integers(0, 30), min_size=1, max_size=6)) for _ in range(n)]
    arrs = arrays_from_lists(lists)
    lengths = np.diff(arrs.req_offsets)
    a = np.array([draw(st.integers(0, int(k))) for k in lengths])
    b = np.array([draw(st.integers(0, int(k))) for k in lengths])
    return arrs, a, b


@settings(max_examples=150, deadline=None)
@given(traces_and_hits())
def test_vectorised_anatomy_agrees_with_the_specification(case):
    arrs, a, b = case
    cells = anatomy(arrs, a, b)
    assert cells == anatomy_reference(arrs, a, b)
    assert sum(c.references for c in cells) == arrs.num_refs
    assert sum(c.a_only - c.b_only for c in cells) == int(a.sum() - b.sum())


def test_two_real_runs_differ_by_exactly_their_cells():
    lists = [[0, 1, i] for i in range(2, 40)] + [[0, 1, i, 50 + i] for i in range(2, 40, 3)]
    arrs = arrays_from_lists(lists)
    ra, rb = simulate(arrs, "lru", 8), simulate(arrs, "sieve", 8)
    cells = anatomy(arrs, ra.hits_per_request, rb.hits_per_request)
    assert sum(c.a_hits for c in cells) == ra.hit_blocks
    assert sum(c.b_hits for c in cells) == rb.hit_blocks


def test_hit_counts_that_are_not_prefix_hits_are_refused_by_name():
    arrs = arrays_from_lists([[0, 1], [0, 2]])
    with pytest.raises(ValueError, match="one hit count per request"):
        anatomy(arrs, np.zeros(3), np.zeros(2))
    with pytest.raises(ValueError, match=r"hits_per_request\[1\] = 3"):
        hit_mask(arrs, np.array([0, 3]))
    with pytest.raises(ValueError, match=r"hits_b\[0\] = -1"):
        anatomy_reference(arrs, np.zeros(2), np.array([-1, 0]))
