"""``quillcache.alloc.buffers``: page-aligned byte buffers, and the components that must use them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.alloc.buffers import PAGE_BYTES, aligned_empty, aligned_zeros


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3 * PAGE_BYTES + 17), shift=st.integers(0, 12), pretouch=st.booleans())
def test_every_buffer_starts_on_its_boundary_and_has_its_size(n, shift, pretouch):
    align = 1 << shift
    for make in (aligned_empty, aligned_zeros):
        a = make(n, align, pretouch=pretouch)
        assert a.dtype == np.uint8 and a.ndim == 1 and a.nbytes == n and a.flags.c_contiguous and a.flags.writeable
        assert n == 0 or a.ctypes.data % align == 0  # an empty array has no first byte to place
    z = aligned_zeros(n, align, pretouch=pretouch)
    assert not z.any()  # pretouching writes zeros: a zero buffer stays zero


def test_the_default_alignment_is_one_page():
    # small arrays come from malloc's 16-byte-aligned heap, large ones 16 bytes into a page: neither is a page
    for n in (1, 100, 4096, 1 << 20):
        for make in (aligned_empty, aligned_zeros):
            assert make(n).ctypes.data % PAGE_BYTES == 0, (make.__name__, n)


def test_the_buffer_outlives_every_other_reference():
    a = aligned_empty(5 * PAGE_BYTES, pretouch=True)
    a[:] = 7
    addr = a.ctypes.data
    view = memoryview(a)
    del a
    b = np.frombuffer(view, dtype=np.uint8)
    assert b.ctypes.data == addr and int(b.sum()) == 7 * 5 * PAGE_BYTES


@pytest.mark.parametrize("kwargs, message", [
    (dict(n_bytes=-1), "n_bytes"),
    (dict(n_bytes=10, alignment_bytes=0), "alignment_bytes"),
    (dict(n_bytes=10, alignment_bytes=48), "power of two"),
    (dict(n_bytes=10.5), "n_bytes"),
])
def test_bad_sizes_and_alignments_are_refused_by_name(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        aligned_empty(**kwargs)


def test_dram_store_segments_are_page_aligned():
    from quillcache.store.dram import LocalKvStore as DramStore

    s = DramStore(capacity_bytes=3 << 20, segment_bytes=1 << 20)
    assert len(s._buffers) == 3
    assert all(b.ctypes.data % PAGE_BYTES == 0 for b in s._buffers)
