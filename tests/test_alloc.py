"""Tests of the offset allocator: compiled (``OffsetAllocator``) vs reference (``PyOffsetAllocator``)
vs a trivial model (dict handle -> (offset, size)), plus exact-offset, merge, bin-mapping, error and
batch tests. Both implementations must take identical decisions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, event, given, note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from quillcache.alloc import _contract as api
from quillcache.alloc import reference as ref
from quillcache.alloc import (
    Allocation,
    AllocatorError,
    AllocatorTypeError,
    InvalidHandleError,
    OffsetAllocator,
    OutOfSpaceError,
    PyOffsetAllocator,
    float_to_uint,
    uint_to_float_round_down,
    uint_to_float_round_up,
)

IMPLS = [OffsetAllocator, PyOffsetAllocator]
u32 = st.integers(0, 2**32 - 1)


def both(*args, **kwargs):
    return OffsetAllocator(*args, **kwargs), PyOffsetAllocator(*args, **kwargs)


def check_tiling(regions, capacity):
    """Regions tile [0, capacity) in address order; no two free regions are adjacent."""
    pos = 0
    prev_free = False
    for off, size, is_free in regions:
        assert off == pos and size > 0
        assert not (prev_free and is_free), f"adjacent free regions at {off}: {regions}"
        pos += size
        prev_free = is_free
    assert pos == capacity


# ---------------------------------------------------------------- bin mapping

def test_bin_mapping_exhaustive_small_sizes():
    for s in range(0, 70_000):
        up, down = uint_to_float_round_up(s), uint_to_float_round_down(s)
        assert up == ref.uint_to_float_round_up(s) and down == ref.uint_to_float_round_down(s)
        assert float_to_uint(down) <= s <= float_to_uint(up)


@given(u32)
def test_bin_mapping_matches_reference(s):
    up, down = uint_to_float_round_up(s), uint_to_float_round_down(s)
    assert up == ref.uint_to_float_round_up(s)
    assert down == ref.uint_to_float_round_down(s)
    assert up <= 240 and down <= up <= down + 1
    assert float_to_uint(down) <= s < ref.float_to_uint(down + 1)  # s lies in its round-down bin
    assert ref.float_to_uint(up - 1) < s <= float_to_uint(up) if up > 0 else s == 0
    assert (up == down) == (float_to_uint(down) == s)


def test_bin_round_trip_and_monotone():
    bounds = [float_to_uint(b) for b in range(241)]
    assert bounds == [ref.float_to_uint(b) for b in range(241)]
    assert bounds == sorted(set(bounds)), "bin lower bounds strictly increase"
    for b, v in enumerate(bounds):
        assert uint_to_float_round_down(min(v, 2**32 - 1)) == b or v > 2**32 - 1
        assert uint_to_float_round_up(min(v, 2**32 - 1)) == b or v > 2**32 - 1
    assert float_to_uint(255) == ref.float_to_uint(255)


@given(u32.filter(lambda s: s > 0))
def test_waste_at_most_one_eighth(s):
    """The search bound of a request exceeds it by at most 12.5%."""
    bound = float_to_uint(uint_to_float_round_up(s))
    assert s <= bound and 8 * (bound - s) <= s


@pytest.mark.parametrize("cls", IMPLS)
@given(size=st.integers(1, 2**31))
def test_request_fits_a_region_of_its_search_bound(cls, size):
    """A free region of float_to_uint(round_up(size)) units always satisfies ``size``, with no
    internal waste (the allocation is exactly ``size``; the rest stays free)."""
    bound = float_to_uint(uint_to_float_round_up(size))
    a = cls(bound + 3, 4)
    a.allocate(3)  # leaves exactly one region of `bound` units at offset 3
    got = a.allocate(size)
    assert (got.offset, got.size) == (3, size)
    assert a.storage_report().total_free_bytes == bound - size


@pytest.mark.parametrize("bad", [-1, 256, 2.5, "x", True, None])
def test_float_to_uint_refuses_bad_bins(bad):
    with pytest.raises(AllocatorError, match="float_value"):
        float_to_uint(bad)


@pytest.mark.parametrize("bad", [-1, 2**32, 1.0, "7"])
def test_uint_to_float_refuses_bad_sizes(bad):
    with pytest.raises(AllocatorError, match="size"):
        uint_to_float_round_up(bad)
    with pytest.raises(AllocatorError, match="size"):
        uint_to_float_round_down(bad)


# ---------------------------------------------------------------- exact offsets and merges

@pytest.mark.parametrize("cls", IMPLS)
def test_scripted_sequence_exact_offsets(cls):
    a = cls(1024, 32)
    x = a.allocate(100)
    y = a.allocate(200)
    z = a.allocate(50)
    assert (x.offset, y.offset, z.offset) == (0, 100, 300)
    a.free(y)
    # 150 searches from bin 42 (160 B); the 200 B hole sits in bin 44, the tail (674 B) in bin 58:
    # the lowest fitting bin wins, so the hole is reused and its 50 B remainder stays free.
    d = a.allocate(150)
    assert d.offset == 100
    # 60 searches from bin 31; the 50 B hole (bin 28) cannot serve it -> the tail.
    e = a.allocate(60)
    assert e.offset == 350
    f = a.allocate(48)  # bin 28 exactly: the 50 B hole, leaving 2 B
    assert f.offset == 250
    assert a.regions() == [(0, 100, False), (100, 150, False), (250, 48, False), (298, 2, True),
                           (300, 50, False), (350, 60, False), (410, 614, True)]
    a.free(z)  # merges with the 2 B hole on its left
    assert a.regions()[3:5] == [(298, 52, True), (350, 60, False)]
    for h in (x, d, e, f):
        a.free(h.handle)
    assert a.regions() == [(0, 1024, True)]
    rep = a.storage_report()
    assert (rep.total_free_bytes, rep.largest_free_region_bytes, rep.num_live_allocations) == (1024, 1024, 0)


def _four_blocks(cls):
    a = cls(1000, 16)
    blocks = [a.allocate(s) for s in (100, 100, 100, 700)]
    assert [b.offset for b in blocks] == [0, 100, 200, 300]
    assert a.storage_report().total_free_bytes == 0
    return a, blocks


@pytest.mark.parametrize("cls", IMPLS)
def test_last_block_uses_round_down_bin_fallback(cls):
    """700 units search from bin 59 (704); the only region (700) sits in bin 58; the O(1)
    fallback takes it, so a fresh allocator hands out its whole capacity."""
    a = cls(1000, 16)
    a.allocate(300)
    assert a.allocate(700).offset == 300
    b = cls(1001, 4)
    assert b.allocate(1001).offset == 0


@pytest.mark.parametrize("cls", IMPLS)
def test_merge_with_right_neighbour(cls):
    a, (b0, b1, b2, b3) = _four_blocks(cls)
    a.free(b1)
    a.free(b0)
    assert a.regions()[:2] == [(0, 200, True), (200, 100, False)]
    assert a.storage_report().num_free_regions == 1


@pytest.mark.parametrize("cls", IMPLS)
def test_merge_with_left_neighbour(cls):
    a, (b0, b1, b2, b3) = _four_blocks(cls)
    a.free(b1)
    a.free(b2)
    assert a.regions() == [(0, 100, False), (100, 200, True), (300, 700, False)]


@pytest.mark.parametrize("cls", IMPLS)
def test_merge_with_both_neighbours(cls):
    a, (b0, b1, b2, b3) = _four_blocks(cls)
    a.free(b0)
    a.free(b2)
    assert a.storage_report().num_free_regions == 2
    a.free(b1)
    assert a.regions() == [(0, 300, True), (300, 700, False)]
    a.free(b3)
    assert a.regions() == [(0, 1000, True)]
    assert a.storage_report().largest_free_region_bytes == 1000


@pytest.mark.parametrize("cls", IMPLS)
def test_alignment_rounds_sizes_and_offsets(cls):
    a = cls(4096, 16, alignment=64)
    x, y = a.allocate(1), a.allocate(65)
    assert (x.offset, x.size, y.offset, y.size) == (0, 64, 64, 128)
    assert a.allocation_size(y.handle) == 128
    assert a.storage_report().total_free_bytes == 4096 - 192
    assert a.alignment == 64 and a.capacity_bytes == 4096
    with pytest.raises(AllocatorError, match="size_bytes=4097"):
        a.allocate(4097)


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("cls", IMPLS)
@pytest.mark.parametrize("size, exc, text", [
    (0, AllocatorError, "size_bytes=0"), (-1, AllocatorError, "size_bytes=-1"),
    (1001, AllocatorError, "size_bytes=1001"), (2**70, AllocatorError, str(2**70)),
    (2.5, AllocatorTypeError, "2.5"), ("x", AllocatorTypeError, "'x'"), (True, AllocatorTypeError, "bool"),
    (None, AllocatorTypeError, "None"),
])
def test_bad_sizes_refused(cls, size, exc, text):
    a = cls(1000, 8)
    with pytest.raises(exc, match=text):
        a.allocate(size)
    assert isinstance(exc("m"), ValueError)
    assert a.regions() == [(0, 1000, True)]


def test_type_error_is_also_type_error():
    with pytest.raises(TypeError):
        OffsetAllocator(1000, 8).allocate(2.5)


@pytest.mark.parametrize("cls", IMPLS)
@pytest.mark.parametrize("kwargs, text", [
    (dict(capacity_bytes=0, max_allocs=4), "capacity_bytes=0"),
    (dict(capacity_bytes=-5, max_allocs=4), "capacity_bytes=-5"),
    (dict(capacity_bytes=100, max_allocs=0), "max_allocs=0"),
    (dict(capacity_bytes=100, max_allocs=-1), "max_allocs=-1"),
    (dict(capacity_bytes=100, max_allocs=2**28 + 1), "max_allocs"),
    (dict(capacity_bytes=96, max_allocs=4, alignment=3), "alignment=3"),
    (dict(capacity_bytes=96, max_allocs=4, alignment=0), "alignment=0"),
    (dict(capacity_bytes=100, max_allocs=4, alignment=8), "not a multiple of alignment=8"),
    (dict(capacity_bytes=2**32, max_allocs=4), "at most 4294967295 units"),
    (dict(capacity_bytes=2**40, max_allocs=4, alignment=16), "raise the alignment"),
    (dict(capacity_bytes=1.5, max_allocs=4), "capacity_bytes must be an integer"),
    (dict(capacity_bytes=100, max_allocs="4"), "max_allocs must be an integer"),
])
def test_bad_config_refused(cls, kwargs, text):
    kwargs = dict(kwargs)
    with pytest.raises(AllocatorError, match=text):
        cls(kwargs.pop("capacity_bytes"), kwargs.pop("max_allocs"), **kwargs)


@pytest.mark.parametrize("cls", IMPLS)
def test_largest_capacity_accepted(cls):
    a = cls(2**32 - 1, 4)
    assert a.allocate(2**32 - 1).size == 2**32 - 1
    b = cls((2**32 - 1) * 4096, 4, alignment=4096)
    assert b.allocate(b.capacity_bytes - 4096).offset == 0


@pytest.mark.parametrize("cls", IMPLS)
def test_out_of_space_names_the_numbers(cls):
    a = cls(1000, 16)
    a.allocate(600)
    with pytest.raises(OutOfSpaceError, match="cannot allocate 500 bytes.*free 400 bytes, largest free region 400") as ei:
        a.allocate(500)
    e = ei.value
    assert (e.requested_bytes, e.free_bytes, e.largest_free_region_bytes, e.reason) == (500, 400, 400, api.NO_SPACE)


@pytest.mark.parametrize("cls", IMPLS)
def test_node_pool_exhaustion(cls):
    a = cls(100, 3)
    a.allocate(10)
    a.allocate(10)  # nodes: 2 live + the tail region
    with pytest.raises(OutOfSpaceError, match="node pool exhausted") as ei:
        a.allocate(10)  # would need a node for the remainder
    assert ei.value.reason == api.NO_NODES
    assert a.storage_report().num_free_nodes == 0
    assert a.allocate(80).offset == 20  # an exact fit needs no new node
    one = cls(50, 1)
    assert one.allocate(50).size == 50  # a single-node pool still serves an exact fit
    with pytest.raises(OutOfSpaceError):
        one.allocate(1)


@pytest.mark.parametrize("cls", IMPLS)
def test_double_free_stale_and_reset(cls):
    a = cls(1000, 8)
    x = a.allocate(10)
    a.free(x.handle)
    with pytest.raises(InvalidHandleError, match=f"{x.handle:#x}.*not live"):
        a.free(x.handle)
    y = a.allocate(10)  # reuses the same node with a new generation
    assert y.handle & api.INDEX_MASK == x.handle & api.INDEX_MASK and y.handle != x.handle
    with pytest.raises(InvalidHandleError):
        a.free(x.handle)
    with pytest.raises(InvalidHandleError):
        a.allocation_size(x.handle)
    assert a.allocation_size(y) == 10  # an Allocation is accepted where a handle is
    a.reset()
    with pytest.raises(InvalidHandleError):
        a.free(y.handle)
    assert a.regions() == [(0, 1000, True)] and a.num_live_allocations == 0


@pytest.mark.parametrize("cls", IMPLS)
@pytest.mark.parametrize("other_cls", IMPLS)
def test_foreign_handle_refused(cls, other_cls):
    a, b = cls(1000, 8), other_cls(1000, 8)
    ha, hb = a.allocate(10).handle, b.allocate(10).handle
    assert ha & ((1 << api.TAG_SHIFT) - 1) == hb & ((1 << api.TAG_SHIFT) - 1)  # same node, same gen
    with pytest.raises(InvalidHandleError, match="not issued by this allocator"):
        a.free(hb)
    a.free(ha)
    b.free(hb)


@pytest.mark.parametrize("cls", IMPLS)
@pytest.mark.parametrize("garbage", [-1, 0, 2**63, 2**64 + 5, 2.0, "7", None, b"x", True, [1]])
def test_garbage_handles_refused(cls, garbage):
    a = cls(1000, 8)
    a.allocate(10)
    with pytest.raises(InvalidHandleError):
        a.free(garbage)
    with pytest.raises(InvalidHandleError):
        a.allocation_size(garbage)
    assert a.num_live_allocations == 1


@pytest.mark.parametrize("cls", IMPLS)
@given(h=st.integers(-(2**70), 2**70))
def test_random_integers_never_crash(cls, h):
    a = cls(1000, 4)
    live = a.allocate(10).handle
    assume(h != live and h & (2**63 - 1) != live)
    with pytest.raises(InvalidHandleError):
        a.free(h)
    with pytest.raises(InvalidHandleError):
        a.allocation_size(h)
    with pytest.raises(InvalidHandleError):
        a.free_batch(np.array([live, h & (2**63 - 1)], dtype=np.int64))
    assert a.num_live_allocations == 1
    a.free(live)


@pytest.mark.parametrize("cls", IMPLS)
def test_out_of_range_node_index_refused(cls):
    a = cls(1000, 4)
    h = a.allocate(10).handle
    forged = (h & ~api.INDEX_MASK) | 3000
    with pytest.raises(InvalidHandleError, match="outside this allocator's node pool"):
        a.free(forged)


# ---------------------------------------------------------------- batches and churn

@pytest.mark.parametrize("cls", IMPLS)
def test_allocate_batch_matches_singles(cls):
    a, b = cls(10_000, 64), cls(10_000, 64)
    sizes = [5, 17, 300, 1, 64, 1000]
    offs, hs = a.allocate_batch(np.array(sizes, dtype=np.uint16))
    assert offs.dtype == np.int64 and hs.dtype == np.int64
    assert offs.tolist() == [b.allocate(s).offset for s in sizes]
    assert [a.allocation_size(int(h)) for h in hs] == sizes
    e_off, e_h = a.allocate_batch([])
    assert e_off.size == 0 and e_h.size == 0


@pytest.mark.parametrize("cls", IMPLS)
def test_allocate_batch_rolls_back(cls):
    a = cls(1000, 16)
    keep = a.allocate(100)
    before = a.regions()
    with pytest.raises(OutOfSpaceError, match=r"sizes\[2\] of 4; 2 rolled back"):
        a.allocate_batch(np.array([300, 300, 400, 10]))
    assert a.regions() == before and a.num_live_allocations == 1
    a.free(keep)
    assert a.regions() == [(0, 1000, True)]


@pytest.mark.parametrize("cls", IMPLS)
@pytest.mark.parametrize("sizes, exc", [
    (np.array([1.0, 2.0]), AllocatorTypeError), (np.array([[1, 2]]), AllocatorError),
    (np.array([5, 0]), AllocatorError), (np.array([5, -3], dtype=np.int8), AllocatorError),
    (np.array([2**64 - 1], dtype=np.uint64), AllocatorError), (["a"], AllocatorTypeError),
])
def test_allocate_batch_bad_input(cls, sizes, exc):
    a = cls(1000, 16)
    with pytest.raises(exc):
        a.allocate_batch(sizes)
    assert a.regions() == [(0, 1000, True)]


@pytest.mark.parametrize("cls", IMPLS)
def test_free_batch_validates_everything_first(cls):
    a = cls(1000, 16)
    _, hs = a.allocate_batch([10, 20, 30, 40])
    stale = a.allocate(5).handle
    a.free(stale)
    before = a.regions()
    for bad, text in [([hs[0], stale, hs[1]], r"handles\[1\].*not live"),
                      ([hs[0], hs[1], hs[0]], r"handles\[2\].*more than once"),
                      ([hs[2], -5], r"handles\[1\]"),
                      (np.array([hs[0], 2**63], dtype=np.uint64), r"handles\[1\]")]:
        with pytest.raises(InvalidHandleError, match=text):
            a.free_batch(bad)
        assert a.regions() == before and a.num_live_allocations == 4
    with pytest.raises(InvalidHandleError):
        a.free_batch(np.array([1.5]))
    a.free_batch(hs[::-1].astype(np.uint64))
    assert a.regions() == [(0, 1000, True)]


@pytest.mark.parametrize("cls", IMPLS)
def test_free_batch_takes_allocations_as_their_handles(cls):
    a = cls(1000, 16)
    first, second, third = a.allocate(10), a.allocate(20), a.allocate(30)
    a.free_batch([first, second.handle])  # an Allocation stands for its handle, mixed with plain handles
    assert a.num_live_allocations == 1
    a.free_batch((third,))
    assert a.regions() == [(0, 1000, True)]


def test_churn_identical_in_both_and_deterministic():
    fast, slow = both(1 << 20, 4096, alignment=16)
    rng = np.random.default_rng(5)
    sizes = rng.integers(16, 2048, 300)
    for a in (fast, slow):
        a.allocate_batch(sizes)
        assert a.churn(0, 16, 2048, 1) >= 0
        assert a.churn(2000, 16, 2048, seed=99) > 0
    assert fast.regions() == slow.regions()
    assert fast.storage_report() == slow.storage_report()
    check_tiling(fast.regions(), 1 << 20)
    assert fast.num_live_allocations == 300


@pytest.mark.parametrize("cls", IMPLS)
def test_churn_errors(cls):
    a = cls(1000, 16)
    with pytest.raises(AllocatorError, match="at least one live allocation"):
        a.churn(5, 1, 10, 0)
    a.allocate(10)
    with pytest.raises(AllocatorError, match="min_size=20 exceeds max_size=10"):
        a.churn(5, 20, 10, 0)
    with pytest.raises(AllocatorError, match="seed"):
        a.churn(5, 1, 10, -1)
    a.allocate(985)
    with pytest.raises(OutOfSpaceError, match="churn pair"):
        a.churn(100, 900, 1000, 3)  # only ~15 bytes can be free after a free of 10 or 985
    check_tiling(a.regions(), 1000)


# ---------------------------------------------------------------- stateful: fast vs reference vs model

class AllocatorMachine(RuleBasedStateMachine):
    """Drives the compiled and reference allocators and a dict model with the same operations."""

    @initialize(capacity_units=st.integers(1, 3000), max_allocs=st.integers(1, 48),
                alignment=st.sampled_from([1, 1, 2, 8, 64]))
    def setup(self, capacity_units, max_allocs, alignment):
        self.cap = capacity_units * alignment
        self.align = alignment
        self.foreign = OffsetAllocator(self.cap, 4, alignment=alignment).allocate(1).handle
        self.fast, self.slow = both(self.cap, max_allocs, alignment=alignment)
        self.model: dict[int, tuple[int, int, int]] = {}  # fast handle -> (offset, size, slow handle)
        self.dead: list[tuple[int, int]] = []  # freed (fast, slow) handles

    def sizes(self):
        return st.one_of(st.integers(1, min(self.cap, 64)), st.integers(1, self.cap))

    @rule(data=st.data())
    def allocate(self, data):
        size = data.draw(self.sizes())
        results = []
        for a in (self.fast, self.slow):
            try:
                results.append(a.allocate(size))
            except OutOfSpaceError as e:
                results.append((e.reason, e.free_bytes, e.largest_free_region_bytes, str(e)))
        f, s = results
        note(f"allocate({size}) -> {f} / {s}")
        event("allocate: ok" if isinstance(f, Allocation) else f"allocate: {f[0]}")
        if isinstance(f, Allocation):
            assert isinstance(s, Allocation) and (f.offset, f.size) == (s.offset, s.size)
            assert f.size == -(-size // self.align) * self.align and f.offset % self.align == 0
            self.model[f.handle] = (f.offset, f.size, s.handle)
        else:
            assert f == s
            if f[0] == api.NO_SPACE:  # the guarantee: no region of the search bound was free
                units = -(-size // self.align)
                assert f[2] // self.align < float_to_uint(uint_to_float_round_up(units))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        h = data.draw(st.sampled_from(sorted(self.model)))
        _, _, hs = self.model.pop(h)
        assert self.fast.allocation_size(h) == self.slow.allocation_size(hs)
        self.fast.free(h)
        self.slow.free(hs)
        self.dead.append((h, hs))

    @precondition(lambda self: self.dead)
    @rule(data=st.data())
    def free_dead_handle(self, data):
        h, hs = data.draw(st.sampled_from(self.dead))
        with pytest.raises(InvalidHandleError):
            self.fast.free(h)
        with pytest.raises(InvalidHandleError):
            self.slow.free(hs)

    @rule(data=st.data())
    def foreign_or_garbage_handle(self, data):
        h = data.draw(st.one_of(st.integers(0, 2**63 - 1), st.just(self.foreign)))
        assume(h not in self.model)
        with pytest.raises(InvalidHandleError):
            self.fast.free(h)
        with pytest.raises(InvalidHandleError):
            self.slow.free(h)

    @rule(data=st.data())
    def allocate_batch(self, data):
        sizes = data.draw(st.lists(self.sizes(), max_size=6))
        before = self.fast.regions()
        outcomes = []
        for a in (self.fast, self.slow):
            try:
                outcomes.append(a.allocate_batch(np.array(sizes, dtype=np.int64)))
            except OutOfSpaceError as e:
                outcomes.append(str(e))
        f, s = outcomes
        event("allocate_batch: rolled back" if isinstance(f, str) else "allocate_batch: ok")
        if isinstance(f, str):
            assert f == s and self.fast.regions() == before
        else:
            assert (f[0] == s[0]).all()
            for off, hf, hs, size in zip(f[0].tolist(), f[1].tolist(), s[1].tolist(), sizes):
                self.model[hf] = (off, -(-size // self.align) * self.align, hs)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), poison=st.booleans())
    def free_batch(self, data, poison):
        picked = data.draw(st.lists(st.sampled_from(sorted(self.model)), unique=True, max_size=5))
        fast_h = list(picked)
        slow_h = [self.model[h][2] for h in picked]
        if poison and self.dead:
            fh, sh = data.draw(st.sampled_from(self.dead))
            fast_h.append(fh)
            slow_h.append(sh)
            for a, hs in ((self.fast, fast_h), (self.slow, slow_h)):
                with pytest.raises(InvalidHandleError):
                    a.free_batch(hs)
            return
        self.fast.free_batch(fast_h)
        self.slow.free_batch(slow_h)
        for h, hs in zip(fast_h, slow_h):
            del self.model[h]
            self.dead.append((h, hs))

    @precondition(lambda self: self.model)
    @rule(pairs=st.integers(0, 12), seed=st.integers(0, 2**64 - 1), data=st.data())
    def churn(self, pairs, seed, data):
        lo = data.draw(st.integers(1, min(self.cap, 32)))
        hi = data.draw(st.integers(lo, min(self.cap, 256)))
        errs = []
        for a in (self.fast, self.slow):
            try:
                a.churn(pairs, lo, hi, seed)
                errs.append(None)
            except OutOfSpaceError as e:
                errs.append(str(e))
        assert errs[0] == errs[1]
        event("churn: ok" if errs[0] is None else "churn: out of space")
        # the live set changed inside the allocators: rebuild the model from both (node order)
        live_f, live_s = self.fast.live_allocations(), self.slow.live_allocations()
        assert [x[:2] for x in live_f] == [x[:2] for x in live_s]
        self.dead.extend((h, v[2]) for h, v in self.model.items() if h not in {x.handle for x in live_f})
        self.model = {f.handle: (f.offset, f.size, s.handle) for f, s in zip(live_f, live_s)}

    @rule()
    def reset(self):
        self.fast.reset()
        self.slow.reset()
        self.dead.extend((h, v[2]) for h, v in self.model.items())
        self.model.clear()

    @invariant()
    def agree_with_each_other_and_the_model(self):
        regions = self.fast.regions()
        assert regions == self.slow.regions()
        check_tiling(regions, self.cap)
        used = [(o, s) for o, s, is_free in regions if not is_free]
        assert used == sorted((o, s) for o, s, _ in self.model.values())
        rep, rep_slow = self.fast.storage_report(), self.slow.storage_report()
        assert rep == rep_slow
        assert rep.total_free_bytes == self.cap - sum(s for _, s, _ in self.model.values())
        assert rep.num_live_allocations == len(self.model)
        free_sizes = [s for _, s, is_free in regions if is_free]
        assert rep.largest_free_region_bytes == max(free_sizes, default=0)
        assert rep.num_free_regions == len(free_sizes)
        assert rep.num_free_nodes == self.fast.max_allocs - len(regions)

    def teardown(self):
        if not hasattr(self, "model"):
            return
        for h, (_, _, hs) in list(self.model.items()):
            self.fast.free(h)
            self.slow.free(hs)
        for a in (self.fast, self.slow):
            assert a.regions() == [(0, self.cap, True)]
            assert a.storage_report().largest_free_region_bytes == self.cap


TestAllocatorMachine = AllocatorMachine.TestCase


# ---------------------------------------------------------------- benchmark smoke test


def test_errors_pickle():
    import pickle

    e = pickle.loads(pickle.dumps(OutOfSpaceError("m", requested_bytes=5, free_bytes=1,
                                                  largest_free_region_bytes=1, reason=api.NO_SPACE)))
    assert (str(e), e.requested_bytes, e.reason) == ("m", 5, api.NO_SPACE)
    assert pickle.loads(pickle.dumps(InvalidHandleError("h", handle=7))).handle == 7
    with pytest.raises(TypeError):
        pickle.dumps(OffsetAllocator(64, 4))
